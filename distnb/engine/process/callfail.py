"""A collective call of the kernel's other than a cell (a ``%dist save``) that failed: keep the process group when
every rank ended it alike.

A ``%%dist`` cell that fails in its own code keeps the group when it is provably healthy
(:mod:`distnb.engine.process.health`); a save gets the same judgement. Every rank calls :func:`begin`
before the call and :func:`ended` after it, failed or not, so the count of calls ended stays the same
on every rank. The group is kept when the failure is the call's own (or DCP's ``CheckpointException``,
which DCP raises on every rank alike once its collectives have gathered each rank's failure) and every
rank ended the call with the same collectives issued; otherwise it is torn down at once, as after a
failed cell, and the kernel re-forms it (:func:`distnb.execute.execute.recover`).
"""

from __future__ import annotations

from distnb.engine.process import abort, health, runtime


def begin() -> None:
    """Before the call, on every rank: no earlier cell's verdict stands for it (the kernel's release reads it)."""
    runtime.STATE.kept = False


def is_dcp(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.distributed.checkpoint's ``CheckpointException`` (a BaseException)."""
    return type(exc).__name__ == "CheckpointException"


def ended(ns: dict, exc: BaseException | None = None, dcp: bool = False) -> tuple:
    """After the call, on every rank: ``(kept, stopped)``.

    Parameters
    ----------
    ns : dict
        The engine namespace (what holds the group is dropped from it when the group is torn down).
    exc : BaseException, optional
        The call's failure on this rank; None when it succeeded.
    dcp : bool
        DCP's ``CheckpointException`` counts as the call's own failure.

    Returns
    -------
    tuple
        ``kept``: True when the call succeeded, or when the group is kept after ``exc`` (else it was just torn
        down); ``stopped``: the :class:`~distnb.core.errors.PeerFailed` to raise in place of ``exc`` when ``exc``
        only says that another rank failed first, else None.
    """
    st = runtime.STATE
    if exc is None:
        health.cell_ended(st.rank, st.world_size)
        return True, None
    exc = abort.printable(exc)
    stopped = abort.consequence(exc, st.rank)
    st.kept = stopped is None and health.cell_ended(st.rank, st.world_size, exc, dcp=dcp)
    if not st.kept:
        runtime.mark_broken(ns)
    return st.kept, stopped
