"""The digits parity check shared by the multi-host tests: a distributed run equals one process."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from support.data import digits, mlp as _mlp
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
NUM_SAMPLES = 600  # the first 600 digits


def mlp():
    return _mlp(64, 32, 10, seed=0, activation=nn.ReLU)


def train_and_check_parity(ns: dict, sess, prefix: str, epochs=2, batch_size=32, lr=0.01, seed=3):
    """Train ``mlp()`` on the first digits with ``sess`` (2 ranks, DDP, Adam) and compare with one process.

    The reference steps once per global batch (the union of the ranks' batches), so the
    parameters must agree to floating-point tolerance. Returns the trained accuracy.
    """
    model, data = f"{prefix}_model", f"{prefix}_data"
    ns[model], ns[data], ns["F"] = mlp(), digits(NUM_SAMPLES), F
    ref = mlp()
    result = sess.train(BODY, model=model, data=data, epochs=epochs, batch_size=batch_size, optimizer="adam",
                        lr=lr, seed=seed, progress="none", quiet=True)
    steps = -(-len(ns[data]) // sess.world_size // batch_size) * epochs
    assert [r["steps"] for r in result.rows] == [steps] * sess.world_size
    reference(ref, ns[data], num_shards=sess.world_size, batch_size=batch_size, epochs=epochs, seed=seed,
              optimizer=torch.optim.Adam, lr=lr)
    x, y = ns[data].tensors
    for p_dist, p_ref in zip(ns[model].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)
    accuracy = (ns[model](x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.85, accuracy
    return accuracy
