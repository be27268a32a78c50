"""``%dist save DIR --format safetensors``: a Hugging Face folder that ``from_pretrained`` reads back.

A tiny ``LlamaForCausalLM`` and a tiny ``GPT2LMHeadModel`` (tied head), built from configs (nothing is
downloaded), train a few steps on the real 2-rank cluster under each strategy; the ranks write the folder
(sharded: several files, with the index and config.json); ``AutoModelForCausalLM.from_pretrained`` in
this process must equal the trained weights (the ones the ranks hold, back in the notebook's model) to 1e-6.
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

BODY = "x = batch[0]\nloss = model(input_ids=x, labels=x).loss"
VOCAB = 64


def tiny(kind: str):
    torch.manual_seed(3)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def tokens():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (16, 12), generator=g))


def train(dist_session, shell, name, kind, strategy, **kw):
    ns = shell.user_ns
    ns[name], ns["hf_tokens"] = tiny(kind), tokens()
    dist_session.train(BODY, model=name, data="hf_tokens", epochs=1, batch_size=4, strategy=strategy,
                       optimizer="adam", lr=0.01, progress="none", quiet=True, **kw)
    return ns[name]


def assert_same(loaded, trained):
    want = trained.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for key, t in want.items():
        torch.testing.assert_close(got[key], t, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")


CASES = [("llama", "ddp"), ("llama", "fsdp"), ("gpt2", "ddp"), ("gpt2", "fsdp"), ("llama", "tensor")]
STRATEGY_OPTIONS = {"tensor": {"tp_plan": "hf_tp_plan"}}


def llama_mlp_plan():
    """Tensor parallel over the MLPs only (gate and up column-wise, down row-wise), as torchtitan splits them."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(2):
        plan.update({f"model.layers.{i}.mlp.gate_proj": ColwiseParallel(), f"model.layers.{i}.mlp.up_proj":
                     ColwiseParallel(), f"model.layers.{i}.mlp.down_proj": RowwiseParallel()})
    return plan


@pytest.mark.parametrize("kind,strategy", CASES)
def test_safetensors_folder_from_pretrained(dist_session, shell, tmp_path, kind, strategy):
    name = f"hf_{kind}_{strategy}"
    shell.user_ns["hf_tp_plan"] = llama_mlp_plan()
    trained = train(dist_session, shell, name, kind, strategy, **STRATEGY_OPTIONS.get(strategy, {}))
    start = tiny(kind).state_dict()
    assert any(not torch.equal(t, start[k]) for k, t in trained.state_dict().items()), "the cell did not train"
    out = tmp_path / "hf"
    meta = dist_session.save(str(out), model=name, format="safetensors", max_shard_size=20_000, quiet=True)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) >= 3 and files == meta["files"]
    assert all(f.startswith("model-") and f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert (out / "config.json").exists() and not (out / "sharded").exists()
    if kind == "gpt2":  # the tie is written once, as transformers writes it
        assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(loaded) is type(trained)
    assert_same(loaded, trained)
    if kind == "gpt2":
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def read_folder(path) -> dict:
    """Every tensor of a safetensors folder, through its index (what from_pretrained does, for any model)."""
    from safetensors.torch import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(path / file))
    assert set(tensors) == set(index["weight_map"])
    return tensors


@pytest.mark.parametrize("strategy", ["pipeline", "ps", "fsdp"])
def test_plain_model_folder(dist_session, shell, tmp_path, strategy):
    """A model that is not a transformers one (no config): every strategy's parts, one file per tensor here."""
    from support.data import blobs, mlp

    ns = shell.user_ns
    name = f"hf_plain_{strategy}"
    ns[name], ns["hf_blobs"] = mlp(8, 16, 8, 2, seed=7), blobs(64, num_features=8, num_classes=2, num_summed=3)
    ns["F"] = torch.nn.functional
    dist_session.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", model=name, data="hf_blobs", epochs=1,
                       batch_size=8, strategy=strategy, progress="none", quiet=True,
                       **({"microbatches": 2} if strategy == "pipeline" else {}))
    meta = dist_session.save(str(tmp_path / "out"), model=name, format="safetensors", max_shard_size=1, quiet=True)
    assert not meta["config"] and not (tmp_path / "out" / "config.json").exists()
    got, want = read_folder(tmp_path / "out"), ns[name].state_dict()
    assert len(meta["files"]) == len(want) and set(got) == set(want)
    for key, t in want.items():
        torch.testing.assert_close(got[key], t, atol=0, rtol=0, msg=lambda m: f"{key}: {m}")


