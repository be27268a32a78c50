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
