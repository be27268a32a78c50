"""The single-process reference every parity test compares distnb's ranks with.

One process trains the whole model on each step's *global* batch: the union of the batches the
``num_shards`` ranks train on together at that step (``distnb.engine.transport.shard.global_batches``, rank
0's first). Data-parallel strategies (ddp, fsdp, ps) use ``num_shards = world_size``; strategies
where every rank trains on the same batches (tensor, pipeline) use ``num_shards = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from distnb.engine.train import datasets
from distnb.engine.transport import shard


@dataclass
class ReferenceRun:
    """What :func:`reference` did: the optimizer (pass it back to continue) and the losses it saw."""

    optimizer: torch.optim.Optimizer
    epoch_losses: list[float] = field(default_factory=list)  # the mean batch loss of each epoch
    last_loss: float | None = None  # the last step's loss
    scheduler: object = None  # the lr scheduler (pass it back to continue)
    lrs: list[float] = field(default_factory=list)  # the lr of each optimizer step
    grad_norms: list[float] = field(default_factory=list)  # the pre-clip total norm of each optimizer step


def reference(model: torch.nn.Module, data: torch.utils.data.TensorDataset, *, num_shards: int, batch_size: int,
              epochs: int, seed: int,
              optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer],
              lr: float | None = None, first_epoch: int = 0, drop_last: bool = False,
              loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
              accumulate: int = 1, clip_grad_norm: float | None = None, scheduler=None,
              seed_epochs: bool = False) -> ReferenceRun:
    """Train ``model`` in this process for epochs ``first_epoch .. first_epoch + epochs - 1``, as the ranks do.

    ``optimizer`` is an optimizer over ``model``'s parameters (its state carries on from an
    earlier call), or a factory such as ``torch.optim.SGD`` called as ``optimizer(params, lr=lr)``
    (``lr`` only with a factory). ``batch_size`` is per shard (rank), as ``--batch-size`` is.

    ``accumulate`` N: one optimizer step on the *concatenation* of N consecutive global batches of
    an epoch (the last group of an epoch may be shorter), i.e. one process on the global batch
    ``num_shards * batch_size * N``. ``clip_grad_norm``: ``torch.nn.utils.clip_grad_norm_`` before
    each step (the pre-clip norms are kept). ``scheduler``: an LRScheduler over ``optimizer`` or a
    factory ``scheduler(optimizer)``, stepped after every optimizer step (the lrs are kept).

    ``seed_epochs``: seed this process before each epoch's first step as a rank seeds itself for
    tensor data (``distnb.engine.train.datasets.seed_epoch(seed, epoch, 0)``, data shard 0), so a model
    that draws random numbers (dropout) draws what the ranks draw. Only with ``num_shards=1``
    (tensor, pipeline): data-parallel ranks draw each for their own shard, which no one process does.
    """
    if seed_epochs and num_shards != 1:
        raise ValueError("seed_epochs needs num_shards=1: data-parallel ranks each draw for their own shard")
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters(), **({} if lr is None else {"lr": lr}))
    elif lr is not None:
        raise TypeError("lr is for an optimizer factory; set the learning rate of an optimizer object on it")
    if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        scheduler = scheduler(optimizer)
    x, y = data.tensors
    run = ReferenceRun(optimizer, scheduler=scheduler)
    for epoch in range(first_epoch, first_epoch + epochs):
        losses = []
        steps = list(shard.global_batches(len(x), num_shards, seed, epoch, batch_size, drop_last))
        if seed_epochs:
            datasets.seed_epoch(seed, epoch, 0)
        for start in range(0, len(steps), accumulate):
            idx = torch.cat(steps[start:start + accumulate])
            optimizer.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            if clip_grad_norm is not None:
                run.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)))
            run.lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            losses.append(loss.item())
        if losses:
            run.epoch_losses.append(sum(losses) / len(losses))
            run.last_loss = losses[-1]
    return run
