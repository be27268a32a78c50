"""A hang named in seconds: ranks waiting in a collective that other ranks never reached.

Every running cell publishes where each rank is (:mod:`distnb.engine.process.where`). When some ranks
have waited in a collective for ``--hang-after`` seconds (:func:`distnb.core.plan.hang_seconds`; in a
training cell whose steps are slow, :data:`PATIENT_STEPS` of them, :func:`limit_for`)
while others are not in one (they finished the cell, or are still in their own code), or
when every rank waits but in different collectives, :func:`check` ends the cell: ranks that
finished are told to drop the process group (:data:`distnb.core.calls.release`), which makes
the waiting ranks' collective fail at once instead of at gloo's ``--timeout``; ranks still in
their code are interrupted. :func:`error` then raises a :class:`~distnb.core.errors.HangError`
that says which ranks waited in which collective (op, shape, cell line, step) and where
each missing rank was, with its stack; the execute path re-forms the group as after any
failure, so the next cell works. This is the check torch's ``monitored_barrier`` makes at a
barrier, made at every collective from the ranks' own stacks.
"""

from __future__ import annotations

import signal
import sys
import time

from distnb.core import calls
from distnb.core.errors import ClusterError, HangError, rank_list
from distnb.core.plan import hang_seconds

#: Seconds after the first interrupt of a missing rank before a second (hard) one: a training cell takes
#: the first as "stop after this step", which a rank stuck inside its step never reaches.
SECOND_INTERRUPT = 0.3


def _waited(where) -> float:
    """Seconds a rank had been at its spot when it last published it."""
    return max(0.0, where.get("sent", time.time()) - where.get("since", time.time()))


#: A training cell's ranks may wait this many of its slowest recent steps before it is a hang, when that is
#: longer than ``--hang-after``: on a shared machine a rank that is only descheduled (its step 2 s of compute,
#: taking 10 s) is slow, not hung.
PATIENT_STEPS = 5


def limit_for(watch) -> float:
    """Seconds of waiting in a collective that make a hang: ``--hang-after``, or :data:`PATIENT_STEPS` times
    the slowest step time the ranks last reported (``step_time``, s) when that is longer; at most ``--timeout``."""
    spec = watch.cluster.spec
    steps = [float((p or {}).get("step_time") or 0.0) for p in getattr(watch, "progress", {}).values()]
    return min(max(hang_seconds(spec), PATIENT_STEPS * max(steps, default=0.0)), spec.timeout)


def check(watch):
    """The hang ``watch``'s ranks are in, with the missing ranks released or interrupted, or None."""
    limit = limit_for(watch)
    ars, wheres = watch.ars, watch.wheres
    waiting = {r: w for r, w in wheres.items() if not ars[r].ready() and r not in watch.dead
               and w.get("state") == "collective"}
    if not waiting or max(_waited(w) for w in waiting.values()) < limit:
        return None
    missing = [r for r in range(len(ars)) if r not in waiting and r not in watch.dead]
    if any(ars[r].ready() and not ars[r].successful() for r in missing):
        return None  # a rank that failed (or whose engine was dropped): the failure path ends the cell
    if not missing and (len({w.get("op") for w in waiting.values()}) < 2
                        or min(_waited(w) for w in waiting.values()) < limit):
        return None
    now = time.time()  # a rank still in its cell: where it last said it was, and when (see _spot)
    hang = dict(waiting=dict(waiting), missing={r: (None if ars[r].ready() else dict(wheres.get(r) or {}, seen=now))
                                                for r in missing},
                limit=limit, signalled=time.monotonic(), again=False, stuck=not missing,
                unchecked=any(w.get("unchecked") for w in waiting.values()))
    if not missing:  # every rank waits, in different collectives: nothing here can interrupt gloo's wait
        said = "; ".join(f"rank {r} in {_call(w, None)}" for r, w in sorted(waiting.items()))
        print(f"distnb: the ranks wait in different collectives ({said}): a hang that only gloo's --timeout "
              f"({watch.cluster.spec.timeout:g} s) can end; the cell will fail then", file=sys.stderr, flush=True)
    for r in missing:
        try:
            if ars[r].ready():  # it finished the cell: dropping its group ends the others' wait at once
                watch.cluster.apply(r, calls.release)
            else:
                watch.cluster.signal(signal.SIGINT, [r])
        except ClusterError:
            pass
    return hang


def follow_up(watch, hang):
    """A missing rank still in its code after :data:`SECOND_INTERRUPT`: interrupt it once more."""
    if not hang["again"] and time.monotonic() - hang["signalled"] > SECOND_INTERRUPT:
        hang["again"] = True
        stuck = [r for r in hang["missing"] if not watch.ars[r].ready()]
        if stuck:
            watch.cluster.signal(signal.SIGINT, stuck)
    return hang


def _call(where, step) -> str:
    op = where.get("op") or "a collective"
    shape = f" of {where['shape']}" if where.get("shape") is not None else ""
    at = f"cell line {where['cell_line']}: `{where['cell_code']}`" if where.get("cell_line") else \
        f"step {step}" if step is not None else "distnb's loop"
    if step is not None and where.get("cell_line"):  # a training cell: how far this rank got, too
        at = f"after {step} step{'' if step == 1 else 's'}, {at}"
    return f"{op}{shape} ({at})"


