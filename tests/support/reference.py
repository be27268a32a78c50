"""The single-process reference every parity test compares distnb's ranks with.

One process trains the whole model on each step's *global* batch: the union of the batches the
``num_shards`` ranks train on together at that step (``distnb.engine.shard.global_batches``, rank
0's first). Data-parallel strategies (ddp, fsdp, ps) use ``num_shards = world_size``; strategies
where every rank trains on the same batches (tensor, pipeline) use ``num_shards = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from distnb.engine import shard


@dataclass
class ReferenceRun:
    """What :func:`reference` did: the optimizer (pass it back to continue) and the losses it saw."""

    optimizer: torch.optim.Optimizer
    epoch_losses: list[float] = field(default_factory=list)  # the mean batch loss of each epoch
    last_loss: float | None = None  # the last step's loss


def reference(model: torch.nn.Module, data: torch.utils.data.TensorDataset, *, num_shards: int, batch_size: int,
              epochs: int, seed: int,
              optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer],
              lr: float | None = None, first_epoch: int = 0, drop_last: bool = False,
              loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy) -> ReferenceRun:
    """Train ``model`` in this process for epochs ``first_epoch .. first_epoch + epochs - 1``, as the ranks do.

    ``optimizer`` is an optimizer over ``model``'s parameters (its state carries on from an
    earlier call), or a factory such as ``torch.optim.SGD`` called as ``optimizer(params, lr=lr)``
    (``lr`` only with a factory). ``batch_size`` is per shard (rank), as ``--batch-size`` is.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters(), **({} if lr is None else {"lr": lr}))
    elif lr is not None:
        raise TypeError("lr is for an optimizer factory; set the learning rate of an optimizer object on it")
    x, y = data.tensors
    run = ReferenceRun(optimizer)
    for epoch in range(first_epoch, first_epoch + epochs):
        losses = []
        for idx in shard.global_batches(len(x), num_shards, seed, epoch, batch_size, drop_last):
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if losses:
            run.epoch_losses.append(sum(losses) / len(losses))
            run.last_loss = losses[-1]
    return run
