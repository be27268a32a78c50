"""Training in the background: ``%%distrain --background`` / ``Session.train(..., background=True)``.

The training cell's whole foreground path (send model and data, start the ranks, watch
them, stop them on failure, re-form the group, weights back) runs in a kernel thread, so
the cell returns as soon as the ranks have started and the kernel stays free while the
dashboard keeps updating (ipywidgets and printed output from a thread reach the front end
through ipykernel's IOPub thread; the thread runs in a copy of the cell's context, so rank
output lands in the training cell). ipyparallel's client sends through its own IO loop,
so calls from this thread are safe while the main thread leaves the cluster alone: every
other distnb command raises :class:`~distnb.core.errors.BusyError` until the run is over, except
``%dist where`` and ``%dist status`` (which do not ask the busy ranks) and ``%dist stop``
(:func:`stop_before_cluster_stop` stops the run first, then the cluster).

``%dist wait`` (:meth:`Session.wait`) joins the thread and returns the run's TrainResult
(the run's own thread put the weights into the kernel's model, once, as it ended). A finished
run stays on the session until ``%dist wait`` (or ``%dist stop-training``, ``%dist stop``, a new
background run) collects it: other commands that find it finished print one line about it, once,
and leave it there, so ``r = %dist wait`` still returns it (or raises what it raised) however many
commands ran in between. Once collected it is gone: a second ``%dist wait`` says there is nothing
to wait for. ``%dist stop-training`` (:meth:`Session.stop_training`) asks the watcher to stop the ranks
exactly as the interrupt button does in the foreground (a SIGINT to every rank; they agree
on a step and stop together), then collects the run.
"""

from __future__ import annotations

import contextvars
import threading
import time

from distnb.core.errors import BusyError, Interrupted
from distnb.train.results import summary

#: Message of the error other distnb commands raise while a background run is going on.
BUSY_MESSAGE = ("a background training run (%%distrain --background) is still going on; run %dist wait to wait "
                "for its result, or %dist stop-training to stop it (Python: session.wait() / "
                "session.stop_training()); %dist stop stops it and the cluster")


