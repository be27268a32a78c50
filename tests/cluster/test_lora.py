"""LoRA with peft under ddp and fsdp: only the adapters train, and the ranks equal one peft process.

A ``peft.get_peft_model`` over a tiny ``LlamaForCausalLM`` and a tiny ``GPT2LMHeadModel`` (tied head),
trained with the body ``loss = model(input_ids=x, labels=x).loss`` on 2 ranks, against one process
running the same peft model on each step's global batch (same seed, same order). On the ranks: the
optimizer holds the adapters only, frozen weights never get a gradient, DDP's reducer holds the
adapters only, and FSDP2 reduce-scatters the adapters' gradients only.
"""

import copy

import pytest
import torch

from distnb.engine.transport import shard

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

BODY = "x, = batch\nloss = model(input_ids=x, labels=x).loss"
#: One adapter weight of each model, by its Hugging Face dotted name.
ADAPTER = {"llama": "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
           "gpt2": "base_model.model.transformer.h.1.attn.c_attn.lora_B.default.weight"}


def tiny_peft(arch: str):
    """A tiny causal LM with LoRA adapters (rank 4; dropout 0, so the forward draws nothing)."""
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True,
                                 task_type="CAUSAL_LM")  # PeftModelForCausalLM (the Llama: a plain PeftModel)
    return peft.get_peft_model(model, config)


def tokens(n: int = 32, length: int = 12) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randint(0, 64, (n, length), generator=g))


def one_process(model, data, optimizer, *, num_shards, batch_size, epochs, seed):
    """The same steps in this process, each on the global batch (the ranks' batches together)."""
    (x,) = data.tensors
    for epoch in range(epochs):
        for idx in shard.global_batches(len(x), num_shards, seed, epoch, batch_size, False):
            optimizer.zero_grad()
            model(input_ids=x[idx], labels=x[idx]).loss.backward()
            optimizer.step()


RANK_CHECK = """
from distnb.engine.train import loop as _loop
_run = _loop.RUNS[{name!r}]
_in_opt = [p for g in _run.optimizer.param_groups for p in g["params"]]
_ddp = getattr(_run.strategy, "ddp", None)
lora_check = dict(
    optimizer_params=len(_in_opt), optimizer_frozen=sum(not p.requires_grad for p in _in_opt),
    trainable=sum(p.requires_grad for p in _run.module.parameters()),
    frozen_with_grad=sum(p.grad is not None for p in _run.module.parameters() if not p.requires_grad),
    reducer_bytes=None if _ddp is None else _ddp._get_ddp_logging_data()["total_parameter_size_bytes"],
    reduced=sum(_scattered))
"""

