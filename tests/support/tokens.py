"""Padded token sequences, a small token model and the token-weighted losses of issue 36, item 8's tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, LENGTH = 11, 10
#: A step body whose loss is a sum over the valid tokens, with their count in ctx.num_items.
SUMMED = ("x, y = batch\n"
          "logits = model(x)\n"
          "loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction='sum')\n"
          "ctx.num_items = (y != -100).sum()\n")
#: The same loss as a mean per micro-batch (no ctx.num_items).
MEANS = ("x, y = batch\n"
         "loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)\n")


def token_model(seed: int = 3) -> nn.Sequential:
    """``Embedding(VOCAB, 8), Linear(8, 16), Tanh, Linear(16, VOCAB)``, made after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def padded_tokens(n: int = 96, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` sequences of LENGTH tokens, the first 1..LENGTH of each valid; targets -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    y = torch.roll(x, -1, dims=1)
    lengths = torch.randint(1, LENGTH + 1, (n,), generator=g)
    y[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = -100
    return torch.utils.data.TensorDataset(x, y)


def token_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over the valid tokens of ``out`` (N, LENGTH, VOCAB) against ``y`` (N, LENGTH)."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)
