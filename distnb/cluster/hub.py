"""The ipyparallel controller of a cluster started here: whether it still runs, and what to say when it does not.

Every call to a rank and every result goes through the controller. When its process ends (killed from
outside, by the out-of-memory killer, or ``%dist status``'s pid killed by mistake) the engines still run,
but a call to them waited forever: ``%%dist`` hung until interrupted and then spent the group re-form's
timeout, ``%dist status`` said the ranks were "busy, or still loading". :func:`check_controller` names the
death and the fix at once instead: before each call (``Cluster.check_sendable``), about every second during
a cell (``execute.Watch``), and in ``%dist status``.
"""

from __future__ import annotations

import signal
import time

import psutil

from distnb.core.errors import ClusterError


def controller_death(cluster) -> str:
    """How the controller this kernel started ended (``killed by SIGKILL``), or '' while it runs (or if it
    is not a process of this machine that the kernel started)."""
    launcher = getattr(getattr(cluster, "_ipp", None), "controller", None)
    proc = getattr(launcher, "process", None)
    if proc is None or getattr(cluster, "client", None) is None:
        return ""
    code = getattr(proc, "exit_status", None)
    if code is None:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return ""
        except psutil.Error:
            pass
        code = _exit_status(proc)
    if code is None:
        return "exited (status unknown)"
    if int(code) < 0:
        try:
            return f"killed by {signal.Signals(-int(code)).name}"
        except ValueError:
            return f"killed by signal {-int(code)}"
    return f"exited with status {int(code)}"


def _exit_status(proc, wait: float = 0.5):
    """The exit status of the ended ``proc``, which its reaper (the engine template, or ipyparallel's wait thread)
    may record a moment after the process is gone; None if it is not known within ``wait`` s."""
    deadline = time.monotonic() + wait
    while True:
        if hasattr(proc, "exit_status"):
            code = proc.exit_status
        else:  # ipyparallel's own child: psutil reaps it (None once its wait thread did)
            try:
                code = proc.wait(0)
            except psutil.Error:
                code = None
        if code is not None or time.monotonic() >= deadline:
            return code
        time.sleep(0.02)


def controller_message(cluster, how: str) -> str:
    """The sentence naming the controller's death and the fix."""
    pid = getattr(getattr(cluster._ipp, "controller", None), "pid", "?")
    return (f"the ipyparallel controller (pid {pid}) died: {how}; every call to the ranks and every result goes "
            f"through it, so the {cluster.world_size} engines cannot be reached. Run %dist restart (or "
            f"session.restart()) for a fresh world of {cluster.world_size} ranks")


def check_controller(cluster) -> None:
    """ClusterError naming the controller's death and the fix, if it died."""
    how = controller_death(cluster)
    if how:
        raise ClusterError(controller_message(cluster, how))
