"""``%dist pull`` of one parameter by its Hugging Face dotted name, under every strategy.

A tiny ``LlamaForCausalLM`` trains under ddp, fsdp (each decoder layer an FSDP unit) and tensor
(an explicit plan: attention and MLP projections column/row-wise, as Hugging Face's own ``tp_plan``);
the pulled tensor equals the kernel's copy bit for bit. Under pipeline the Llama does not trace with
torch.export (torch 2.13), so a ``nn.Sequential`` of Llama's own blocks (embedding, ``LlamaMLP``,
head) stands in: names such as ``net.1.up_proj.weight`` come from the stage that holds them.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

BODY = "x, = batch\nloss = model(input_ids=x, labels=x).loss"
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
NAMES = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight",
         "lm_head.weight", "model.norm.weight"]


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def tp_plan(num_layers: int = 2) -> dict:
    plan = {}
    for i in range(num_layers):
        at = f"model.layers.{i}."
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[at + proj] = ColwiseParallel()
        plan[at + "self_attn.o_proj"] = RowwiseParallel()
        plan[at + "mlp.down_proj"] = RowwiseParallel()
    return plan


def tokens(n: int = 16) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(2)
    return torch.utils.data.TensorDataset(torch.randint(0, 64, (n, 10), generator=g))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tensor"])
def test_pull_a_llama_parameter_by_its_hf_name(dist_session, shell, strategy):
    ns = shell.user_ns
    name = f"hfpull_{strategy}"
    ns[name], ns["hfpull_tokens"], ns["hfpull_tp"] = tiny_llama(), tokens(), tp_plan()
    extra = {"tp_plan": "hfpull_tp"} if strategy == "tensor" else {}
    result = dist_session.train(BODY, model=name, data="hfpull_tokens", epochs=1, batch_size=4, optimizer="sgd",
                                lr=0.5, strategy=strategy, progress="none", quiet=True, **extra)
    assert result.num_trainable_params == result.num_params and "parameters trained" not in result.title
    for key in NAMES:
        got = dist_session.pull(f"{name}.{key}")
        want = ns[name].get_parameter(key).detach()
        assert type(got) is torch.Tensor and got.shape == want.shape and torch.equal(got, want), key
    got = shell.run_line_magic("dist", f"pull {name}.model.layers.0.mlp.up_proj.weight")
    assert torch.equal(got, ns[name].model.layers[0].mlp.up_proj.weight.detach())


def test_pull_a_parameter_of_a_hf_block_by_name_under_pipeline(dist_session, shell):
    ns = shell.user_ns
    config = transformers.LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    ns["hfpull_pipe"] = nn.Sequential(nn.Embedding(64, 32), LlamaMLP(config), LlamaMLP(config), nn.Linear(32, 64))
    ns["hfpull_tokens"], ns["F"] = tokens(), F
    body = "x, = batch\nloss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())"
    dist_session.train(body, model="hfpull_pipe", data="hfpull_tokens", epochs=1, batch_size=4, optimizer="sgd",
                       lr=0.5, strategy="pipeline", progress="none", quiet=True)
    for key in ("1.up_proj.weight", "2.down_proj.weight", "0.weight", "3.bias"):
        got = dist_session.pull(f"hfpull_pipe.{key}")
        assert torch.equal(got, ns["hfpull_pipe"].get_parameter(key).detach()), key
