"""Data sets and models the tests train: small, seeded, the same tensors on every call."""

from __future__ import annotations

import torch
import torch.nn as nn


def blobs(n: int = 203, *, seed: int = 0, num_features: int = 12, num_classes: int = 3,
          num_summed: int = 4) -> torch.utils.data.TensorDataset:
    """``n`` Gaussian samples of ``num_features`` features (a generator seeded with ``seed``).

    The label is ``sum(x[:num_summed]) > 0``; with 3 classes, plus ``x[num_summed] > 1``.
    """
    if num_classes not in (2, 3):
        raise ValueError(f"num_classes is 2 or 3, not {num_classes}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, num_features, generator=g)
    y = (x[:, :num_summed].sum(1) > 0).long()
    if num_classes == 3:
        y = y + (x[:, num_summed] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


def mlp(*widths: int, seed: int, activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    """``Linear(widths[0], widths[1]), activation(), ..., Linear(widths[-2], widths[-1])``.

    Made after ``torch.manual_seed(seed)``, as the tests' models always were.
    """
    if len(widths) < 2:
        raise ValueError("mlp needs an input and an output width")
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (w_in, w_out) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(activation())
        layers.append(nn.Linear(w_in, w_out))
    return nn.Sequential(*layers)


# The strategy parity tests' data and model (tests/cluster: ddp, fsdp, ps; pipeline with its own n).
def parity_data(n: int = 203, seed: int = 0) -> torch.utils.data.TensorDataset:
    """12 features, 3 classes: the data of the strategy parity tests."""
    return blobs(n, seed=seed)


def parity_model(seed: int = 1) -> nn.Sequential:
    """``Linear(12, 16), Tanh, Linear(16, 3)``: the model of the strategy parity tests."""
    return mlp(12, 16, 3, seed=seed)


def dropout_model(seed: int = 1) -> nn.Sequential:
    """``Linear(12, 32), ReLU, Linear(32, 16), Dropout(0.5), Linear(16, 3)``: a parity model that draws
    random numbers in its forward (the dropout acts on the replicated output of tensor parallelism's
    column/row pair, so every rank of ``tensor`` must draw the same mask as one process would)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.Dropout(0.5), nn.Linear(16, 3))


def _digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)


def digits(n: int | None = None) -> torch.utils.data.TensorDataset:
    """The first ``n`` (default: all 1797) scikit-learn digits: float32 pixels in [0, 1], shape (n, 64); labels."""
    x, y = _digits_tensors()
    return torch.utils.data.TensorDataset(x[:n], y[:n])


def digits_split(num_train: int = 1400, seed: int = 0):
    """The digits shuffled (a generator seeded with ``seed``): a training TensorDataset and the held-out ``(x, y)``."""
    x, y = _digits_tensors()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = perm[:num_train], perm[num_train:]
    return torch.utils.data.TensorDataset(x[train], y[train]), (x[test], y[test])