#: Counts the elements FSDP2 reduce-scatters (its default collective, private in torch 2.13), on each rank.
RECORD = """
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _collectives
_scattered = []
_plain = _collectives.DefaultReduceScatter.__call__
def _counted(self, *args, **kwargs):
    _scattered.append((kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]).numel())
    return _plain(self, *args, **kwargs)
_collectives.DefaultReduceScatter.__call__ = _counted
"""
UNRECORD = "_collectives.DefaultReduceScatter.__call__ = _plain"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_trains_the_adapters_only_and_matches_one_peft_process(dist_session, shell, strategy, arch):
    ns = shell.user_ns
    name = f"lora_{arch}_{strategy}"
    ns[name], ns["lora_tokens"] = tiny_peft(arch), tokens()
    ref = copy.deepcopy(ns[name])
    before = {k: v.clone() for k, v in ns[name].state_dict().items()}
    trainable = {n for n, p in ns[name].named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)

    dist_session.run(RECORD)
    try:
        result = dist_session.train(BODY, model=name, data="lora_tokens", epochs=2, batch_size=4, optimizer="sgd",
                                    lr=0.5, seed=5, strategy=strategy, progress="none", quiet=True)
        dist_session.run(RANK_CHECK.format(name=name))
    finally:
        dist_session.run(UNRECORD)
    one_process(ref, ns["lora_tokens"], torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5),
                num_shards=2, batch_size=4, epochs=2, seed=5)

    got, want = ns[name].state_dict(), ref.state_dict()
    for key in got:
        if key in trainable:
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=key)
        else:  # a frozen base weight: bit for bit what it was
            assert torch.equal(got[key], before[key]), key
    changed = [k for k in got if ".lora_" in k and not torch.equal(got[k], before[k])]
    assert len(changed) == len(trainable), "every adapter (A and B) trained"

    num_adapter = sum(ns[name].get_parameter(n).numel() for n in trainable)
    num_all = sum(p.numel() for p in ns[name].parameters())
    assert (result.num_trainable_params, result.num_params) == (num_adapter, num_all)
    assert f"{num_adapter:,} of {num_all:,} parameters trained" in result.title

    checks = dist_session.pull("lora_check")
    num_trainable = len(trainable)
    for rank, c in enumerate(checks):
        assert c["optimizer_params"] == c["trainable"] == num_trainable, (rank, c)
        assert c["optimizer_frozen"] == 0 and c["frozen_with_grad"] == 0, (rank, c)
        if strategy == "ddp":  # DDP's reducer (its all-reduce buckets) holds the adapters only
            assert c["reducer_bytes"] == sum(ns[name].get_parameter(n).numel() * 4 for n in trainable), (rank, c)
        else:  # FSDP2 reduce-scattered the adapters' gradients only: dim 0 padded to a multiple of 2, per step
            steps = 2 * 4  # 2 epochs of 32 / (2 ranks x 4)
            padded = sum(-(-p.shape[0] // 2) * 2 * p[0].numel() for n, p in ns[name].named_parameters()
                         if n in trainable)
            assert c["reduced"] == steps * padded, (rank, c)

    pulled = dist_session.pull(f"{name}.{ADAPTER[arch]}")
    assert torch.equal(pulled, ns[name].get_parameter(ADAPTER[arch]).detach())


def test_a_model_with_every_parameter_frozen_is_a_clear_error(dist_session, shell):
    ns = shell.user_ns
    ns["lora_frozen"], ns["lora_tokens"] = tiny_peft("llama"), tokens()
    ns["lora_frozen"].requires_grad_(False)
    from distnb.core.errors import RankError

    with pytest.raises(RankError, match=r"on rank \d every parameter of the model is frozen"):
        dist_session.train(BODY, model="lora_frozen", data="lora_tokens", epochs=1, batch_size=4,
                           strategy="fsdp", progress="none", quiet=True)
    ns["lora_frozen"] = tiny_peft("llama")  # adapters trainable again: the cluster trains the next cell
    r = dist_session.train(BODY, model="lora_frozen", data="lora_tokens", epochs=1, batch_size=4,
                           strategy="fsdp", progress="none", quiet=True)
    assert r.rows[0]["steps"] == 4


#: --init for a meta Llama's own modules, defined in the notebook (so it travels by value): Linear and
#: Embedding their own reset_parameters, norms 1, the rotary embedding's frequencies as Llama computes them.
INIT_BASE = """
def init_base(module):
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
        return
    for value in module._parameters.values():
        value.fill_(1.0)
    if hasattr(module, "original_inv_freq"):
        inv_freq, _ = module.compute_default_rope_parameters(module.config)
        module.inv_freq.copy_(inv_freq)
        module.original_inv_freq.copy_(inv_freq)
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_adapters_built_on_meta_start_as_peft_starts_them(dist_session, shell, strategy):
    """A peft model over a meta Llama: on the ranks lora_B starts at zero (the adapter changes nothing before
    training), lora_A as peft draws it; nn.Linear.reset_parameters or --init would make B random."""
    ns = shell.user_ns
    name = f"lora_meta_{strategy}"
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(config)
    ns[name] = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                         target_modules=["q_proj", "v_proj"]))
    ns["lora_tokens"] = tokens()
    shell.run_cell(INIT_BASE)
    dist_session.train(BODY, model=name, data="lora_tokens", epochs=1, batch_size=4, optimizer="sgd", lr=0.0,
                       init="init_base", strategy=strategy, progress="none", quiet=True)
    for layer in (0, 1):
        for proj in ("q_proj", "v_proj"):
            at = f"{name}.base_model.model.model.layers.{layer}.self_attn.{proj}"
            b, a = dist_session.pull(f"{at}.lora_B.default.weight"), dist_session.pull(f"{at}.lora_A.default.weight")
            assert b.shape == (32 if proj == "q_proj" else 16, 4) and torch.count_nonzero(b) == 0, at
            bound = 1 / 32 ** 0.5  # kaiming_uniform_(a=sqrt(5)) over fan_in 32
            assert a.shape == (4, 32) and 0 < a.abs().max() <= bound and a.std() > bound / 4, at


#: A notebook optimizer factory (defined in the notebook, so it travels by value): AdamW with weight decay.
MAKE_OPT = """
def lora_adamw(params):
    return torch.optim.AdamW(params, lr=0.01, eps=1e-6, weight_decay=0.1)
"""


def test_a_notebook_optimizer_factory_gets_the_adapters_and_acts_as_torch_does(dist_session, shell):
    """The factory is given the trainable parameters only; one process whose AdamW holds every parameter (frozen
    ones too, as `AdamW(model.parameters())` would) ends the same: torch skips parameters without a gradient,
    so weight decay never touches a frozen weight."""
    ns = shell.user_ns
    ns["lora_fac"], ns["lora_tokens"] = tiny_peft("llama"), tokens()
    shell.run_cell("import torch\n" + MAKE_OPT)
    ref = copy.deepcopy(ns["lora_fac"])
    before = {k: v.clone() for k, v in ns["lora_fac"].state_dict().items()}
    dist_session.train(BODY, model="lora_fac", data="lora_tokens", epochs=1, batch_size=4, optimizer="lora_adamw",
                       seed=2, strategy="fsdp", progress="none", quiet=True)
    dist_session.run("from distnb.engine.train import loop as _loop\n"
                     "lora_fac_opt = [tuple(p.shape) for g in _loop.RUNS['lora_fac'].optimizer.param_groups "
                     "for p in g['params']]")
    adapters = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert len(dist_session.pull("lora_fac_opt", rank=0)) == len(adapters)
    everything = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1e-6, weight_decay=0.1)
    one_process(ref, ns["lora_tokens"], everything, num_shards=2, batch_size=4, epochs=1, seed=2)
    got, want = ns["lora_fac"].state_dict(), ref.state_dict()
    for key in got:
        if key in adapters:
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=key)
        else:
            assert torch.equal(got[key], before[key]) and torch.equal(want[key], before[key]), key


def test_distrain_magic_trains_a_peft_model_and_says_what_trained_once(dist_session, shell, capsys):
    """`%%distrain --model net ...` over a peft GPT-2 under fsdp; the result names the trainable and total counts."""
    ns = shell.user_ns
    ns["lora_magic"], ns["lora_tokens"] = tiny_peft("gpt2"), tokens()
    capsys.readouterr()
    result = shell.run_cell_magic("distrain", "--model lora_magic --data lora_tokens --strategy fsdp --epochs 1 "
                                  "--batch-size 4 --optimizer adamw --lr 1e-3 --progress text", BODY)
    out = capsys.readouterr().out
    trained = f"{result.num_trainable_params:,} of {result.num_params:,} parameters trained"
    assert result.num_trainable_params < result.num_params and trained in result.title
    # the cell's result, which Jupyter shows as its output, says it once; the progress lines do not repeat it
    assert repr(result).count(trained) == 1 and result._repr_html_().count(trained) == 1
    assert "parameters trained" not in out, out


def test_a_checkpoint_of_a_lora_run_resumes_it_exactly(dist_session, shell, tmp_path):
    """%dist save / load (DCP) of an fsdp LoRA run whose Adam holds the adapters only: reloaded, the next epoch
    gives what it gave before the reload."""
    ns = shell.user_ns
    ns["lora_ckpt"], ns["lora_tokens"] = tiny_peft("llama"), tokens()
    cell = dict(model="lora_ckpt", data="lora_tokens", epochs=1, batch_size=4, progress="none", quiet=True)
    dist_session.train(BODY, optimizer="adam", lr=1e-2, strategy="fsdp", **cell)
    dist_session.save(str(tmp_path), model="lora_ckpt", quiet=True)
    dist_session.train(BODY, **cell)
    once = {k: v.clone() for k, v in ns["lora_ckpt"].state_dict().items()}
    dist_session.load(str(tmp_path), model="lora_ckpt", quiet=True)
    dist_session.train(BODY, **cell)
    for key, value in ns["lora_ckpt"].state_dict().items():
        torch.testing.assert_close(value, once[key], atol=1e-6, rtol=1e-6, msg=key)
    assert any(not torch.equal(once[k], tiny_peft("llama").state_dict()[k]) for k in once if ".lora_B" in k)
