"""``--load PATH`` on the real 2-rank cluster: Hugging Face folders read on the ranks, each rank its slices.

A tiny ``LlamaForCausalLM`` and a tiny ``GPT2LMHeadModel`` (tied head) are built from configs, saved
with ``save_pretrained`` into at least 3 shard files, and loaded on the ranks into a model of the same
class with other (random) weights; what every rank then holds must equal ``from_pretrained`` in one
process to 1e-6, under ddp, fsdp, tensor and pipeline, and the weights that come back to the notebook too.
"""

import json
import os

import pytest
import torch

from support.hfmodels import build, from_pretrained, save_sharded

# one step with lr 0: the weights stay as loaded (the cell distributes, loads, and runs the model once)
BODY = "(ids,) = batch\nloss = model(input_ids=ids, labels=ids).loss"
PIPE_BODY = "(ids,) = batch\nout = model(ids)\nloss = out.float().pow(2).mean()"

HELD = """
import torch
from torch.distributed.tensor import DTensor
_held = {{n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
          for n, t in {name}.state_dict(keep_vars=True).items()}}
_held = {{n: t for n, t in _held.items() if not t.is_meta}}
"""


def ranks_weights(dist_session, name):
    """Per rank: the model's tensors it holds, as full tensors."""
    dist_session.run(HELD.format(name=name))
    return dist_session.pull("_held")


def assert_equal_to(held: dict, ref, atol=1e-6):
    want = ref.state_dict()
    for key, t in held.items():
        torch.testing.assert_close(t, want[key], atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


def tp_plan_llama():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(2):
        plan.update({f"model.layers.{i}.mlp.gate_proj": ColwiseParallel(), f"model.layers.{i}.mlp.up_proj":
                     ColwiseParallel(), f"model.layers.{i}.mlp.down_proj": RowwiseParallel()})
    return plan


def files_read(held_keys, weight_map) -> set:
    return {weight_map[k] for k in held_keys if k in weight_map}


# GPT-2's Conv1D layers are not Linear: tensor parallel is shown on Llama (its MLP column- then row-wise)
@pytest.mark.parametrize("kind,strategy", [("llama", "ddp"), ("llama", "fsdp"), ("llama", "tensor"), ("gpt2", "ddp"),
                                           ("gpt2", "fsdp"), ("llama", "fsdp+tensor")])
def test_hf_folder_loads_as_from_pretrained(dist_session, shell, tmp_path, capsys, strategy, kind):
    folder = str(tmp_path / kind)
    weight_map = save_sharded(build(kind, seed=1), folder, num_files=3)
    ref = from_pretrained(kind, folder)
    ns = shell.user_ns
    name = f"hf_{kind}_{strategy}".replace("+", "_")
    ns[name] = build(kind, seed=2)  # other weights: the load must replace every one of them
    ns["hf_ids"] = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12)))
    extra = {}
    if strategy in ("tensor", "fsdp+tensor"):
        ns["tp_llama"] = tp_plan_llama()
        extra["tp_plan"] = "tp_llama"
    if strategy == "fsdp+tensor":  # 2 ranks: tensor parallel within the one group of 2 (--mesh 1x2)
        extra["mesh"] = "1x2"
    dist_session.train(BODY, model=name, data="hf_ids", epochs=1, batch_size=4, optimizer="sgd", lr=0.0,
                       strategy=strategy, load=folder, progress="none", **extra)
    out = capsys.readouterr().out
    assert f"loaded {folder} into {name} on 2 ranks" in out
    per_rank = ranks_weights(dist_session, name)
    for held in per_rank:
        assert_equal_to(held, ref)
        assert len(files_read(held, weight_map)) >= 2  # no rank's slices come from one file only
    assert_equal_to(ns[name].state_dict(), ref)  # and the weights that came back to the notebook
    if kind == "gpt2":
        assert ns[name].lm_head.weight is ns[name].transformer.wte.weight  # the tie survives


