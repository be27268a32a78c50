"""distnb.engine.strategies.finetune without a cluster: the optimizer's parameters, a Hugging Face model's FSDP units,
and peft's initialisation of adapters built on the meta device."""

import pytest
import torch
import torch.nn as nn

from distnb.engine.strategies import finetune

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def llama(device="cpu"):
    with torch.device(device):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=16))


def test_the_optimizer_gets_the_trainable_parameters_only(monkeypatch):
    from distnb.engine.process import runtime

    monkeypatch.setattr(runtime.STATE, "rank", 1)
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    net[0].requires_grad_(False)
    assert finetune.trainable(net.parameters(), net) == [net[1].weight, net[1].bias]
    # a rank whose own part is frozen (a pipeline stage) while the model trains elsewhere: an empty optimizer
    stage = finetune.trainable(net[0].parameters(), net)
    assert stage == [{"params": []}]
    torch.optim.SGD(stage, lr=0.1).step()
    net.requires_grad_(False)
    with pytest.raises(ValueError, match=r"on rank \d+ every parameter of the model is frozen.*peft.get_peft_model"):
        finetune.trainable(net[1].parameters(), net)


def test_a_hf_model_s_fsdp_units_are_its_decoder_blocks_under_peft_too():
    assert finetune.block_units(llama()) == ["model.layers.0", "model.layers.1"]
    lora = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert finetune.block_units(lora) == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=3, n_head=2))
    assert finetune.block_units(gpt2) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert finetune.block_units(nn.Sequential(nn.Linear(2, 2))) == []


@pytest.mark.parametrize("mode", [True, "gaussian", False])
def test_meta_adapters_get_peft_s_own_initialisation(mode):
    net = peft.get_peft_model(llama("meta"), peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=mode))
    at = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = net.get_submodule(f"{at}.lora_A.default"), net.get_submodule(f"{at}.lora_B.default")
    assert finetune.adapter_init(net, f"{at}.base_layer", net.get_submodule(f"{at}.base_layer")) is None
    for mod, name in ((a, "lora_A"), (b, "lora_B")):
        mod.to_empty(device="cpu")
        with torch.no_grad():
            mod.weight.fill_(float("nan"))
            finetune.adapter_init(net, f"{at}.{name}.default", mod)()
    assert not torch.isnan(a.weight).any() and torch.count_nonzero(a.weight) == a.weight.numel()
    if mode is False:  # peft leaves nn.Linear's own random init on both
        assert torch.count_nonzero(b.weight) == b.weight.numel()
    else:  # B = 0: the adapter changes nothing before training
        assert torch.count_nonzero(b.weight) == 0
    if mode == "gaussian":
        assert a.weight.std().item() == pytest.approx(1 / 4, rel=0.5)


def test_an_init_computed_from_base_weights_is_a_clear_error_on_meta():
    net = peft.get_peft_model(llama("meta"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    net.peft_config["default"].init_lora_weights = "pissa"  # as LoraConfig(init_lora_weights="pissa") records it
    at = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.default"
    with pytest.raises(RuntimeError, match=r"lora_A.default \(a LoRA adapter\).*init_lora_weights='pissa'"):
        finetune.adapter_init(net, at, net.get_submodule(at))
