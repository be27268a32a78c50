"""The interrupt pressed again while a cell is being stopped: counted, never raised in distnb's own code.

Once the first press has reached :class:`distnb.execute.execute.Watch` (a KeyboardInterrupt in its wait), distnb
asks every rank to stop after the same step, reads what they trained, and brings the weights back
into the notebook. A second press used to raise KeyboardInterrupt wherever the kernel then was: in the
wait for the ranks (distnb then interrupted them where they were, mid-step, and the next cell sent the
model again with a fresh optimizer: the optimizer state and the epoch count lost in 4 of 8 double
presses), or in the conclusion itself. From the first press on, :func:`absorb` replaces Python's SIGINT
handler with one that only calls back (the press is taken as "stop sooner": the ranks get
:data:`distnb.execute.execute.AGAIN_GRACE` seconds more to reach a step boundary), until the innermost
:func:`held` scope ends (a training cell's conclusion included), or until the callable it returns is
called outside one. Only the main thread's handler can be replaced: a background run's watcher has
none to replace (its stop is ``%dist stop-training``).
"""

from __future__ import annotations

import contextlib
import signal
import threading

#: Open :func:`held` scopes, innermost last: each the handlers to restore when it ends.
_SCOPES: list = []
#: Set while no :func:`held` scope of the main thread is open (a kernel shutdown waits on it: :func:`stop_cell`).
IDLE = threading.Event()
IDLE.set()


@contextlib.contextmanager
def held():
    """A scope (a training cell: its wait for the ranks and its conclusion) in which presses stay counted.

    Nothing changes until :func:`absorb` is called inside it; Python's handler is back when it ends.
    """
    scope: list = []
    _SCOPES.append(scope)
    main = threading.current_thread() is threading.main_thread()
    if main:
        IDLE.clear()
    try:
        yield
    finally:
        _SCOPES.remove(scope)
        for restore in reversed(scope):
            restore()
        if main and not _SCOPES:
            IDLE.set()


def stop_cell() -> bool:
    """From another thread (the kernel's control thread): stop the main thread's running cell as the interrupt
    button does (:func:`held`); whether one was running. The ranks stop after the same step, and the cell's
    conclusion (its checkpoint, the weights back) runs as for the button: wait for :data:`IDLE`."""
    if IDLE.is_set() or threading.current_thread() is threading.main_thread():
        return False
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    return True


def absorb(on_press):
    """From now on, SIGINT calls ``on_press()`` instead of raising KeyboardInterrupt.

    Parameters
    ----------
    on_press : callable
        Called with no argument in the main thread at each press (keep it short: no I/O).

    Returns
    -------
    callable
        Restores the previous handler; it does nothing inside a :func:`held` scope, which restores it
        when it ends (so the rest of the cell is shielded too), nor off the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return _nothing
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda signum, frame: on_press())
    restored = []

    def restore():
        if not restored:
            restored.append(True)
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)

    if _SCOPES:
        _SCOPES[-1].append(restore)
        return _nothing
    return restore


def _nothing():
    return None
