"""A training body's own collectives: every rank of the group arrives at the same call first, through the store.

In a ``%%distrain`` body, a collective that some ranks skip (a metric all-reduced on rank 0 only:
``if rank == 0: dist.all_reduce(m)``) meets the other ranks' next collective instead: DDP's
gradient all-reduce in backward, FSDP's gathers, or distnb's own at the epoch end. gloo, given
buffers of different sizes, aborts the engine (SIGABRT, and every rank must restart); with equal
sizes it pairs them and returns a silently wrong result. The fingerprint check of ``%%dist`` cells
(:func:`distnb.engine.process.collectives._checked_call`) is a collective itself, so it meets them too.

Here each rank of the call's group writes the call's fingerprint (collective, dtype, shape, root,
reduce op) to the group's store (the world's TCPStore, kept by :mod:`distnb.engine.process.abort`) and
waits outside torch.distributed, in its own Python, until every rank of the group has written
its own (:func:`arrive`). A rank that never comes leaves the others waiting where the kernel's
hang check (:mod:`distnb.execute.hangs`) can interrupt them: the cell ends as a
:class:`~distnb.core.errors.HangError` naming every rank's spot, the step's update applied on no rank,
and the group re-formed with the model and optimizer kept (as after any failed cell). Ranks that
arrive with different fingerprints raise the same error on every rank, before the collective.
Only then does the collective itself run, on ranks known to be at the same call.

Cost: a store ``set``, a few ``check`` polls and one ``multi_get`` per call (about 1 ms on
loopback), paid only by the body's own collectives, never by DDP's or distnb's. Without a store
(a backend distnb does not arm), :mod:`distnb.engine.process.collectives` keeps its all-reduce check.
"""

from __future__ import annotations

import time

from distnb.engine.process import abort

#: Seconds of the first poll of the store, doubled up to :data:`POLL_SECONDS` (as the step agreement's).
POLL_FIRST = 0.0001
POLL_SECONDS = 0.005
#: Calls counted per process group (by its name), alike on every rank; counted anew on a new store (group).
_COUNTS: dict = {"store": None}
#: ``{"text": ...}`` while this rank waits here: published as its ``note`` (:mod:`distnb.engine.process.where`).
WAITING: dict = {}


def available() -> bool:
    """Whether this rank's group has a store to agree through (a gloo world distnb armed)."""
    return abort.ARMED.store is not None


def arrive(dist, group, ranks: list, fingerprint: list, op: str, timeout: float | None = None) -> list:
    """Write this rank's ``fingerprint`` for the next call on ``group``; every rank's, once all arrived.

    Parameters
    ----------
    dist : module
        ``torch.distributed``.
    group : ProcessGroup or None
        The call's group (None: the world).
    ranks : list of int
        The group's global ranks, in group order.
    fingerprint : list of int
        This rank's call (:func:`distnb.engine.process.collectives._fingerprint`).
    op : str
        The collective's name, for where this rank is said to wait.
    timeout : float, optional
        Seconds to wait at most (the world's ``--timeout``): a wait the kernel's hang check cannot name (every
        rank waiting here, at calls on different groups) ends then, naming the ranks that never came.

    Returns
    -------
    list of list of int
        Each rank's fingerprint, in ``ranks`` order.

    Raises
    ------
    KeyboardInterrupt
        When the kernel interrupts the wait (a rank never arrived: :mod:`distnb.execute.hangs`).
    TimeoutError
        After ``timeout`` seconds, naming the ranks of the group that never called it.
    """
    store = abort.ARMED.store
    if _COUNTS.get("store") is not store:  # a new group (the world re-formed): counted from 0 on every rank alike
        _COUNTS.clear()
        _COUNTS["store"] = store
    name = _group_name(dist, group)
    seq = _COUNTS[name] = _COUNTS.get(name, 0) + 1
    me = dist.get_rank()
    prefix = f"distnb_call/{name}/"
    store.set(f"{prefix}{seq}/{me}", ",".join(str(int(v)) for v in fingerprint))
    keys = [f"{prefix}{seq}/{r}" for r in ranks]
    WAITING["text"] = (f"waiting at its dist.{op} for the other ranks of its group to call it too (every rank "
                          "must call the same collectives in a step, in the same order)")
    delay, deadline = POLL_FIRST, None if not timeout else time.monotonic() + timeout
    try:  # polled, not store.wait: the store's C++ logs a warning line (into the cell) at each wait's timeout
        while not store.check(keys):
            if deadline is not None and time.monotonic() > deadline:
                absent = [r for r, k in zip(ranks, keys) if not store.check([k])]
                raise TimeoutError(f"rank {me} waited {timeout:g} s (--timeout) at its dist.{op} for rank(s) "
                                   f"{', '.join(map(str, absent))} of its group, which never called it: every rank "
                                   "must call the same collectives in a step, in the same order")
            time.sleep(delay)
            delay = min(POLL_SECONDS, 2 * delay)
    finally:
        WAITING.pop("text", None)
    rows = [[int(v) for v in value.decode().split(",")] for value in store.multi_get(keys)]
    if seq > 1:  # every rank of the group has written this call's key, so each has read the previous one's
        try:
            store.delete_key(f"{prefix}{seq - 1}/{me}")
        except Exception:  # a key left behind costs a few bytes in the store, nothing more
            pass
    return rows


def _group_name(dist, group) -> str:
    """The group's name (the same on every rank of it: torch's own, made from its ranks)."""
    try:
        return dist.distributed_c10d._get_process_group_name(group if group is not None else dist.group.WORLD)
    except Exception:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        return "ranks-" + "-".join(map(str, ranks))
