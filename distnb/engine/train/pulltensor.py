"""Rank side of ``%dist pull NAME.path.to.param``: one full tensor of a model, whatever the strategy.

The kernel asks every rank first where the tensor is (:func:`locate_tensor`): a DTensor shard (fsdp, tensor
parallel: every rank must then take part in its all-gather), a whole tensor (ddp: every rank; pipeline:
the rank whose stage holds it), or nothing here (a pipeline's other stages, ``meta``). Then
:func:`fetch_tensor` returns it, packed for the wire, from one rank only: each rank's piece of a DTensor
is sent to that rank, which assembles it (the others hold no full copy). So the kernel receives the one tensor once, never the model.
"""

from __future__ import annotations

import difflib

import torch

from distnb.engine.process import runtime
from distnb.engine.process.collectives import group_device
from distnb.engine.train.loop import RUNS
from distnb.engine.transport import gather, wire


def _module(ns, head: str):

    run = RUNS.get(head)
    if run is not None:
        return run.module, run.strategy
    value = ns.get(head)
    return (value, None) if isinstance(value, torch.nn.Module) else (None, None)


def _tensors(module, strategy) -> dict:
    """Name -> tensor of what this rank holds under the model's own ``state_dict`` keys."""
    tensors = dict(module.state_dict(keep_vars=True))
    stage = getattr(strategy, "_stage_tensors", None)  # pipeline: a traced stage holds its own tensors
    if stage is not None:
        tensors.update(stage())
    return tensors


def locate_tensor(ns, head: str, path: str):
    """Where ``head``'s tensor ``path`` is on this rank: ``"dtensor"``, ``"held"``, ``"meta"``,
    ``("missing", nearest names)`` or ``("not a model", type name)``."""
    module, strategy = _module(ns, head)
    if module is None:
        return ("not a model", type(ns[head]).__name__ if head in ns else None)
    tensors = _tensors(module, strategy)
    t = tensors.get(path)
    if t is None:
        return ("missing", difflib.get_close_matches(path, list(tensors), n=3, cutoff=0.5))
    if hasattr(t, "full_tensor"):
        return "dtensor"
    return "meta" if t.is_meta else "held"


def fetch_tensor(ns, head: str, path: str, gathered: bool, rank: int):
    """The tensor, packed (:func:`wire.pack`) on rank ``rank``, None elsewhere.

    ``gathered``: it is a DTensor, assembled on rank ``rank`` from every rank's piece (:mod:`distnb.engine.transport.gather`;
    a placement it does not place is all-gathered whole on every rank; a collective: call on all ranks).
    The tensor is detached, on the CPU, with its dtype and its full shape.
    """

    module, strategy = _module(ns, head)
    t = _tensors(module, strategy)[path]
    if gathered and gather.supported(t, writer=rank):  # each rank's piece to rank ``rank`` only: no full copy elsewhere
        full = torch.empty(t.shape, dtype=t.dtype) if runtime.STATE.rank == rank else None
        gather.gather_into(t, full, writer=rank, device=group_device())
    else:
        full = t.full_tensor() if gathered else t
    if runtime.STATE.rank != rank:
        return None
    return wire.pack(full.detach().to("cpu"))
