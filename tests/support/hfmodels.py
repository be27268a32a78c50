"""Tiny Hugging Face models built from configs (nothing downloaded) and saved as sharded folders."""

from __future__ import annotations

import json
import os

import torch

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
GPT2 = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)


def build(kind: str, seed: int = 0, meta: bool = False):
    """A tiny ``LlamaForCausalLM`` (``kind="llama"``) or ``GPT2LMHeadModel`` (``"gpt2"``, tied head), in eval mode."""
    import transformers

    config = (transformers.LlamaConfig(**LLAMA) if kind == "llama" else transformers.GPT2Config(**GPT2))
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return cls(config).eval()
    return cls(config).eval()


def save_sharded(model, folder: str, num_files: int = 3, dtype=None) -> dict:
    """``save_pretrained`` with a shard size giving at least ``num_files`` files; the index's weight_map."""
    if dtype is not None:
        model = model.to(dtype)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size=max(1, total // (num_files + 1)))
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) >= num_files, sorted(set(weight_map.values()))
    return weight_map


def from_pretrained(kind: str, folder: str):
    import transformers

    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel
    return cls.from_pretrained(folder).eval()
