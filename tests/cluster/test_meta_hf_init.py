"""A Hugging Face model built on the meta device needs no ``--init``: its own ``_init_weights`` fills
what has no ``reset_parameters()`` (Llama's RMSNorm weights, the rotary ``inv_freq`` buffers, which are
non-persistent and so never in a checkpoint), stated once.
"""

import pytest
import torch

from distnb.engine.transport import shard
from support.hfmodels import LLAMA, build, from_pretrained, save_sharded

transformers = pytest.importorskip("transformers")

BODY = "(ids,) = batch\nloss = model(input_ids=ids, labels=ids).loss"
RANK_BUFFERS = """
import torch
from torch.distributed.tensor import DTensor
_bufs = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in
         list({name}.named_buffers()) + [(n, p) for n, p in {name}.named_parameters() if "norm" in n]}
"""


def ids(n=8, length=12, seed=0):
    return torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))


def test_meta_llama_loads_and_trains_without_init_as_from_pretrained_does(dist_session, shell, tmp_path, capsys):
    """--load and no --init: the rotary buffers come from the model's _init_weights, then 2 epochs of SGD on
    2 fsdp ranks equal from_pretrained trained on the same global batches in one process, to 1e-5."""
    folder = str(tmp_path / "llama")
    save_sharded(build("llama", seed=1), folder, num_files=3)
    ref = from_pretrained("llama", folder).train()
    ns = shell.user_ns
    ns["meta_llama_noinit"] = build("llama", meta=True)
    x = ids()
    ns["noinit_ids"] = torch.utils.data.TensorDataset(x)
    capsys.readouterr()
    result = dist_session.train(BODY, model="meta_llama_noinit", data="noinit_ids", epochs=2, batch_size=4,
                                optimizer="sgd", lr=0.5, seed=3, strategy="fsdp", load=folder, progress="none",
                                quiet=True)
    out = capsys.readouterr().out
    assert out.count("initialised as Hugging Face does") == 1, out
    assert "LlamaRotaryEmbedding with LlamaModel._init_weights" in out, out
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    for epoch in range(2):
        total = []
        for idx in shard.global_batches(len(x), 2, 3, epoch, 4, False):
            opt.zero_grad()
            loss = ref(input_ids=x[idx], labels=x[idx]).loss
            loss.backward()
            opt.step()
            total.append(loss.item())
        losses.append(sum(total) / len(total))
    assert result.epoch_losses == pytest.approx(losses, abs=1e-5)
    name = "model.layers.1.self_attn.q_proj.weight"
    pulled = dist_session.pull(f"meta_llama_noinit.{name}", rank=0)
    torch.testing.assert_close(pulled, ref.state_dict()[name], atol=1e-5, rtol=0)


