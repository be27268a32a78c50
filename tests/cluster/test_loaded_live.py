"""A model filled by ``%dist load PATH --model NAME`` is live on the ranks as a trained one, before any training cell.

A tiny ``LlamaForCausalLM`` saved with ``save_pretrained`` (3 files) is loaded on the real 2-rank cluster into a
model of the same class with other weights (kernel-held, or built on the meta device), under ddp and fsdp. Then,
with no ``%%distrain`` cell in between: ``%dist save --format safetensors`` writes exactly the loaded tensors
(bit for bit, the source files' dtypes), ``%dist save`` (DCP) writes a checkpoint that ``%dist load`` restores
bit for bit, ``%dist pull`` gives the source tensor, and a training cell at lr 0 goes on from the loaded weights.
"""

import glob
import os

import pytest
import torch

from support.hfmodels import build, save_sharded

BODY = "(ids,) = batch\nloss = model(input_ids=ids, labels=ids).loss"
HELD = """
import torch
from torch.distributed.tensor import DTensor
_held = {{n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
          for n, t in {name}.state_dict(keep_vars=True).items()}}
_held = {{n: t for n, t in _held.items() if not t.is_meta}}
"""
CASES = [("ddp", False), ("ddp", True), ("fsdp", False), ("fsdp", True)]


def folder_tensors(folder) -> dict:
    """Every tensor of the safetensors files in ``folder``, by name."""
    from safetensors.torch import load_file

    out = {}
    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(file))
    return out


def assert_bit_exact(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), f"{what}: {key}"


def ranks_weights(dist_session, name) -> list:
    """Per rank: the model's tensors it holds, as full tensors."""
    dist_session.run(HELD.format(name=name))
    return dist_session.pull("_held")


def loaded(shell, tmp_path, strategy, meta, tag) -> tuple:
    """A Llama folder, and a model of the same class (other weights) loaded from it on the ranks: (name, source
    tensors, folder)."""
    folder = str(tmp_path / "llama")
    save_sharded(build("llama", seed=1), folder, num_files=3)
    name = f"live_{tag}_{strategy}_{'meta' if meta else 'held'}"
    shell.user_ns[name] = build("llama", seed=2, meta=meta)
    shell.run_line_magic("dist", f"load {folder} --model {name} --strategy {strategy}")
    return name, folder_tensors(folder), folder


@pytest.mark.parametrize("strategy,meta", CASES)
def test_loaded_model_saves_as_safetensors_bit_exact(shell, tmp_path, capsys, strategy, meta):
    name, source, _ = loaded(shell, tmp_path, strategy, meta, "st")
    out = tmp_path / "out"
    shell.run_line_magic("dist", f"save {out} --format safetensors")  # no --model: the model just loaded
    assert f"saved {name} to {out}" in capsys.readouterr().out
    assert_bit_exact(folder_tensors(str(out)), source, "the files saved after the load")


@pytest.mark.parametrize("strategy,meta", CASES)
def test_loaded_model_checkpoint_loads_back_bit_exact(dist_session, shell, tmp_path, capsys, strategy, meta):
    name, source, _ = loaded(shell, tmp_path, strategy, meta, "ck")
    shell.run_line_magic("dist", f"save {tmp_path / 'ck'} --model {name}")
    assert "saved" in capsys.readouterr().out
    again = f"{name}_again"
    shell.user_ns[again] = build("llama", seed=3, meta=meta)
    shell.run_line_magic("dist", f"load {tmp_path / 'ck'} --model {again}")
    for held in ranks_weights(dist_session, again):
        assert_bit_exact(held, source, f"{again} on a rank")
    if not meta:  # the restored weights came back to the notebook too
        assert_bit_exact(dict(shell.user_ns[again].state_dict()), source, f"the notebook's {again}")


@pytest.mark.parametrize("strategy,meta", CASES)
def test_loaded_model_pulls_the_source_tensor(dist_session, shell, tmp_path, strategy, meta):
    name, source, _ = loaded(shell, tmp_path, strategy, meta, "pull")
    key = "model.layers.0.mlp.up_proj.weight"
    shell.run_line_magic("dist", f"pull {name}.{key} -o live_pulled")
    assert torch.equal(shell.user_ns["live_pulled"], source[key])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_next_cell_goes_on_from_the_loaded_weights(dist_session, shell, tmp_path, strategy):
    """A meta model: a cell that sent it again would initialise it afresh; one step at lr 0 keeps the loaded ones."""
    name, source, _ = loaded(shell, tmp_path, strategy, True, "next")
    shell.user_ns["live_ids"] = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12)))
    dist_session.train(BODY, model=name, data="live_ids", epochs=1, batch_size=4, optimizer="sgd", lr=0.0,
                       progress="none", quiet=True)
    for held in ranks_weights(dist_session, name):
        assert_bit_exact(held, source, f"{name} on a rank after the cell")


def test_a_checkpoint_keeps_its_strategy(dist_session, shell, tmp_path):
    """``--strategy`` with a checkpoint other than its own: refused, naming the training cell that reads its weights."""
    from distnb.core.errors import PlanError

    name, _, _ = loaded(shell, tmp_path, "ddp", False, "keep")
    dist_session.save(str(tmp_path / "ck"), model=name, quiet=True)
    with pytest.raises(PlanError, match=r"%%distrain --load .* --strategy fsdp"):
        dist_session.load(str(tmp_path / "ck"), model=name, strategy="fsdp", quiet=True)


def test_a_cell_resumes_from_a_loaded_model_s_checkpoint(dist_session, shell, tmp_path, capsys):
    """``--checkpoint-dir`` holding the checkpoint of a model loaded and not trained (no optimizer state in it): a new
    model resumes its weights and position, with a fresh optimizer of the cell's."""
    name, source, _ = loaded(shell, tmp_path, "fsdp", False, "resume")
    dist_session.save(str(tmp_path / "ck"), model=name, quiet=True)
    again = f"{name}_again"
    shell.user_ns[again] = build("llama", seed=3)
    shell.user_ns["live_ids"] = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12)))
    result = dist_session.train(BODY, model=again, data="live_ids", epochs=1, batch_size=4, optimizer="sgd", lr=0.0,
                                strategy="fsdp", checkpoint_dir=str(tmp_path / "ck"), progress="none", quiet=True)
    assert result.rows[0]["resumed"], result.rows[0]
    for held in ranks_weights(dist_session, again):
        assert_bit_exact(held, source, f"{again} on a rank after resuming")
