"""``%dist save --adapters DIR``: a peft model's adapters, as ``PeftModel.from_pretrained`` reads them.

A tiny Llama (built from a config) under ``peft.get_peft_model`` with LoRA trains 2 steps on the real
2-rank cluster; the ranks' adapters are saved; ``PeftModel.from_pretrained`` in this process over the same
base must hold the ranks' adapters to 1e-6, and compute what the trained model computes.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from distnb.core.errors import PlanError  # noqa: E402

BODY = "x = batch[0]\nloss = model(input_ids=x, labels=x).loss"
VOCAB = 64


def base(kind="llama"):
    torch.manual_seed(3)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                                    n_positions=32))
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def lora(model, kind="llama"):
    if kind == "gpt2":  # a PeftModelForCausalLM (task_type), GPT-2's fused attention projection
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                 task_type="CAUSAL_LM", fan_in_fan_out=True)
    else:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def tokens():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (16, 12), generator=g))


@pytest.mark.parametrize("kind,strategy", [("llama", "ddp"), ("llama", "fsdp"), ("gpt2", "fsdp")])
def test_adapters_read_back_by_peft(dist_session, shell, tmp_path, kind, strategy):
    ns = shell.user_ns
    name = f"hf_lora_{kind}_{strategy}"
    ns[name], ns["hf_tokens"] = lora(base(kind), kind), tokens()
    dist_session.train(BODY, model=name, data="hf_tokens", epochs=1, batch_size=8, strategy=strategy,
                       optimizer="adam", lr=0.01, progress="none", quiet=True)  # 16 samples / (8 x 2 ranks): 1 step
    dist_session.train(BODY, model=name, data="hf_tokens", epochs=1, batch_size=8, strategy=strategy,
                       progress="none", quiet=True)  # a second step
    trained = ns[name]
    adapters = {k: v for k, v in trained.state_dict().items() if "lora_" in k}
    assert adapters and any(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k), "LoRA did not train"
    meta = dist_session.save(str(tmp_path / "lora"), model=name, adapters=True, quiet=True)
    assert meta["adapter"] == "default" and meta["num_tensors"] == len(adapters)
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    loaded = peft.PeftModel.from_pretrained(base(kind), str(tmp_path / "lora"))
    assert type(loaded) is type(trained)
    got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert set(got) == set(adapters)
    for key, t in adapters.items():
        torch.testing.assert_close(got[key], t, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")
    x = tokens().tensors[0][:2]
    loaded.eval(), trained.eval()  # GPT-2 has dropout
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, trained(input_ids=x).logits, atol=1e-5, rtol=0)


def test_adapters_of_a_model_without_them_name_the_fix(dist_session, shell, tmp_path):
    ns = shell.user_ns
    ns["hf_plain_llama"], ns["hf_tokens"] = base(), tokens()
    dist_session.train(BODY, model="hf_plain_llama", data="hf_tokens", epochs=1, batch_size=8, progress="none",
                       quiet=True)
    with pytest.raises(PlanError, match="has no adapters.*get_peft_model.*--format safetensors"):
        dist_session.save(str(tmp_path / "x"), model="hf_plain_llama", adapters=True, quiet=True)
    assert not (tmp_path / "x").exists()
