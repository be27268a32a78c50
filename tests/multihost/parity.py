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


def train_and_check_parity(ns: dict, sess, prefix: str, epochs=2, batch_size=32, lr=0.01, seed=3, then=None):
    """Train ``mlp()`` on the first digits with ``sess`` (its world, DDP, Adam) and compare with one process.

    The reference steps once per global batch (the union of the ranks' batches), so the
    parameters must agree to floating-point tolerance. ``then``: what an earlier call returned, to
    go on from it (the same model, optimizer and epochs) on the world there is now, e.g. after a
    ``%dist scale``: the reference goes on with that world's global batches.

    Returns
    -------
    dict
        ``accuracy`` (trained, on the data), ``ref`` (the reference model), ``run`` (its
        :class:`~support.reference.ReferenceRun`), ``epoch`` (the next epoch), ``result`` (the TrainResult).
    """
    model, data = f"{prefix}_model", f"{prefix}_data"
    first = 0 if then is None else then["epoch"]
    if then is None:
        ns[model], ns[data], ns["F"] = mlp(), digits(NUM_SAMPLES), F
        ref, optimizer = mlp(), dict(optimizer=torch.optim.Adam, lr=lr)
    else:
        ref, optimizer = then["ref"], dict(optimizer=then["run"].optimizer)
    options = dict(optimizer="adam", lr=lr) if then is None else {}  # going on: no fresh optimizer
    result = sess.train(BODY, model=model, data=data, epochs=epochs, batch_size=batch_size, seed=seed,
                        progress="none", quiet=True, **options)
    assert result.epochs == list(range(first, first + epochs))  # no epoch 0 after a world change
    steps = -(-len(ns[data]) // sess.world_size // batch_size) * epochs
    assert [r["steps"] for r in result.rows] == [steps] * sess.world_size
    run = reference(ref, ns[data], num_shards=sess.world_size, batch_size=batch_size, epochs=epochs, seed=seed,
                    first_epoch=first, **optimizer)
    x, y = ns[data].tensors
    for p_dist, p_ref in zip(ns[model].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)
    accuracy = (ns[model](x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.85 or first + epochs < 2, accuracy
    return dict(accuracy=accuracy, ref=ref, run=run, epoch=first + epochs, result=result)
