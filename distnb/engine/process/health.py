"""A ``%%dist`` cell that failed in the user's own code keeps the process group when it is provably healthy.

Every failed cell used to tear the group down and re-form it (:func:`distnb.engine.process.runtime.mark_broken`):
cheap on gloo, but on nccl a communicator finalise and init each time (seconds on 8 GPUs), and on
any backend every live sharded model had to be sent again with a fresh optimizer (GPU review,
finding 7). A typo (``NameError`` on line 1) leaves nothing half-done, so the group is kept when:

- the exception is an ``Exception`` of the cell's own code (not an interrupt, not raised inside
  ``torch.distributed``, not a peer's failure seen through a collective), and
- every rank of the world finished the cell (each writes, at the end of every ``%%dist`` cell, failed
  or not, a key in the group's store: :func:`cell_ended`), and all of them had issued the same
  number of collectives on each process group they share (``ProcessGroup._get_sequence_number_for_group``,
  gloo and nccl alike): no rank left a collective that another never joined (an ``async_op`` one
  included), and none waits in one now.

A ``%dist save`` that fails is judged the same way (:mod:`distnb.engine.process.callfail`), and so is a
training cell that failed before any step, leaving nothing half-done on the rank
(:mod:`distnb.engine.train.beforestep`); a training cell's other failures tear the group down at once.

The failing rank waits at most :data:`WAIT_SECONDS` for the others' keys. A rank that does not
write in time is still running, or waits in a collective: the group is torn down as before, and
peers blocked in a collective fail at once (:mod:`distnb.engine.process.abort`). The cost of a cell that
succeeds is one store write per rank.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

from distnb.engine.process import abort

#: Seconds a failing rank waits for every rank's end-of-cell key before it tears the group down.
WAIT_SECONDS = 2.0
_TORCH_DIST = os.sep + os.path.join("torch", "distributed") + os.sep
#: {"store": the store the count is for, "cells": %%dist cells ended on it (the same on every rank)}.
_COUNT: dict = {}


def sequence_numbers() -> dict:
    """``{group name: collectives issued on it}`` for every process group this rank belongs to."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return {}
    out = {}
    for pg, name in list(c10d._world.pg_names.items()):
        try:
            out[name] = int(pg._get_sequence_number_for_group())
        except Exception:  # a group that cannot say: compared as unknown (never equal to a number)
            out[name] = None
    return out


def _key(cell: int, rank: int) -> str:
    return f"distnb/cell-end/{cell}/{rank}"


def cell_ended(rank: int, world_size: int, exc: BaseException | None = None, dcp: bool = False) -> bool:
    """Record that this rank (``rank`` of ``world_size``) finished a ``%%dist`` cell; with ``exc`` (it failed),
    whether the group is healthy.

    Called by every rank at the end of every ``%%dist`` cell (``exc`` None: it succeeded or did not
    run it, ``--targets``), and of every ``%dist save`` (:mod:`distnb.engine.process.callfail`). Returns
    True for a success; for a failure, True only when the group may be kept (see the module docstring).
    ``dcp``: torch.distributed.checkpoint's ``CheckpointException`` counts as the call's own error too (DCP
    raises it on every rank alike, once its collectives have gathered each rank's failure). Never raises.
    """
    store = abort.ARMED.store
    if store is None or abort.ARMED.by is not None:
        return exc is None
    if _COUNT.get("store") is not store:  # a new group: counted from 0 on every rank alike
        _COUNT.update(store=store, cells=0)
    _COUNT["cells"] += 1
    cell = _COUNT["cells"]
    mine = sequence_numbers()
    try:
        store.set(_key(cell, rank), json.dumps(mine))
    except Exception:
        return exc is None
    if exc is None:
        return True
    if not (_own_error(exc, rank) or (dcp and _dcp_error(exc))) or world_size is None:
        return False
    return _all_alike(store, cell, world_size, mine)


def _own_error(exc: BaseException, rank: int) -> bool:
    """Whether ``exc`` is the cell's own ``Exception``, raised outside ``torch.distributed`` (a typo, a bad value)."""
    if not isinstance(exc, Exception) or abort.consequence(exc, rank) is not None:
        return False
    return not any(_TORCH_DIST in frame.filename for frame in traceback.extract_tb(exc.__traceback__))


def _dcp_error(exc: BaseException) -> bool:
    """Whether ``exc`` is DCP's ``CheckpointException`` over failures of the ranks' own (a write that failed: a full
    disk, a file in the way), not over a broken connection (:data:`distnb.engine.process.abort.SYMPTOMS`)."""
    return type(exc).__name__ == "CheckpointException" and not any(m in str(exc) for m in abort.SYMPTOMS)


def _all_alike(store, cell: int, world_size: int, mine: dict) -> bool:
    """Whether every rank ended ``cell`` within :data:`WAIT_SECONDS` with the collective counts of ``mine``."""
    keys = [_key(cell, r) for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=WAIT_SECONDS))
        counts = [json.loads(store.get(k)) for k in keys]
    except Exception:  # a rank did not finish the cell in time: still running, or in a collective
        return False
    for theirs in counts:
        for name, seq in theirs.items():
            if name in mine and (seq is None or seq != mine[name]):
                return False
    return True
