"""Less work per call in a distnb engine: no flush round trip with nothing to flush, no ``busy`` status.

Every call the kernel makes on a rank (a ``%%dist`` cell is one) is an ipyparallel
``apply_request``. Around it, ipykernel and ipyparallel do work that costs the most when many
engines share few cores (issue 20: 32 engines on 2 cores, where every engine's per-call work
is serialized):

- **Flushes.** ``apply_request`` flushes ``sys.stdout`` and ``sys.stderr`` before it
  replies, and each flush of ipykernel's ``OutStream`` is a round trip to the engine's IOPub
  thread (it schedules the send there and waits for it), even when nothing was written.
  :func:`lazy_flush` makes a stream's ``flush`` return at once when nothing was written to it
  since its last flush; what was written is flushed exactly as before.
- **The ``busy`` status.** ipykernel publishes ``status: busy`` before and ``status: idle``
  after every request, and each IOPub message is relayed by the controller and decoded by the
  kernel's ipyparallel client. The client only acts on ``idle`` (all output has arrived) and
  the controller skips status messages, so :func:`no_busy_status` leaves ``busy`` out: one
  message fewer per engine and call, through every process.
- **Debug records nobody prints.** ipyparallel's engine logger is at DEBUG while its only
  handler prints INFO and above, so every ``log.debug`` of every request (ipykernel's
  dispatch and ipyparallel's ``apply_request`` make several) builds a ``LogRecord`` (the
  caller's frame looked up, the time taken) that the handler then drops: about a tenth of an
  idle engine's main-thread time per call in a 32-rank profile (py-spy). :func:`quiet_logger`
  raises the logger to its handlers' lowest level; what was printed before still is.

All three are applied once per engine by :func:`distnb.engine.process.runtime.setup` (:func:`apply`), and
are measured in benchmarks/README.md (issue 20).
"""

from __future__ import annotations

import logging
import sys


def apply() -> None:
    """Make this engine's streams flush lazily, its kernel skip ``busy`` and its kernel's logger build no
    record its handlers drop; again is a no-op."""
    lazy_flush(sys.stdout)
    lazy_flush(sys.stderr)
    no_busy_status()
    log = _kernel_log()
    if log is not None:
        quiet_logger(log)


def _kernel_log():
    """The engine kernel's logger (the engine application's), or None outside an ipyparallel engine."""
    try:
        from ipyparallel.engine.kernel import IPythonParallelKernel
    except ImportError:
        return None
    return IPythonParallelKernel.instance().log if IPythonParallelKernel.initialized() else None


def lazy_flush(stream) -> bool:
    """Give ``stream`` (ipykernel's ``OutStream``) a ``flush`` that does nothing when nothing was written.

    ``write`` marks the stream after the text is in its buffer; ``flush`` clears the mark and
    then flushes, so text written meanwhile is either in that flush or marks the stream for
    the next one (ipykernel's own timer flushes it within 0.2 s in any case). Returns whether
    the stream was changed (False for another kind of stream, or one changed before).
    """
    if getattr(stream, "_distnb_lazy_flush", False) or not hasattr(stream, "pub_thread"):
        return False
    write, flush = stream.write, stream.flush
    written = [True]

    def lazy_write(string):
        n = write(string)
        written[0] = True
        return n

    def lazy_flush_():
        if written[0]:
            written[0] = False
            flush()

    stream.write, stream.flush = lazy_write, lazy_flush_
    stream._distnb_lazy_flush = True
    return True


def no_busy_status() -> bool:
    """Leave ``status: busy`` out of the engine kernel's IOPub messages (``idle`` and the rest stay).

    Returns False when this is not an ipyparallel engine (nothing changed).
    """
    try:
        from ipyparallel.engine.kernel import IPythonParallelKernel
    except ImportError:
        return False
    if getattr(IPythonParallelKernel, "_distnb_no_busy", False):
        return True
    publish = IPythonParallelKernel._publish_status

    def _publish_status(self, status, *args, **kwargs):
        if status != "busy":
            publish(self, status, *args, **kwargs)

    IPythonParallelKernel._publish_status = _publish_status
    IPythonParallelKernel._distnb_no_busy = True
    return True


def quiet_logger(log) -> int:
    """Raise ``log``'s level to the lowest level of its handlers (and of its parents' while it propagates).

    A record below every handler's level is built and then dropped; at that level ``log.debug``
    returns before building it. A logger with no handler anywhere (or a handler at NOTSET) is left
    alone. Returns the logger's level afterwards.
    """

    levels, node = [], log
    while node is not None:
        levels += [h.level for h in node.handlers]
        node = node.parent if node.propagate else None
    if levels and min(levels) > logging.NOTSET and log.getEffectiveLevel() < min(levels):
        log.setLevel(min(levels))
    return log.getEffectiveLevel()