#: Seconds without a position from a rank still in its cell after which its last one is said to be old: its
#: watchdog thread says where it is every ``where.INTERVAL`` (0.25 s), unless native code holds the GIL.
STALE = 2.0
_SILENT = ("native code holding the GIL, such as a regular expression or a C extension's loop, keeps a rank from "
           "saying where it is")


def _spot(where, unchecked: bool = False) -> str:
    """Where a rank that is not waiting is. ``unchecked`` (an ``--unchecked`` cell): its collective calls are not
    counted, so a rank that finished may well have called the collective (a call without a match can return).
    ``where`` None: it finished the cell; without a position (``sent``), or an old one: it is still in its cell
    but has not said where lately (:data:`STALE`)."""
    if where is None:
        return "it finished the cell" if unchecked else "it finished the cell without calling it"
    if "sent" not in where:
        return f"it is still in its cell but has not said where ({_SILENT})"
    stack = where.get("stack") or []
    if where.get("note"):
        spot = where["note"]
    elif any(f[0].replace("\\", "/").endswith("torch/utils/data/dataloader.py") for f in stack[-8:]):
        spot = ("waiting for a batch from its DataLoader workers (a worker's __getitem__ is slow or stuck: the "
                "Dataset, or a longer --hang-after for a slow one)")
    elif where.get("cell_line"):
        spot = f"at cell line {where['cell_line']}: `{where['cell_code']}`"
    else:
        top = (where.get("stack") or [("?", 0, "?", "")])[-1]
        spot = f"in {top[2]} ({top[0]}:{top[1]})"
    old = where.get("seen", where["sent"]) - where["sent"]
    if old > STALE:
        return f"it was {spot} {old:.0f} s before and has not said where since ({_SILENT})"
    return f"it is {spot}"


def _missing(rank: int, where, unchecked: bool) -> str:
    """``rank 1 never arrived: it is at cell line 3 ...``; in an ``--unchecked`` cell only what the kernel knows:
    ``rank 1 finished the cell``, ``rank 1 is not waiting in a collective: it is at cell line 3 ...``."""
    if not unchecked:
        return f"rank {rank} never arrived: {_spot(where)}"
    if where is None:
        return f"rank {rank} finished the cell"
    return f"rank {rank} is not waiting in a collective: {_spot(where)}"


def _stack_text(where) -> str:
    """The rank's stack from its cell's code inward (the engine's own frames above it left out)."""
    if where is None:
        return "(finished the cell)"
    if "sent" not in where:
        return "(no position reported)"
    stack = where.get("stack") or []
    first = next((i for i, f in enumerate(stack) if f[0].startswith("<dist")), None)
    stack = stack[first:] if first is not None else stack[-4:]
    return "\n".join(f'  File "{f}", line {n}, in {fn}' + (f"\n    {code}" if code else "")
                     for f, n, fn, code in stack)


def error(watch, failures) -> HangError:
    """The HangError for ``watch.hang``: the missing ranks first (with their stacks), then the waiting ones."""
    hang = watch.hang
    waiting, missing = hang["waiting"], hang["missing"]
    steps = {r: (watch.progress.get(r) or {}).get("step") for r in range(len(watch.ars))}
    calls_made = {}
    for r, w in sorted(waiting.items()):
        calls_made.setdefault(_call(w, steps[r]), []).append(r)
    waited = max(_waited(w) for w in waiting.values())
    parts = [f"ranks {rank_list(ranks)} waited {waited:.0f} s in {what}" if len(ranks) > 1 else
             f"rank {ranks[0]} waited {waited:.0f} s in {what}" for what, ranks in calls_made.items()]
    unchecked = hang.get("unchecked", False)
    parts += [_missing(r, w, unchecked) for r, w in sorted(missing.items())]
    ended = (f"Ended by gloo's --timeout ({watch.cluster.spec.timeout:g} s): every rank waited, in different "
             "collectives, which nothing can interrupt" if hang["stuck"] else
             f"Ended after {hang['limit']:.3g} s (--hang-after {hang_seconds(watch.cluster.spec):g} s, or "
             f"{PATIENT_STEPS} of the slowest rank's steps when longer)")
    message = (f"{watch.what} hung: " + "; ".join(parts) + f". {ended}, and the process group re-formed: every rank "
               "must call the same collectives in the same order (a rank that is only slow needs a longer "
               "--hang-after)")
    if unchecked and missing:
        message += (". The cell ran --unchecked: distnb does not count its collective calls then, so it cannot say "
                    "which of them the ranks not waiting made (a call that does not match another rank's can return on "
                    "one rank and leave the other waiting)")
    by_rank = {f["rank"]: f for f in failures}
    out = []
    for r, w in sorted(missing.items()):
        base = by_rank.get(r, dict(rank=r, engine_id=watch.cluster.engine_ids[r], host=watch.cluster.host_of(r)))
        out.append(dict(base, ename="NeverArrived", evalue=_spot(w, unchecked), traceback=_stack_text(w),
                        collateral=False))
    for r, w in sorted(waiting.items()):
        base = by_rank.get(r, dict(rank=r, engine_id=watch.cluster.engine_ids[r], host=watch.cluster.host_of(r)))
        out.append(dict(base, ename="Waited", evalue=f"in {_call(w, steps[r])}", traceback=_stack_text(w),
                        collateral=True))
    return HangError(out, context=watch.what, message=message)
