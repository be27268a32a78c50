"""One call sent to many engines: one message each, handed to the client's I/O thread in one go (issue 20).

An ipyparallel ``apply_async`` hands its message to the client's I/O thread with
``add_callback``, which wakes that thread (a write to its event loop's self-pipe) for every
message; the woken thread then takes the GIL from the sending thread to send just that one.
With 32 engines a ``%%dist`` cell paid 32 wake-ups and as many GIL hand-overs before the last
engine got its request. :func:`apply_each` builds every engine's message first and hands them
over together (:func:`one_wakeup`), and it calls the client's ``send_apply_request`` directly:
a per-engine ``DirectView`` adds two decorators' bookkeeping (a view history that only grows)
and nothing distnb reads. Each engine still gets its own message and its own
``AsyncResult``, so results, output and failures arrive per rank exactly as before.
Measured in benchmarks/README.md ("The empty cell").

The client's private ``_mux_stream`` and ``_io_loop`` are the ones ``DirectView`` itself uses.
"""

from __future__ import annotations

import contextlib
import functools
import threading

from ipyparallel.client.asyncresult import AsyncResult


@contextlib.contextmanager
def one_wakeup(io_loop):
    """While active, this thread's ``io_loop.add_callback`` calls are kept and run as one callback at the end.

    Other threads' callbacks go through as usual. The kept callbacks run in the order they were
    added, in the I/O thread, even when the block raises.
    """
    me, kept = threading.get_ident(), []
    add = io_loop.add_callback

    def add_callback(callback, *args, **kwargs):
        if threading.get_ident() == me:
            kept.append(functools.partial(callback, *args, **kwargs))
        else:
            add(callback, *args, **kwargs)

    io_loop.add_callback = add_callback
    try:
        yield
    finally:
        del io_loop.add_callback  # the loop's own method again
        if kept:
            add(_run_all, kept)


def _run_all(callbacks) -> None:
    for callback in callbacks:
        callback()


def apply_each(client, engine_ids, fn, args) -> list:
    """``fn(*args)`` on each engine of ``engine_ids``: one AsyncResult per engine, in that order.

    ``fn`` and ``args`` should be ipyparallel ``PrePickled`` (serialized once for all engines).
    Raises ipyparallel's IndexError for an engine id the client does not know.
    """
    idents, _ = client._build_targets(list(engine_ids))
    stream, name = client._mux_stream, getattr(fn, "__name__", "unknown")
    with one_wakeup(client._io_loop):
        futures = [client.send_apply_request(stream, fn, list(args), {}, ident=ident, metadata={"label": None})
                   for ident in idents]
    return [AsyncResult(client, future, fname=name, targets=[eid], owner=True)
            for future, eid in zip(futures, engine_ids)]
