"""Rank side of ``%dist save``: a checkpoint (DCP), a Hugging Face folder, a peft model's adapters, and what a
save that fails leaves.

The kernel asks every rank first whether it can write the folder
(:func:`distnb.engine.train.savefolder.writable`), so a bad folder fails before anything runs here. A write
can still fail once begun (a full disk, a file another process put in the way): DCP then raises on every
rank alike, having gathered each rank's failure through collectives that completed. When every rank ended
the save alike, with the same collectives issued (:func:`distnb.engine.process.callfail.ended`), the
process group is kept, and with it the model the ranks hold (a sharded one, one built on meta in the
notebook, whose weights are on the ranks only): the error says so, and a save to a good folder, or the
next training cell, goes on from the same weights. Otherwise the group is torn down and re-formed as
after any failed cell, and the error says where the weights are then (:func:`distnb.engine.train.loop.weights_left`).
"""

from __future__ import annotations

from distnb.core.plan import STRATEGIES
from distnb.engine.process import callfail, runtime
from distnb.engine.train import checkpoint, hfsave
from distnb.engine.train.loop import RUNS, ready_run, weights_left


def checkpoint_model(ns, name, directory):
    """Checkpoint model ``name`` (strategy, optimizer, position) under ``directory`` on every rank (collective);
    its metadata (:func:`distnb.engine.train.checkpoint.save`)."""
    return _checkpoint(ready_run(ns, name), directory)


def _checkpoint(run, directory):
    return checkpoint.save(run, directory, run.plan_dict, run.plan_dict["seed"])


def save_checkpoint(ns, name, directory):
    """``%dist save DIR``: :func:`checkpoint_model`; a failure keeps the group when every rank failed alike."""
    return _kept_on_failure(ns, name, directory, lambda run: _checkpoint(run, directory))


def save_safetensors(ns, name: str, directory: str, max_shard_bytes: int) -> dict:
    """``%dist save DIR --format safetensors``: trained model ``name`` as a Hugging Face folder
    (:func:`distnb.engine.train.hfsave.save_model`); a failure as :func:`save_checkpoint`'s."""
    return _kept_on_failure(ns, name, directory, lambda run: hfsave.save_model(run, directory, max_shard_bytes))


def save_peft_adapters(ns, name: str, directory: str) -> dict:
    """``%dist save --adapters DIR``: the peft adapters of trained model ``name``
    (:func:`distnb.engine.train.hfsave.save_adapters`); a failure as :func:`save_checkpoint`'s."""
    return _kept_on_failure(ns, name, directory, lambda run: hfsave.save_adapters(run, directory))


def _kept_on_failure(ns, name: str, directory: str, write):
    """``write(run)`` on every rank, ``run`` model ``name``'s (:func:`distnb.engine.train.loop.ready_run`); a failure
    raised with what it left said (see the module docstring).

    Raises
    ------
    RuntimeError
        The save failed: its reason (each failing rank's, for DCP's), then whether the model is still live on
        the ranks (the group kept) or where its weights are (the group re-formed); or, as ``ready_run`` raises
        it, the model is not on the ranks to be saved (that error says where its weights are).
    KeyboardInterrupt, distnb.core.errors.PeerFailed
        As raised (an interrupt; another rank's failure ended this rank's collective).
    """
    callfail.begin()
    run = None
    try:
        run = ready_run(ns, name)
        out = write(run)
    except BaseException as caught:
        kept, stopped = callfail.ended(ns, caught, dcp=True)
        if stopped is not None:  # another rank failed first: said briefly, as a failed cell says it
            raise stopped from None
        if run is None or not isinstance(caught, Exception) and not callfail.is_dcp(caught):
            raise  # nothing to save (ready_run's error says why), an interrupt, an exit: as raised
        error = RuntimeError(f"{_reason(caught)}; {_left(name, directory, kept)}")
        if callfail.is_dcp(caught):  # its text holds every failing rank's traceback: said in one line each above
            raise error from None
        raise error from caught
    callfail.ended(ns)
    return out


def _reason(exc: BaseException) -> str:
    """Why the save failed, starting ``rank R:``: DCP's failures one per failing rank, its last line each."""
    rank = runtime.STATE.rank
    failures = getattr(exc, "failures", None) if callfail.is_dcp(exc) else None
    if failures:
        parts = []
        for r, wrapped in sorted(failures.items()):
            err = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (exception, its frames), as DCP keeps it
            last = (str(err).strip().splitlines() or [""])[-1]
            parts.append(f"rank {r}: {type(err).__name__}{': ' + last if last else ''}")
        return f"rank {rank}: writing failed on {len(failures)} of {runtime.STATE.world_size} ranks ({'; '.join(parts)})"
    text = f"{exc}" if str(exc).startswith(f"rank {rank}:") else f"rank {rank}: {type(exc).__name__}: {exc}"
    return text.rstrip(".")


def _left(name: str, directory: str, kept: bool) -> str:
    """What the failed save left of model ``name``: live on the ranks (``kept``), or where its weights are."""
    if kept:
        return (f"nothing was lost: {name} is still live on the ranks as before the save (their process group "
                f"was kept): fix the cause (free space, a folder every rank can write) and save again (files this "
                f"save left in {directory} are incomplete)")
    run = RUNS.get(name)
    plan = getattr(run, "plan_dict", None)
    if plan is None:
        return "the process group is re-formed"
    if not STRATEGIES[plan["strategy"]][1]:
        return (f"the process group is re-formed; {name} is whole on every rank and is distributed again at the "
                "next save or cell")
    return (f"the process group is re-formed, and the ranks' {plan['strategy']} copy of {name} goes with it; "
            + weights_left(name, run))
