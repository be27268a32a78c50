"""``%dist debug``: post-mortem pdb on a rank that failed, driven from the notebook.

A rank whose ``%%dist`` or ``%%distrain`` cell raised keeps the exception's frames until the
next cell (:mod:`distnb.engine.process.postmortem`). :func:`debug` opens pdb on them: it prints what
pdb printed on the rank and reads the next command with ``input()``, which in Jupyter is the
kernel's stdin channel (an ``input_request`` answered by the front end's input box), and
sends each command to the rank. ``q`` (or ``c``, or an empty input stream) ends the session
and releases the frames; so does interrupting it. Commands can also be given as a list (for
scripts, and front ends that cannot answer ``input()``, such as nbval).

Example::

    %%dist
    x = torch.ones(2, 3) * rank
    if rank == 1:
        raise ValueError("bad shard")

    %dist debug                 # pdb on rank 1 (the root cause of the last RankError)
    (Pdb) p x.shape
    (Pdb) q

    distnb.current().debug(rank=1, commands=["p x.shape", "up", "q"])
"""

from __future__ import annotations

import signal
import time

from distnb.core import calls
from distnb.core.errors import ClusterError, PlanError

#: Seconds between checks that the debugged rank's engine is alive while a command runs.
CHECK_SECONDS = 0.5
#: Seconds to wait for a command the interrupt stopped on the rank.
INTERRUPT_WAIT = 5.0


def debug(session, rank=None, commands=None) -> str:
    """Post-mortem pdb on the kept traceback of a rank whose last cell failed (``%dist debug``).

    pdb starts at the innermost frame of the cell's code (``up``/``down`` move through the
    whole traceback, torch's frames included); ``p``, ``pp``, ``l``, ``where``, ``!expr``
    work as in pdb. ``q``, ``c`` or an empty input ends the session and releases the rank's
    frames; commands that would run the finished cell on (``n``, ``s``, ``r``, ...) are refused.

    Parameters
    ----------
    session : distnb.session.Session
    rank : int, optional
        The rank to debug; default: the root cause of the last RankError (``%dist debug --rank R``).
    commands : list of str, optional
        Commands to run in order instead of asking with ``input()``; the session ends after
        the last one (with ``q`` when the list does not end it).

    Returns
    -------
    str
        The session's transcript: pdb's output, each command after its prompt.

    Raises
    ------
    PlanError
        No rank has failed yet, or ``rank`` keeps no traceback (the message names the ranks that
        do), or the front end cannot answer ``input()`` (pass ``commands``).
    BusyError
        A background training run is going on.
    ClusterError
        The rank's engine died during the session.
    """
    session._check_running()
    if commands is not None and (isinstance(commands, str) or not all(isinstance(c, str) for c in commands)):
        raise PlanError(f"commands must be a list of pdb command strings, got {commands!r}")
    rank = _pick(session, rank)
    feed = None if commands is None else iter(list(commands) + ["q"])
    transcript = []
    try:
        reply = _call(session, rank, calls.debug_begin)
        while True:
            _show(reply["text"], transcript)
            if reply["done"]:
                break
            line = _next_line(session, rank, feed, reply["prompt"])
            transcript.append(f"{reply['prompt']}{line}\n")
            reply = _call(session, rank, calls.debug_command, line)
    except KeyboardInterrupt:
        _call(session, rank, calls.debug_end, True)
        _show(f"distnb: debugging session on rank {rank} interrupted; its frames were released\n", transcript)
    return "".join(transcript)


def _show(text: str, transcript: list) -> None:
    if text:
        print(text, end="")
        transcript.append(text)


def _next_line(session, rank, feed, prompt) -> str:
    """The next command: from ``feed``, else ``input()`` (EOF: ``EOF``, which ends the session)."""
    if feed is not None:
        line = next(feed)
        print(f"{prompt}{line}")  # no input box shows it
        return line
    try:
        return input(prompt)
    except EOFError:
        return "EOF"
    except NotImplementedError:  # IPython's StdinNotImplementedError: a front end without input requests
        _call(session, rank, calls.debug_end, False)
        raise PlanError(f"this front end cannot answer input(), so pdb on rank {rank} cannot ask for commands; "
                        f"pass them: %dist debug --rank {rank} -c 'p x.shape' -c 'up' (or "
                        f"session.debug(rank={rank}, commands=[...])). Rank {rank} still keeps its frames") from None


def _never_arrived(error, rank) -> bool:
    """Whether ``rank`` is in ``error`` (a RankError) as a hang's rank that never reached the collective."""
    if error is None or rank not in error.ranks:
        return False
    return error.failures[error.ranks.index(rank)].get("ename") == "NeverArrived"


def _pick(session, rank) -> int:
    """The rank to debug: ``rank``, else the root cause of the last RankError; PlanError if it keeps nothing."""
    kept = session.cluster.wait_all(session.cluster.apply_all(calls.debug_kept), timeout=session.cluster.spec.timeout,
                                    what="finding the kept tracebacks")
    keeping = [r for r, k in enumerate(kept) if k]
    last = getattr(session, "last_error", None)
    if rank is None:
        rank = last.rank if last is not None and last.rank is not None else (keeping or [None])[0]
        if rank is not None and not kept[rank] and keeping and _never_arrived(last, rank):
            rank = keeping[0]  # a hang's root cause raised nothing: open a rank that raised
        if rank is None:
            raise PlanError("no rank has failed in this session: %dist debug opens pdb on the rank whose cell raised "
                            "the last RankError; run the failing cell first")
    else:
        rank = session._rank(rank)
    if kept[rank]:
        return rank
    if last is not None and rank in last.ranks:
        failure = last.failures[last.ranks.index(rank)]
        why = ("its engine died" if failure.get("ename") == "EngineDied" else
               "it raised nothing: it was not waiting in the collective the others waited in"
               if _never_arrived(last, rank) else
               "its frames were released: a debugging session on it ended, or a cell ran since")
    else:
        why = "it did not fail in the last cell"
    fix = (f"ranks {keeping} keep theirs: %dist debug --rank {keeping[0]}" if keeping else
           "run the failing cell again, then %dist debug")
    raise PlanError(f"rank {rank} keeps no traceback to debug ({why}); {fix}")


def _call(session, rank: int, fn, *args):
    """``fn(*args)`` on ``rank``, waited for; an interrupt stops the command there, then goes on up."""
    cluster = session.cluster
    ar = cluster.apply(rank, fn, *args)
    next_check = time.monotonic() + CHECK_SECONDS
    try:
        while not ar.ready():
            ar.wait(0.1)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + CHECK_SECONDS
                cluster.check_alive([rank])
    except KeyboardInterrupt:
        if not ar.ready():
            cluster.signal(signal.SIGINT, [rank])  # pdb reports it as the command's error
            ar.wait(INTERRUPT_WAIT)
        raise
    try:
        return ar.get(0)
    except Exception as exc:
        what = f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}"
        raise ClusterError(f"pdb on rank {rank} failed ({what}); run %dist debug --rank {rank} again, or "
                           "%dist restart if the rank does not answer") from None