def test_meta_llama_without_load_or_init_gets_hf_norms_and_rotary_buffers(dist_session, shell, capsys):
    """No --load, no --init: the norms and the rotary inv_freq buffers equal a one-process build to 1e-6, and
    the Linear and Embedding weights follow Hugging Face's N(0, initializer_range), as post_init gives them in
    one process (not torch's kaiming or N(0, 1): an embedding's std near 1 would be a different model)."""
    ns = shell.user_ns
    ns["meta_llama_bare"] = build("llama", meta=True)
    ns["bare_ids"] = torch.utils.data.TensorDataset(ids())
    capsys.readouterr()
    dist_session.train(BODY, model="meta_llama_bare", data="bare_ids", epochs=1, batch_size=4, optimizer="sgd",
                       lr=0.0, strategy="fsdp", progress="none", quiet=True)
    assert capsys.readouterr().out.count("initialised as Hugging Face does") == 1
    dist_session.run(RANK_BUFFERS.replace("{name}", "meta_llama_bare"))
    ref = build("llama", seed=0)
    want = {**dict(ref.named_buffers()), **{n: p for n, p in ref.named_parameters() if "norm" in n}}
    for held in dist_session.pull("_bufs"):
        assert set(held) == set(want)
        for key, t in held.items():
            torch.testing.assert_close(t, want[key], atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")
    std = ref.config.initializer_range
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
        pulled = dist_session.pull(f"meta_llama_bare.{name}", rank=0)
        assert abs(pulled.mean().item()) < std / 4, name
        assert pulled.std().item() == pytest.approx(std, rel=0.15), name  # kaiming: ~1/sqrt(3*fan_in); N(0, 1)


STATE = """
import torch
from torch.distributed.tensor import DTensor
_state = {{n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
           for n, t in {name}.state_dict(keep_vars=True).items() if not t.is_meta}}
_state.update({{n: b.detach().clone() for n, b in {name}.named_buffers()}})
"""


@pytest.mark.parametrize("second", [{"strategy": "ddp"}, {"strategy": "fsdp", "activation_checkpointing": True}])
def test_a_meta_llama_placed_again_keeps_its_trained_weights(dist_session, shell, capsys, second):
    """Another strategy (or another lever) re-places a meta Llama: every trained weight is carried, and only the
    rotary inv_freq (a non-persistent buffer, in no state dict) is made anew. Before, that buffer made the carry
    give up and the whole model was initialised afresh, while the cell said the ranks kept the weights."""
    ns = shell.user_ns
    name = "meta_llama_again_" + "_".join(f"{v}" for v in second.values()).lower()
    ns[name] = build("llama", meta=True)
    ns["again_ids"] = torch.utils.data.TensorDataset(ids())
    opts = dict(data="again_ids", epochs=1, batch_size=4, optimizer="sgd", seed=3, progress="none")
    dist_session.train(BODY, model=name, strategy="fsdp", lr=0.5, quiet=True, **opts)
    dist_session.run(STATE.format(name=name))
    trained = dist_session.pull("_state")[0]
    capsys.readouterr()
    dist_session.train(BODY, model=name, lr=0.0, **opts, **second)  # placed anew, not trained
    out = capsys.readouterr().out
    assert "the ranks keep the weights they trained" in out and "initialised as Hugging Face does" not in out, out
    dist_session.run(STATE.format(name=name))
    for held in dist_session.pull("_state"):
        assert set(held) == set(trained)
        for key, t in trained.items():
            assert torch.equal(held[key], t), key


def test_plain_torch_module_without_reset_parameters_still_asks_for_init(dist_session, shell):
    """Only modules inside a transformers model get _init_weights: a plain torch module is still refused."""
    shell.run_cell("""
import torch
class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
    def forward(self, x):
        return x * self.w
with torch.device("meta"):
    plain_meta = torch.nn.Sequential(torch.nn.Linear(4, 4), _Scale())
""")
    shell.user_ns["plain_xy"] = torch.utils.data.TensorDataset(torch.randn(8, 4))
    with pytest.raises(Exception, match="reset_parameters"):
        dist_session.train("(x,) = batch\nloss = model(x).pow(2).mean()", model="plain_meta", data="plain_xy",
                           epochs=1, batch_size=4, strategy="fsdp", progress="none", quiet=True)


LORA_Q = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.default.weight"


def test_peft_over_a_meta_llama_loads_the_base_folder_and_trains_as_one_peft_process(dist_session, shell,
                                                                                     tmp_path):
    """--load of the base model's folder into a peft model built over a meta Llama: its base weights are read
    under the base names (``base_layer`` and ``base_model.model.`` undone), its adapters start as peft starts
    them (B zero: the loss equals from_pretrained's), and a step equals one peft process from there, to 1e-5."""
    peft = pytest.importorskip("peft")
    folder = str(tmp_path / "llama")
    save_sharded(build("llama", seed=2), folder, num_files=3)
    base = from_pretrained("llama", folder)
    ns = shell.user_ns
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    ns["peft_meta"] = peft.get_peft_model(build("llama", meta=True), lora)
    x = ids(seed=4)
    ns["peft_ids"] = torch.utils.data.TensorDataset(x)
    with torch.no_grad():
        want = base(input_ids=x, labels=x).loss.item()
    cell = dict(model="peft_meta", data="peft_ids", epochs=1, batch_size=4, optimizer="sgd", strategy="fsdp",
                progress="none", quiet=True)
    first = dist_session.train(BODY, lr=0.0, load=folder, **cell)
    assert first.epoch_losses[0] == pytest.approx(want, abs=1e-5)
    name = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(dist_session.pull(f"peft_meta.base_model.model.{name}", rank=0), base.state_dict()[name],
                               atol=1e-6, rtol=0)
    ref = peft.get_peft_model(base.train(), lora)
    with torch.no_grad():  # the ranks' adapters as they start
        for key, p in ref.named_parameters():
            if ".lora_" in key:
                p.copy_(dist_session.pull(f"peft_meta.{key}", rank=0))
    assert torch.count_nonzero(ref.get_parameter(LORA_Q.format(0, "B"))) == 0
    second = dist_session.train(BODY, lr=0.5, **cell)  # one step on all 8 samples: the order does not matter
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    loss = ref(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    assert second.epoch_losses[0] == pytest.approx(loss.item(), abs=1e-5)
    for layer in (0, 1):
        for which in ("A", "B"):
            key = LORA_Q.format(layer, which)
            torch.testing.assert_close(dist_session.pull(f"peft_meta.{key}", rank=0), ref.get_parameter(key).detach(),
                                       atol=1e-5, rtol=0, msg=key)


def test_peft_modules_to_save_are_read_from_the_base_weights(dist_session, shell, tmp_path):
    """``modules_to_save=["lm_head"]``: its original and its trainable copy both come from the folder's
    ``lm_head.weight``, so the loss at lr 0 equals from_pretrained's."""
    peft = pytest.importorskip("peft")
    folder = str(tmp_path / "llama")
    save_sharded(build("llama", seed=6), folder, num_files=3)
    base = from_pretrained("llama", folder)
    ns = shell.user_ns
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"], modules_to_save=["lm_head"])
    ns["peft_mts"] = peft.get_peft_model(build("llama", meta=True), lora)
    x = ids(seed=7)
    ns["mts_ids"] = torch.utils.data.TensorDataset(x)
    result = dist_session.train(BODY, model="peft_mts", data="mts_ids", epochs=1, batch_size=4, optimizer="sgd",
                                lr=0.0, strategy="ddp", load=folder, progress="none", quiet=True)
    with torch.no_grad():
        assert result.epoch_losses[0] == pytest.approx(base(input_ids=x, labels=x).loss.item(), abs=1e-5)
    for key in ("original_module", "modules_to_save.default"):
        torch.testing.assert_close(dist_session.pull(f"peft_mts.base_model.model.lm_head.{key}.weight", rank=0),
                                   base.lm_head.weight, atol=1e-6, rtol=0)