class BackgroundRun:
    """A training run going on in a kernel thread.

    Parameters
    ----------
    target : callable
        ``target(**kwargs)`` runs the foreground training path and returns a TrainResult.
    kwargs : dict

    Attributes
    ----------
    thread : threading.Thread
    started : threading.Event
        Set once the ranks have started training (or the run ended before that).
    ended : threading.Event
        Set once the run is over (result or error recorded). Liveness is this event, not
        ``thread.is_alive()``: on Python < 3.13 a KeyboardInterrupt that lands in
        ``Thread.join`` can mark a thread that is still running as stopped (seen on 3.11: CPython's
        bpo-45274 handling releases the tstate lock the running thread holds), after which
        ``is_alive()`` is False and ``join()`` returns at once while the run goes on.
    watching : bool
        True once the kernel-side watcher is running (the ranks have the training call).
    result : TrainResult or None
    error : BaseException or None
        What the run raised (RankError, Interrupted, PlanError, ...).
    on_result : list of callable
        Called with the TrainResult in the main thread, once: when a command first finds the run finished.
    noted : bool
        True once a command other than ``%dist wait`` said, in one line, that the run had ended.
    collected : bool
        True once the run was taken off the session (its result returned or its error raised).
    """

    def __init__(self, target, kwargs):
        self.started = threading.Event()
        self.stop_requested = threading.Event()
        self.ended = threading.Event()
        self.watching = False
        self.result = None
        self.error = None
        self.collected = False
        self.noted = False
        self.delivered = False  # on_result called
        self.on_result = []
        self.t_start = time.monotonic()
        self.t_end = None
        context = contextvars.copy_context()  # the cell's output parent: rank output lands in the cell
        self.thread = threading.Thread(target=context.run, args=(self._main, target, kwargs),
                                       name="distnb-background-training", daemon=True)

    def _main(self, target, kwargs):
        try:
            self.result = target(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever collects the run
            self.error = exc
        finally:
            self.t_end = time.monotonic()
            self.started.set()
            self.ended.set()

    def start(self) -> "BackgroundRun":
        """Start the thread and wait until the ranks train (or the preparation failed).

        Raises
        ------
        Exception
            Whatever the preparation raised (a PlanError for a bad option, ...), in this thread.
        """
        self.thread.start()
        try:
            while not self.started.wait(0.1):
                pass
        except KeyboardInterrupt:
            self.request_stop()
            self.join()
            raise
        if not self.watching and self.done:
            self.collected = True
            if self.error is not None:
                raise self.error.with_traceback(None)
        return self

    @property
    def active(self) -> bool:
        """True while the run goes on."""
        return not self.ended.is_set()

    @property
    def done(self) -> bool:
        """True once the run has ended (finished, failed or stopped)."""
        return self.ended.is_set()

    def current_thread_is_runner(self) -> bool:
        """True when called from the run's own thread."""
        return threading.current_thread() is self.thread

    def request_stop(self) -> None:
        """Ask the watcher to stop the ranks (returns at once; thread-safe)."""
        self.stop_requested.set()

    def join(self, timeout=None) -> bool:
        """Wait for the run to end (interruptible); returns True if it ended.

        Waits on :attr:`ended`, never ``Thread.join``, which a KeyboardInterrupt can corrupt.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ended.is_set():
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                return False
            self.ended.wait(left)
        return True

    def __repr__(self):
        state = "running" if self.active else "finished" if self.error is None else f"ended ({type(self.error).__name__})"
        return f"<distnb background training run: {state}>"


def check_idle(session) -> None:
    """Raise BusyError if ``session`` has a background run going on (its own thread excepted).

    A finished run nobody has collected yet is said in one line (once) and kept for ``%dist wait``.
    """
    run = getattr(session, "_background", None)
    if run is None or run.current_thread_is_runner():
        return
    if run.active:
        raise BusyError(BUSY_MESSAGE)
    note(run)


def deliver(run) -> None:
    """Call the finished run's ``on_result`` callbacks (``-o NAME`` bound), the first time only."""
    if run.delivered or run.error is not None:
        return
    run.delivered = True
    for callback in run.on_result:
        callback(run.result)


def note(run) -> None:
    """Say in one line, once, that the run ended; it stays for ``%dist wait`` (which returns it, or raises)."""
    deliver(run)
    if run.noted:
        return
    run.noted = True
    if run.error is None:
        print(f"distnb: the background run finished: {run.result.title}; %dist wait returns its result")
        return
    first = (str(run.error).strip().splitlines() or [""])[0]
    print(f"distnb: the background run ended: {type(run.error).__name__}: {first}; %dist wait raises it")


def collect(session):
    """Take the finished background run off ``session``; return its TrainResult or raise its error."""
    run = session._background
    session._background = None
    if run is None:
        return None
    run.collected = True
    if run.error is not None:
        raise run.error.with_traceback(None)
    deliver(run)
    if getattr(run.result, "lost", None):  # said while it ran, where no one may have looked

        print(f"distnb: during the background run, {summary(run.result.lost)}")
    return run.result


def wait(session, timeout=None):
    """``%dist wait`` (see :meth:`distnb.session.Session.wait`)."""
    run = session._background
    if run is None:
        print("distnb: no background training run to wait for (start one with %%distrain --background)")
        return None
    try:
        if not run.join(timeout):
            print(f"distnb: the background run is still going on after {timeout:g} s")
            return None
    except KeyboardInterrupt:  # the interrupt button during the wait: stop the run as stop_training does
        return stop(session)
    return collect(session)


def stop(session, quiet=False):
    """``%dist stop-training`` (see :meth:`distnb.session.Session.stop_training`)."""
    run = session._background
    if run is None:
        if not quiet:
            print("distnb: no background training run to stop")
        return None
    run.request_stop()
    run.join()
    try:
        result = collect(session)
    except Interrupted as exc:
        if not quiet:
            print(f"distnb: {exc}")
        return None
    if result is not None and result.interrupted and not quiet:
        print(f"distnb: {result.interrupted_message}; the result holds what was trained")
    return result


def stop_before_cluster_stop(session) -> str:
    """``%dist stop`` during a background run: stop the run as ``%dist stop-training`` does, then say how.

    Every rank is asked to stop after the same step (the watcher's SIGINT, then a second one
    for ranks that do not stop within ``STOP_WAIT``); the wait is bounded by the execute path's
    stop waits plus 5 s, after which the run is left to the cluster's stop (the engines are shut
    down and killed, the run's thread ends on the closed client). A stopped run's weights are in
    the kernel's model, and ``-o NAME`` is bound, as after ``%dist stop-training``.

    Returns
    -------
    str
        The clause the stop's one line starts with ("" when there was no run to stop).
    """
    from distnb.execute.execute import INTERRUPT_WAIT, STOP_WAIT  # loads psutil at first use

    run = session._background
    if run is None or run.current_thread_is_runner():
        return ""
    if not run.done:
        run.request_stop()
        waited = STOP_WAIT + INTERRUPT_WAIT + 5
        if not run.join(waited):
            session._background = None
            return f"the background training run did not stop within {waited:g} s, so it ended with the engines; "
    session._background = None
    run.collected = True
    if run.error is not None:
        if isinstance(run.error, Interrupted):  # stopped before a step ended everywhere: no weights came back
            return f"stopped the background training run ({run.error}); "
        first = (str(run.error).strip().splitlines() or [""])[0]
        return f"the background run had ended ({type(run.error).__name__}: {first}); "
    deliver(run)
    if run.result.interrupted:
        return (f"stopped the background training run ({run.result.interrupted_message}; the kernel's model "
                "holds the weights of the last completed step), then ")
    return f"the background run had finished ({run.result.title}; its weights are in the kernel's model), then "


def end(session) -> None:
    """At exit: stop a background run (bounded by the execute path's stop waits) so the cluster can stop."""
    from distnb.execute.execute import INTERRUPT_WAIT, STOP_WAIT  # loads psutil at first use

    run = session._background
    if run is not None and not run.current_thread_is_runner():
        run.request_stop()
        run.join(STOP_WAIT + INTERRUPT_WAIT + 5)
        session._background = None
