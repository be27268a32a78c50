"""Checkpoints of a live model with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``DIR/step_<global step, 8 digits>/`` holding what DCP wrote
(each rank its own part: a shard for fsdp and tensor, a stage for pipeline, one
de-duplicated copy of replicated tensors for ddp) and ``distnb.json`` with the training
position (epoch, step within the epoch, global step), the plan (strategy and its options,
optimizer) and the data seed. ``distnb.json`` is written by rank 0 only after every rank
has finished its part, so a directory without it is incomplete and never loaded.

Saving is a collective: every rank calls :func:`save` at the same step (the loop does it at
a step count all ranks share). The only rank-0-only code is plain file I/O after the
barrier, never a collective, so a save cannot deadlock on a rank-0 branch.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict`` / ``set_state_dict``), which understands DDP, FSDP2 and DTensor
modules; strategies with their own optimizer layout override ``Strategy.checkpoint_state``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from distnb.core.plan import TrainPlan
from distnb.engine import strategies
from distnb.engine.process import runtime
from distnb.engine.train import epochrest
from distnb.engine.train.savefolder import check_writable
from distnb.engine.train.stepping import load_scheduler, scheduler_state

MARKER = "distnb.json"
#: Complete checkpoints kept per directory (older ones are deleted after a save).
KEEP = 2
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _barrier():
    dist.barrier()


def latest(directory: str) -> str | None:
    """The newest complete checkpoint under ``directory`` (a ``step_*`` path), or None."""
    if not os.path.isdir(directory):
        return None
    found = sorted(d for d in os.listdir(directory)
                   if _STEP_DIR.match(d) and os.path.exists(os.path.join(directory, d, MARKER)))
    return os.path.join(directory, found[-1]) if found else None


def read_meta(path: str) -> dict:
    """``distnb.json`` of checkpoint ``path`` (a ``step_*`` directory or its parent: the newest)."""
    if not os.path.exists(os.path.join(path, MARKER)):
        newest = latest(path)
        if newest is None:
            raise FileNotFoundError(f"no complete distnb checkpoint in {path} (a step_* folder with {MARKER})")
        path = newest
    with open(os.path.join(path, MARKER)) as f:
        meta = json.load(f)
    meta["path"] = path
    return meta


def save(run, directory: str, plan_dict: dict, data_seed: int) -> dict:
    """Save ``run`` (model, optimizer, position) under ``directory``; every rank must call it.

    Parameters
    ----------
    run : distnb.engine.train.loop.Run
        A model with its strategy built, and its optimizer once a cell trained it. A model whose weights
        were loaded and not trained yet (``%dist load``) has none: the checkpoint then holds the model
        and its position only, and its ``optimizer`` is None (a load of it leaves the optimizer to the
        next training cell, as a model just loaded).
    directory : str
        Parent folder; created if missing. The checkpoint goes to ``step_<run.steps>``.
    plan_dict : dict
        The TrainPlan (as a dict) that distributed the model, recorded for loading.
    data_seed : int

    Returns
    -------
    dict
        The metadata written (path, epoch, epoch_step, steps, seconds).

    Raises
    ------
    RuntimeError
        If the model has not been distributed on the ranks (neither trained nor loaded there), or (on every
        rank alike, naming each rank that cannot) the folder cannot be written.
    torch.distributed.checkpoint.api.CheckpointException
        A write failed on some rank (a full disk): DCP raises it on every rank alike.
    """

    if run.strategy is None:
        raise RuntimeError(f"rank {runtime.STATE.rank}: the model is not distributed on the ranks; nothing to save "
                           "(run a %%distrain cell, or %dist load weights into it, first)")
    t0 = time.perf_counter()
    path = os.path.join(os.path.abspath(directory), f"step_{run.steps:08d}")
    check_writable(path)  # every rank, together: all raise alike before anything is written
    if runtime.STATE.rank == 0:
        os.makedirs(path, exist_ok=True)
        stale = os.path.join(path, MARKER)
        if os.path.exists(stale):
            os.remove(stale)  # overwritten below once every rank has written its part again
    _barrier()
    model_sd, optim_sd = run.strategy.checkpoint_state(run.optimizer)
    state = {"model": model_sd} if run.optimizer is None else {"model": model_sd, "optimizer": optim_sd}
    dcp.save(state, checkpoint_id=path)
    _barrier()  # every rank's part is on disk
    plan_dict = dict(plan_dict, optimizer=run.optimizer_key)  # the optimizer that made the saved state

    meta = dict(path=path, epoch=run.epoch, epoch_step=run.epoch_step, epoch_samples=run.epoch_samples,
                epoch_data=run.epoch_data, epoch_trail=epochrest.active(run),
                steps=run.steps, plan=plan_dict, optimizer_steps=run.optimizer_steps, scheduler=scheduler_state(run),
                data_seed=data_seed, world_size=runtime.STATE.world_size, optimizer=run.optimizer_key,
                seconds=time.perf_counter() - t0)
    if runtime.STATE.rank == 0:  # file I/O only: no collective under this branch
        tmp = os.path.join(path, MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(path, MARKER))
        _prune(os.path.dirname(path), keep=os.path.basename(path))
    return meta


def _prune(directory: str, keep: str) -> None:
    """Remove all but the newest :data:`KEEP` complete checkpoints of ``directory``; never ``keep`` (the one just
    written, whatever its step)."""
    complete = sorted(d for d in os.listdir(directory)
                      if _STEP_DIR.match(d) and os.path.exists(os.path.join(directory, d, MARKER)))
    for d in complete[:-KEEP]:
        if d != keep:
            shutil.rmtree(os.path.join(directory, d), ignore_errors=True)


def load(run, meta: dict, ns=None, plan=None, optimizer_state: bool = True) -> None:
    """Restore ``run``'s model, optimizer and position from checkpoint ``meta`` (every rank).

    The strategy and optimizer must already be built as ``meta["plan"]`` describes
    (:func:`distnb.engine.train.loop.restore` does that), or as ``plan`` (a TrainPlan) does: the
    same strategy on this world, e.g. ``--mesh`` with the saved tensor-parallel size and
    another data-parallel size (DCP reshards the saved DTensors onto it), or another strategy
    (a resume after a strategy switch: the weights are saved by name in every layout).
    ``optimizer_state`` False: the weights and position only, neither the optimizer's state nor
    its lr schedule (another strategy's layout, :func:`distnb.core.plan.optimizer_state_readable`; a
    checkpoint of a model loaded and not trained, whose ``optimizer`` is None, holds neither).
    """
    optimizer_state = optimizer_state and meta.get("optimizer") is not None and run.optimizer is not None
    model_sd, optim_sd = run.strategy.checkpoint_state(run.optimizer)
    state = {"model": model_sd, "optimizer": optim_sd} if optimizer_state else {"model": model_sd}
    try:
        dcp.load(state, checkpoint_id=meta["path"])
    except BaseException as exc:  # DCP's CheckpointException (a BaseException) only says which ranks failed
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        failures = getattr(exc, "failures", None) or {}
        first = next(iter(failures.values()), exc)
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            first = first[0]  # (exception, its traceback's frames), as DCP keeps each rank's failure
        reason = str(first).strip().splitlines()[-1].rstrip(".") if str(first).strip() else type(first).__name__
        raise RuntimeError(f"rank {runtime.STATE.rank}: checkpoint {meta['path']} does not fit this model "
                           f"(--strategy {meta['plan']['strategy']}, optimizer {meta['optimizer']}): {reason}. "
                           "Load it into a model of the same class and sizes (a training cell's --checkpoint-dir: "
                           "another directory, or --reset to start from the notebook's weights)") from None
    run.strategy.load_checkpoint_state(run.optimizer, state["model"], state.get("optimizer"))
    run.epoch, run.epoch_step, run.steps = meta["epoch"], meta["epoch_step"], meta["steps"]
    run.epoch_samples, run.epoch_trail = meta["epoch_samples"], meta.get("epoch_trail")
    moved = _position(meta, plan)
    if meta.get("epoch_data") and (run.epoch_trail or moved):  # the data the position is in (a trail holds to it)
        run.epoch_data = tuple(meta["epoch_data"])
    if moved is not None:  # another data-parallel size (%dist scale, shrink, restart -n, another strategy)
        epochrest.carry(run, *moved, plan=meta["plan"])  # which samples were trained, not how many (epochrest.py)
    run.optimizer_steps = meta.get("optimizer_steps", run.steps)
    if not optimizer_state:
        return

    load_scheduler(run, meta.get("scheduler"), ns or {})  # the lr schedule, where it was


def _position(meta: dict, now_plan=None):
    """(data-parallel size saved, now) of checkpoint ``meta`` when it stopped in the middle of an epoch and the
    two differ; else None.

    The saved size is the saved plan's on the saved world; the size now is ``now_plan``'s (default: the
    saved plan) on this world (they differ in ``--mesh`` after ``%dist scale`` of an fsdp+tensor model).
    The position then moves as a resize moves it (:func:`distnb.engine.train.epochrest.carry`).
    """

    world = runtime.STATE.world_size
    saved = meta.get("world_size") or world
    if not (meta.get("epoch_samples") or meta.get("epoch_trail")):
        return None
    try:
        plan = TrainPlan.from_dict(meta["plan"])
    except Exception:  # a plan this version cannot read: the position as saved
        return None
    before = strategies.data_parallel_size(plan, saved)
    now = strategies.data_parallel_size(now_plan or plan, world)  # another world, mesh or strategy
    return None if before == now else (before, now)