def test_pipeline_stages_load_their_own_tensors(dist_session, shell, tmp_path, capsys):
    """A pipeline of Linear layers saved as a sharded safetensors folder: each stage reads its own layers."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    ref = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    sd = ref.state_dict()
    keys = list(sd)
    folder = tmp_path / "pipe"
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate([keys[0:4], keys[4:8], keys[8:12]]):  # the middle file spans both stages
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, str(folder / file))
        weight_map.update({k: file for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ns = shell.user_ns
    torch.manual_seed(4)
    ns["pipe_net"] = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    ns["pipe_x"] = torch.utils.data.TensorDataset(torch.randn(8, 16))
    dist_session.train(PIPE_BODY, model="pipe_net", data="pipe_x", epochs=1, batch_size=4, optimizer="sgd", lr=0.0,
                       strategy="pipeline", load=str(folder), progress="none")
    per_rank = ranks_weights(dist_session, "pipe_net")
    assert [len(files_read(h, weight_map)) for h in per_rank] == [2, 2]
    for held in per_rank:
        assert_equal_to(held, ref)
    assert_equal_to(ns["pipe_net"].state_dict(), ref)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_meta_model_needs_no_init_for_what_is_loaded(dist_session, shell, tmp_path, strategy):
    """A GPT-2 built on the meta device: the ranks place it, the load fills every tensor (no reset_parameters
    needed for them), and the weights equal from_pretrained; the notebook's model stays on meta."""
    folder = str(tmp_path / "gpt2")
    save_sharded(build("gpt2", seed=5), folder, num_files=3)
    ref = from_pretrained("gpt2", folder)
    ns = shell.user_ns
    name = f"meta_gpt2_{strategy}"
    ns[name] = build("gpt2", meta=True)
    ns["hf_ids"] = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12)))
    dist_session.train(BODY, model=name, data="hf_ids", epochs=1, batch_size=4, optimizer="sgd", lr=0.0,
                       strategy=strategy, load=folder, progress="none", quiet=True)
    for held in ranks_weights(dist_session, name):
        assert_equal_to(held, ref)
    assert ns[name].transformer.wte.weight.is_meta