def test_meta_model_folder(dist_session, shell, tmp_path):
    """A Llama kept on the meta device in the notebook: the ranks materialise, train and write it; the kernel
    holds no weights, and the folder equals what the ranks hold."""
    ns = shell.user_ns
    config = tiny("llama").config
    with torch.device("meta"):
        ns["hf_meta"] = transformers.LlamaForCausalLM(config)
    ns["hf_tokens"] = tokens()
    shell.run_cell(HF_INIT, silent=True)
    dist_session.train(BODY, model="hf_meta", data="hf_tokens", epochs=1, batch_size=4, strategy="fsdp",
                       optimizer="adam", lr=0.01, progress="none", quiet=True, init="hf_init")
    assert all(t.is_meta for t in ns["hf_meta"].state_dict().values())
    dist_session.save(str(tmp_path / "meta"), model="hf_meta", format="safetensors", quiet=True)
    dist_session.run(PULL)
    held = {}
    for part in dist_session.pull("_hf_held"):
        held.update(part)
    got = read_folder(tmp_path / "meta")
    assert set(got) == set(held)  # Llama ties no weights by default
    for key, t in got.items():
        torch.testing.assert_close(t, held[key], atol=0, rtol=0, msg=lambda m: f"{key}: {m}")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "meta"))
    for key, t in loaded.state_dict().items():
        torch.testing.assert_close(t, held[key], atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")


# every rank: the meta model's tensors as full ones (a collective for DTensors)
PULL = """
from torch.distributed.tensor import DTensor
_hf_held = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for n, t in hf_meta.state_dict(keep_vars=True).items()}
"""

# the --init function of a meta Llama (notebook code: it travels by value): what its modules' __init__ does
HF_INIT = """
def hf_init(module):
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif hasattr(module, "variance_epsilon"):  # LlamaRMSNorm
        module.weight.fill_(1.0)
    elif hasattr(module, "inv_freq"):  # LlamaRotaryEmbedding
        inv_freq, _ = module.compute_default_rope_parameters(module.config)
        module.inv_freq.copy_(inv_freq)
        module.original_inv_freq.copy_(inv_freq)
"""


def test_bad_requests_are_clear_errors_and_the_cluster_stays_usable(dist_session, shell, tmp_path):
    from distnb.core.errors import PlanError

    train(dist_session, shell, "hf_bad", "llama", "ddp")
    with pytest.raises(PlanError, match="--format 'gguf' is not one of dcp, safetensors"):
        dist_session.save(str(tmp_path / "a"), model="hf_bad", format="gguf", quiet=True)
    with pytest.raises(PlanError, match="max_shard_size must be a positive size"):
        dist_session.save(str(tmp_path / "a"), model="hf_bad", format="safetensors", max_shard_size="big", quiet=True)
    assert not (tmp_path / "a").exists()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(PlanError, match=rf"not every rank can write it \(ranks 0-1 on \S+: {blocker} is a file, not a "
                                        "folder\); give a folder every rank can create"):
        dist_session.save(str(blocker / "hf"), model="hf_bad", format="safetensors", quiet=True)
    meta = dist_session.save(str(tmp_path / "ok"), model="hf_bad", format="safetensors", quiet=True)  # usable still
    assert meta["files"] == ["model-00001-of-00001.safetensors"]
    assert_same(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ok")), shell.user_ns["hf_bad"])


def test_magic_help_and_options(dist_session, shell, tmp_path, capsys):
    """``%dist save`` takes --format and --adapters; its help shows examples of both."""
    train_ns = shell.user_ns
    shell.run_line_magic("dist", "save --help")
    out = capsys.readouterr().out
    assert "--format safetensors" in out and "%dist save --adapters out/lora" in out
    train(dist_session, shell, "hf_magic", "gpt2", "fsdp")
    shell.run_line_magic("dist", f"save {tmp_path / 'm'} --model hf_magic --format safetensors")
    assert "AutoModel*.from_pretrained(DIR) reads it" in capsys.readouterr().out
    assert_same(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")), train_ns["hf_magic"])


def _status(key: str, pid="self") -> int:
    """A /proc/PID/status figure in bytes (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_the_kernel_holds_none_of_the_model_while_the_ranks_save_it(dist_session, shell, tmp_path):
    """A 104 MiB Llama kept on meta, trained one step under fsdp, saved as safetensors: the kernel's peak
    resident memory during the save rises by less than 16 MiB (a sixth of the model); rank 1's too (it streams
    its shard to its file one tensor at a time); rank 0's by less than two of the largest tensor (it joins the
    files into full tensors one at a time)."""
    ns = shell.user_ns
    config = transformers.LlamaConfig(vocab_size=16384, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32)
    with torch.device("meta"):
        ns["hf_big"] = transformers.LlamaForCausalLM(config)
    size = sum(p.numel() * 4 for p in ns["hf_big"].parameters())
    largest = max(p.numel() * 4 for p in ns["hf_big"].parameters())
    assert 95 * 2**20 < size < 110 * 2**20
    g = torch.Generator().manual_seed(0)
    ns["hf_big_tokens"] = torch.utils.data.TensorDataset(torch.randint(0, 16384, (4, 8), generator=g))
    shell.run_cell(HF_INIT, silent=True)
    dist_session.train(BODY, model="hf_big", data="hf_big_tokens", epochs=1, batch_size=2, strategy="fsdp",
                       optimizer="sgd", lr=0.01, progress="none", quiet=True, init="hf_init")
    dist_session.run("import os\n_hf_rss = int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0]"
                     ".split()[1]) * 1024\nopen('/proc/self/clear_refs', 'w').write('5')")  # VmHWM := VmRSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    meta = dist_session.save(str(tmp_path / "big"), model="hf_big", format="safetensors", quiet=True)
    kernel_rise = _status("VmHWM") - before
    assert meta["num_bytes"] == size
    assert kernel_rise < 16 * 2**20, f"the kernel's peak rose {kernel_rise / 2**20:.1f} MiB during the save"
    dist_session.run("_hf_rise = int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]"
                     ".split()[1]) * 1024 - _hf_rss")
    rises = dist_session.pull("_hf_rise")  # rank 0 consolidates the files into full tensors, one at a time
    assert rises[0] < 2 * largest + 16 * 2**20, f"rank 0's peak rose {rises[0] / 2**20:.1f} MiB during the save"
    assert rises[1] < 16 * 2**20, f"rank 1's peak rose {rises[1] / 2**20:.1f} MiB during the save (its shard " \
        "streams to its file)"
    with open(tmp_path / "big" / "model.safetensors.index.json") as f:
        assert json.load(f)["metadata"]["total_size"] == size


@pytest.mark.parametrize("kind,strategy", [("llama", "fsdp"), ("gpt2", "ddp")])
def test_a_folder_loaded_on_the_ranks_saves_back_the_same_tensors(dist_session, shell, tmp_path, kind, strategy):
    """save_pretrained's folder -> --load on the ranks (no step: lr 0) -> %dist save --format safetensors: the
    same names and the same tensors, bit for bit, as transformers wrote them (GPT-2's tie left out both times)."""
    source = tmp_path / "source"
    tiny(kind).save_pretrained(str(source), max_shard_size="40KB")
    ns = shell.user_ns
    name = f"hf_back_{kind}"
    ns[name], ns["hf_tokens"] = tiny(kind), tokens()
    torch.nn.init.zeros_(next(ns[name].parameters()))  # not the folder's weights: the load must replace them
    dist_session.train(BODY, model=name, data="hf_tokens", epochs=1, batch_size=4, strategy=strategy,
                       optimizer="sgd", lr=0.0, load=str(source), progress="none", quiet=True)
    dist_session.save(str(tmp_path / "back"), model=name, format="safetensors", max_shard_size="40KB", quiet=True)
    want, got = read_folder(source), read_folder(tmp_path / "back")
    assert set(got) == set(want)
    for key, t in want.items():
        assert torch.equal(got[key], t), key
