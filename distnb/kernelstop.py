"""A kernel shutdown or restart request stops a running training cell at once, as the interrupt button does.

Jupyter's polite restart (and shutdown) sends ``shutdown_request`` on the control channel; ipykernel
answers it in its control thread, then stops the kernel's event loops, which the main thread reaches
only when the running cell ends: a training cell of many epochs ran on to its end (34 s in the report),
and the client then killed the kernel. :func:`install` wraps the kernel's ``do_shutdown`` so that, first,
a running training cell is stopped the interrupt's way (:func:`distnb.execute.presses.stop_cell`: every rank
stops after the same step, its ``--checkpoint-dir`` checkpoint is written, the weights come back) and
the request waits for that, at most :data:`WAIT_SECONDS`; then the session's exit path stops the
cluster and ipykernel goes on (its own shutdown SIGTERMs the kernel's child processes, the engine template among them, for up
to 4.4 s first, and the client kills the kernel after ``shutdown_wait_time / 2``).

That is ``%dist start --linger 0``. With a lease (issue 38, the default) a running cell, foreground or
``--background``, is left to run: the request goes straight to ipykernel, the cluster is not stopped, and the
world's keeper (:mod:`distnb.cluster.keeper`) takes over once the kernel is gone.
"""

from __future__ import annotations

import asyncio
import inspect
import time

from distnb.cluster import lease, zygote
from distnb.execute import presses

#: Seconds a shutdown request waits for a training cell to stop (jupyter_client gives the kernel
#: ``shutdown_wait_time``, 5 s by default, before it signals and kills it).
WAIT_SECONDS = 4.5


def install(ipython) -> bool:
    """Wrap the kernel's ``do_shutdown`` (ipykernel's ``IPythonKernel``) once; False outside a kernel."""
    kernel = getattr(ipython, "kernel", None)
    original = getattr(kernel, "do_shutdown", None)
    if original is None or getattr(original, "distnb_stops_cells", False):
        return False

    async def do_shutdown(restart):
        if _left_to_keeper():  # --linger: the run goes on to its end; the world's keeper takes it from here
            reply = original(restart)
            return await reply if inspect.isawaitable(reply) else reply
        if presses.stop_cell():
            deadline = time.monotonic() + WAIT_SECONDS
            while not presses.IDLE.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        if presses.IDLE.is_set():  # no cell of distnb's runs: stop the cluster now, not after ipykernel's
            _stop_cluster()  # SIGTERMs to its child processes (4.4 s of them for engines that wait on)
        reply = original(restart)
        return await reply if inspect.isawaitable(reply) else reply

    do_shutdown.distnb_stops_cells = True
    kernel.do_shutdown = do_shutdown
    return True


def _left_to_keeper() -> bool:
    """Whether a cell of distnb's runs (foreground or --background) in a world started with --linger > 0: it
    then outlives this kernel (:mod:`distnb.cluster.lease`), and the request neither stops it nor the cluster."""
    from distnb import session  # imported at first use: loading the extension stays light (no torch)

    current = session._CURRENT
    return (current is not None and current.running
            and lease.outlives_kernel(current, cell_running=not presses.IDLE.is_set()))


def _stop_cluster() -> None:
    """The session's exit path (engines, controller) and the engine template's, run at the shutdown request."""
    from distnb import session  # imported at first use: loading the extension stays light (no torch)

    session._stop_at_exit()
    zygote.stop()
