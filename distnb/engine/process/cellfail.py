"""A training cell's failure on one rank: what the rank does before the error goes to the kernel."""

from __future__ import annotations

import time

from distnb.engine.process import abort, health, postmortem, runtime


def begin() -> None:
    """At a training cell's start, on every rank: no earlier cell's verdict stands for it (the kernel's release
    reads it)."""
    runtime.STATE.kept = False


def raise_failure(caught: BaseException, ns: dict, reporter, annotate, may_keep: bool = False) -> None:
    """Report ``caught`` (the cell's error on this rank) and raise it again; never returns.

    The progress reporter says the rank failed (or was interrupted), ``annotate(exc)`` adds distnb's
    diagnosis to the message in place, the frames are kept for ``%dist debug``, and the process group is
    marked broken, unless ``may_keep`` (the failure left nothing half-done on this rank:
    :mod:`distnb.engine.train.beforestep`) and every rank ended the cell alike
    (:func:`distnb.engine.process.health.cell_ended`): then the group is kept. An error caused by another
    rank's failure is raised as that consequence, briefly.

    Raises
    ------
    BaseException
        ``caught``, the error formatted for printing in its place, or the consequence of another rank's failure.
    """
    exc = abort.printable(caught)  # each step below formats it
    annotate(exc)
    status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    reporter.set_status(status, error=f"{type(exc).__name__}: {exc}"[:300], failed_at=time.time())
    postmortem.keep(exc, ns, "training")  # for %dist debug; mark_broken frees the group the frames hold
    st = runtime.STATE
    stopped = abort.consequence(exc, st.rank)  # another rank failed first: say so, briefly
    st.kept = may_keep and stopped is None and health.cell_ended(st.rank, st.world_size, exc)
    if not st.kept:
        runtime.mark_broken(ns)
    if stopped is not None:
        raise stopped from None
    if exc is not caught:
        raise exc from caught
    raise caught