def test_dist_load_puts_weights_into_a_held_model(dist_session, shell, tmp_path, capsys):
    """``%dist load PATH --model NAME`` with a single safetensors file, into a kernel-held model: ranks and notebook."""
    from safetensors.torch import save_file

    torch.manual_seed(6)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    file = str(tmp_path / "weights.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}, file)
    ns = shell.user_ns
    ns["held_net"] = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    shell.run_line_magic("dist", f"load {file} --model held_net")
    out = capsys.readouterr().out
    assert out.count("4 tensors stored as bfloat16 become float32") == 1  # the dtype conversion, said once
    want = {k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()}
    for held in [*ranks_weights(dist_session, "held_net"), ns["held_net"].state_dict()]:
        for k, t in want.items():
            assert torch.equal(held[k], t), k


def test_loading_into_a_meta_model_keeps_the_kernel_flat_and_each_rank_to_its_share(dist_session, shell, tmp_path):
    """256 MiB (4 tensors of 64 MiB in 2 files) into a meta model under fsdp (the 1 GiB figure:
    benchmarks/load_memory.py): the kernel grows < 64 MiB, each rank's peak from before the model was sent
    stays below its share plus one file's largest tensor, and the weights are the file's. (Measured: the share
    plus about 17 MiB, the structure received and FSDP's placement, whatever the model's size.)"""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import load_memory

    folder = str(tmp_path / "big")
    load_memory.write_folder(folder, layers=4, dim=4096, files=2, seed=9)
    model = load_memory.meta_model(4, 4096)
    shell.user_ns["big_meta"] = model
    got = load_memory.measure(dist_session, "big_meta", model, folder)
    assert got["kernel_growth"] < 64 * 2 ** 20, got
    for peak in got["rank_peaks"]:
        assert peak < got["share"] + got["largest_tensor"], got
    dist_session.run(CHECK_SLICES.format(name="big_meta", folder=folder))
    assert dist_session.pull("_worst") == [0.0, 0.0]


# every rank: its shards against the file's bytes for the same rows (safetensors, read here for the check only)
CHECK_SLICES = """
import json, os
from safetensors import safe_open
_map = json.load(open(os.path.join({folder!r}, "model.safetensors.index.json")))["weight_map"]
_worst = 0.0
for _n, _p in {name}.state_dict().items():
    _local = _p.to_local()
    _rows = _p.device_mesh.get_coordinate()[0] * -(-_p.shape[0] // _p.device_mesh.size())
    with safe_open(os.path.join({folder!r}, _map[_n]), "pt") as _f:
        _want = _f.get_slice(_n)[_rows:_rows + _local.shape[0]]
    _worst = max(_worst, (_local - _want).abs().max().item())
"""


def test_dcp_checkpoint_loads_into_another_strategy(dist_session, shell, tmp_path):
    """What %dist save wrote (DCP, fsdp shards) loads with --load into a fresh model under ddp: weights only."""
    ns = shell.user_ns
    torch.manual_seed(11)
    ns["saved_net"] = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ns["saved_x"] = torch.utils.data.TensorDataset(torch.randn(16, 6))
    plain = "x, = batch\nloss = model(x).pow(2).mean()"
    dist_session.train(plain, model="saved_net", data="saved_x", epochs=2, batch_size=4, optimizer="sgd", lr=0.1,
                       strategy="fsdp", progress="none", quiet=True)
    dist_session.save(str(tmp_path / "ck"), model="saved_net", quiet=True)
    trained = {k: v.clone() for k, v in ns["saved_net"].state_dict().items()}
    ns["fresh_net"] = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    dist_session.train(plain, model="fresh_net", data="saved_x", epochs=1, batch_size=4, optimizer="sgd", lr=0.0,
                       strategy="ddp", load=str(tmp_path / "ck"), progress="none", quiet=True)
    for held in [*ranks_weights(dist_session, "fresh_net"), ns["fresh_net"].state_dict()]:
        for k, t in trained.items():
            torch.testing.assert_close(held[k], t, atol=1e-6, rtol=0)


def test_hf_folder_loads_into_pipeline_stages(dist_session, shell, tmp_path, kind="llama"):
    """Pipeline stages of a Hugging Face Llama, each loaded with its own tensors (the split distnb makes before
    tracing; training HF causal LMs as a pipeline needs a traceable forward, which their cache outputs are not;
    GPT-2's tied embedding and head cannot sit in two stages, which the pipeline strategy refuses)."""
    from distnb.train import pretrained, training
    from distnb.core.plan import TrainPlan

    folder = str(tmp_path / kind)
    weight_map = save_sharded(build(kind, seed=1), folder, num_files=3)
    ref = from_pretrained(kind, folder)
    name = f"pipe_{kind}"
    shell.user_ns[name] = build(kind, seed=2)
    # the balanced split gives the lm_head a stage alone; this one has each stage read from two files or more
    plan = TrainPlan(model=name, data=name, strategy="pipeline", split=("model.layers.1",), load=folder)
    training.ensure_model(dist_session, plan, shell.user_ns[name], quiet=True)
    pretrained.load_on_ranks(dist_session, plan, pretrained.check(plan, shell.user_ns[name]), quiet=True)
    per_rank = ranks_weights(dist_session, name)
    assert set(per_rank[0]) != set(per_rank[1])  # two stages, each its own tensors
    for held in per_rank:
        assert_equal_to(held, ref)
        assert len(files_read(held, weight_map)) >= 2


HF_INIT = """
def hf_init(module):
    meta_llama._init_weights(module)
"""


def test_meta_llama_with_an_init_for_what_the_files_lack(dist_session, shell, tmp_path):
    """A meta Llama: the files fill its parameters, ``--init`` (Hugging Face's ``_init_weights``) its rotary
    buffers, which no file holds; the loss of a step at lr 0 equals from_pretrained's on the same data."""
    folder = str(tmp_path / "llama")
    save_sharded(build("llama", seed=1), folder, num_files=3)
    ref = from_pretrained("llama", folder)
    ns = shell.user_ns
    ns["meta_llama"] = build("llama", meta=True)
    shell.run_cell(HF_INIT)
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    ns["llama_ids"] = torch.utils.data.TensorDataset(ids)
    result = dist_session.train(BODY, model="meta_llama", data="llama_ids", epochs=1, batch_size=4, optimizer="sgd",
                                lr=0.0, strategy="fsdp", load=folder, init="hf_init", progress="none", quiet=True)
    for held in ranks_weights(dist_session, "meta_llama"):
        assert_equal_to(held, ref)
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids).loss.item()
    assert abs(result.epoch_losses[0] - want) < 1e-5, (result.epoch_losses, want)
