"""Where a rank is: its cell's main thread, read by a watchdog thread while the cell runs.

While a ``%%dist`` or ``%%distrain`` cell runs, :class:`Watchdog` reads the stack of the
thread that runs it every :data:`INTERVAL` seconds (``sys._current_frames``, which also works
while that thread is blocked in a collective: torch releases the GIL while it waits) and
publishes a summary to the kernel (ipyparallel's ``publish_data``, key ``distnb_where``):

- ``state``: ``"collective"`` (inside ``torch.distributed``: a collective, FSDP's
  all-gather, a pipeline's send/recv, DDP's gradient all-reduce at the end of
  ``backward``), ``"running"`` (anywhere else), or ``"idle"`` (no cell);
- ``op`` and ``shape``: the collective (for one called from cell code, the one the cell
  called, with its tensor's shape: :data:`distnb.engine.process.collectives.CURRENT`);
- ``cell_line`` and ``cell_code``: the innermost line of the cell's own code on the stack;
- ``stack``: the innermost frames, ``(file, line, function, code)``;
- ``note``: what the rank says it waits for outside torch.distributed (:data:`NOTE`), or None;
- ``unchecked``: the cell runs ``--unchecked``: its own collectives go straight to torch, uncounted,
  so the kernel cannot tell which of them a rank has called (:mod:`distnb.execute.hangs` words a hang so);
- ``since`` and ``sent``: when the rank got to this spot and when it said so (``time.time()``,
  seconds, the rank's clock: the kernel only uses their difference).

The kernel (:mod:`distnb.execute.execute`) names a hang from these (ranks waiting in a collective that
others never reached) and ``%dist where`` shows them. The idea of sampling a blocked
process's stack from outside its blocked thread is py-spy's and ``faulthandler``'s; this
reads it from inside, at no cost to the training thread beyond the GIL for a few microseconds.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from distnb.engine.process import abort, arrival, collectives, ncclfail

#: Seconds between two looks at the cell's thread.
INTERVAL = 0.25
#: Seconds one look may take before the next watchdog gets a new looker thread (see _Looker).
STUCK_SECONDS = 2.0
#: Frames of the stack that are sent (innermost first is the end of the list).
STACK_FRAMES = 10
_TORCH_DIST = os.sep + os.path.join("torch", "distributed") + os.sep
_DDP = os.sep + os.path.join("torch", "nn", "parallel", "distributed.py")  # DDP's own syncs (buckets, buffers)
_BACKWARD = (os.sep + os.path.join("torch", "autograd") + os.sep, os.sep + os.path.join("torch", "_tensor.py"))
_CELLS = ("<dist-cell-", "<distrain-cell-")
_WRAPPERS = ("wrapper", "inner", "_fn", "decorate_context")
#: torch's op dispatch (``OpOverload.__call__``), between a functional collective's wait and torch.distributed's code.
_OPS = os.path.join("torch", "_ops.py")
#: ``{"text": ...}`` while the cell's thread waits in distnb's own code for the other ranks (the step-count
#: agreement of :func:`distnb.engine.train.context.agree_on_steps`): published as ``note``, named by a hang's message.
NOTE: dict = {}


def _summary(frame, ddp_backward: bool) -> dict:
    """What :mod:`distnb.execute.execute` needs to know about a stack whose innermost frame is ``frame``."""

    stack = traceback.extract_stack(frame)
    cell = next((f for f in reversed(stack) if f.filename.startswith(_CELLS)), None)
    op = None
    # in a collective when its innermost frame is torch.distributed's (past torch's op dispatch, through which
    # a functional collective waits): a pipeline stage's forward runs inside ScheduleGPipe.step, computing
    inner = next((f for f in reversed(stack) if not f.filename.endswith(_OPS)), None)
    if inner is not None and _TORCH_DIST in inner.filename:
        for f in stack:  # the outermost frame inside torch.distributed names the call (not a decorator's wrapper)
            if _TORCH_DIST in f.filename and f.name not in _WRAPPERS:
                op = f.name
                break
    if op is None and stack and _DDP in stack[-1].filename:  # DDP's forward syncs (bucket rebuild, buffers)
        op = f"DDP {stack[-1].name}"
    if op is None and ddp_backward and any(b in f.filename for f in stack[-6:] for b in _BACKWARD):
        op = "DDP gradient all-reduce (backward)"
    current = collectives.CURRENT.get("call")
    shape = None
    if op is not None and current is not None:
        op, shape = current
    if op is None and _nccl():  # blocked in a CUDA sync (loss.item()) behind a collective the peers never joined
        rows = ncclfail.pending()
        if rows:
            op = ncclfail.describe(rows[0])
    return dict(state="collective" if op is not None else "running", op=op, shape=shape, note=NOTE.get("text") or arrival.WAITING.get("text"),
                unchecked=bool(collectives.SUBSET.get("unchecked")), cell_line=cell.lineno if cell else None, cell_code=(cell.line or "").strip() if cell else None,
                stack=[(f.filename, f.lineno, f.name, (f.line or "").strip()) for f in stack[-STACK_FRAMES:]])


def _nccl() -> bool:
    """Whether this rank's group is nccl's (its collectives run on in the GPU after the Python call returned)."""
    runtime = sys.modules.get("distnb.engine.process.runtime")
    return runtime is not None and runtime.STATE.backend == "nccl"


class Watchdog:
    """Publishes where the calling thread is every :data:`INTERVAL` seconds until :meth:`stop`.

    The looks are made by one long-lived thread per process (:class:`_Looker`), not a thread
    per cell: starting a thread makes the cell's thread wait until the new one runs, which on a
    loaded machine with many engines on a few cores costs a scheduler round trip per engine
    and cell (measured in benchmarks/README.md, issue 20). :meth:`start` and :meth:`stop`
    only take a lock; a burst of short cells wakes the looker about once per :data:`INTERVAL`.

    Parameters
    ----------
    publish : callable
        ``publish(dict)`` (the engine: ipyparallel's ``publish_data``).
    ddp_backward : bool
        A DDP model trains: a long ``backward`` is a wait in the gradient all-reduce.
    """

    def __init__(self, publish, ddp_backward: bool = False):
        self.target_id = threading.get_ident()
        self.publish, self.ddp_backward = publish, ddp_backward
        self._spot, self._since = None, time.time()

    def start(self) -> None:
        """Look at the calling thread (the one that made this watchdog) from :data:`INTERVAL` s on."""
        _looker().arm(self)

    def stop(self) -> None:
        """No look starts after this (one under way may still publish: :meth:`join` waits for it)."""
        _looker().disarm(self)

    def join(self, timeout: float | None = None) -> None:
        """Wait until no look at this watchdog is under way (after :meth:`stop`: nothing more is published)."""
        _looker().wait_idle(self, timeout)

    def _look(self) -> bool:
        """One look: poll for another rank's failure, publish where the thread is; False once it has ended."""

        try:
            abort.poll()  # another rank failed: end this rank's collective now (engine/abort.py)
        except Exception:  # never end the watchdog (it also publishes where the rank is)
            pass
        frame = sys._current_frames().get(self.target_id)
        if frame is None:
            return False
        try:
            where = _summary(frame, self.ddp_backward)
        except Exception:  # a look at the stack must never break the cell
            return True
        finally:
            del frame
        # the same line at the next look is the same visit only if the rank made no progress in between
        spot = (where["state"], where["op"], where["stack"][-1][:3] if where["stack"] else None,
                collectives.PROGRESS[0])
        if spot != self._spot:
            self._spot, self._since = spot, time.time()
        where["since"], where["sent"] = self._since, time.time()
        try:
            self.publish({"distnb_where": where})
        except Exception:
            pass
        return True


class _Looker(threading.Thread):
    """The thread that makes every armed :class:`Watchdog`'s looks, each :data:`INTERVAL` s after the last.

    It sleeps until the earliest armed watchdog is due (indefinitely while none is), so an
    engine between cells costs nothing. Arming wakes it only when it would otherwise wake later
    than the new watchdog is due; disarming never wakes it. A looker stuck in one look for
    :data:`STUCK_SECONDS` (a store that does not answer) is retired and a new one takes over its
    watchdogs, as a thread per cell would have left the next cell's watchdog unaffected.
    """

    def __init__(self):
        super().__init__(name="distnb-where", daemon=True)
        self.cond = threading.Condition()
        self.armed: dict = {}  # Watchdog -> time.monotonic() of its next look
        self.looking: tuple = ()  # the watchdogs being looked at now (outside the lock)
        self.wake_at = None  # when the thread wakes next (time.monotonic()), None: only when notified
        self.look_started = None  # time.monotonic() when the looks under way began, None between looks
        self.retired = False  # replaced by another looker: end after the look under way

    def arm(self, dog: Watchdog) -> None:
        with self.cond:
            due = self.armed[dog] = time.monotonic() + INTERVAL
            if self.wake_at is None or self.wake_at > due:
                self.cond.notify_all()  # join() callers may wait on it too

    def disarm(self, dog: Watchdog) -> None:
        with self.cond:
            self.armed.pop(dog, None)

    def wait_idle(self, dog: Watchdog, timeout) -> None:
        with self.cond:
            self.cond.wait_for(lambda: dog not in self.looking, timeout)

    def stuck(self) -> bool:
        started = self.look_started
        return started is not None and time.monotonic() - started > STUCK_SECONDS

    def retire(self) -> dict:
        """Stop this looker (after the look under way); the watchdogs it had armed, but the ones it is stuck on."""
        with self.cond:
            self.retired, armed = True, {d: t for d, t in self.armed.items() if d not in self.looking}
            self.armed.clear()
            self.cond.notify_all()
            return armed

    def run(self) -> None:
        while not self.retired:
            with self.cond:
                while not self.retired:
                    now = time.monotonic()
                    due = tuple(d for d, t in self.armed.items() if t <= now)
                    if due:
                        break
                    self.wake_at = min(self.armed.values()) if self.armed else None
                    self.cond.wait(None if self.wake_at is None else self.wake_at - now)
                else:
                    return
                for dog in due:
                    self.armed[dog] = now + INTERVAL
                self.looking, self.wake_at, self.look_started = due, None, time.monotonic()
            ended = [dog for dog in due if not dog._look()]
            with self.cond:
                for dog in ended:  # its thread is gone
                    self.armed.pop(dog, None)
                self.looking, self.look_started = (), None
                self.cond.notify_all()


_LOOKER: list = [None, None]  # [the looker thread, the pid it runs in] (a forked engine starts its own)


def _looker() -> _Looker:
    looker, pid = _LOOKER
    if looker is None or pid != os.getpid() or not looker.is_alive() or looker.stuck():
        with _LOOKER_LOCK:
            looker, pid = _LOOKER
            if looker is None or pid != os.getpid() or not looker.is_alive() or looker.stuck():
                fresh = _Looker()
                if looker is not None and pid == os.getpid():
                    fresh.armed.update(looker.retire())  # a stuck one hands its watchdogs over
                fresh.start()
                _LOOKER[:] = [fresh, os.getpid()]
                looker = fresh
    return looker


_LOOKER_LOCK = threading.Lock()


def where_now() -> dict:
    """``%dist where`` between cells: a rank that can answer runs no cell, so it is idle."""
    return dict(state="idle", op=None, shape=None, cell_line=None, cell_code=None, stack=[], since=time.time())
