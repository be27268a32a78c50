"""The digits parity check shared by the multi-host tests: a distributed run equals one process."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.engine import shard

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


def digits(n=600):
    """The first ``n`` scikit-learn digits: float32 pixels in [0, 1] of shape (n, 64), int64 labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.utils.data.TensorDataset(torch.tensor(x[:n], dtype=torch.float32) / 16, torch.tensor(y[:n]))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def train_and_check_parity(ns: dict, sess, prefix: str, epochs=2, batch_size=32, lr=0.01, seed=3):
    """Train ``mlp()`` on ``digits()`` with ``sess`` (2 ranks, DDP, Adam) and compare with one process.

    The reference steps once per global batch (the union of the ranks' batches), so the
    parameters must agree to floating-point tolerance. Returns the trained accuracy.
    """
    model, data = f"{prefix}_model", f"{prefix}_data"
    ns[model], ns[data], ns["F"] = mlp(), digits(), F
    ref = mlp()
    result = sess.train(BODY, model=model, data=data, epochs=epochs, batch_size=batch_size, optimizer="adam",
                        lr=lr, seed=seed, progress="none", quiet=True)
    steps = -(-len(ns[data]) // sess.world_size // batch_size) * epochs
    assert [r["steps"] for r in result.rows] == [steps] * sess.world_size
    x, y = ns[data].tensors
    opt = torch.optim.Adam(ref.parameters(), lr=lr)
    for epoch in range(epochs):
        for idx in shard.global_batches(len(x), sess.world_size, seed, epoch, batch_size, False):
            opt.zero_grad()
            F.cross_entropy(ref(x[idx]), y[idx]).backward()
            opt.step()
    for p_dist, p_ref in zip(ns[model].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)
    accuracy = (ns[model](x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.85, accuracy
    return accuracy
