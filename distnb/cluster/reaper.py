"""A watchdog process: when the kernel dies, stop every process its cluster started.

ipyparallel starts the controller and the engines in their own sessions, so when a
kernel is killed (SIGKILL, a crash, an out-of-memory kill) nothing stops them and
they live on, holding ports and memory. :func:`spawn` starts this module as a tiny
separate process that polls the kernel's pid; once the kernel is gone it terminates
the watched processes and their children (SIGTERM, then SIGKILL after a grace
period), and removes the shared-memory files of the kernel's transfers
(``/dev/shm/distnb-<kernel pid>-*``). It exits by itself when everything it watches has gone
(a normal stop).

Usage: ``python -m distnb.cluster.reaper KERNEL_PID PID [PID ...]`` (with a lease, :func:`spawn` starts
:mod:`distnb.cluster.keeper` instead: ``python -m distnb.cluster.keeper --lease JSON KERNEL_PID PID [PID ...]``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

POLL_SECONDS = 0.5
GRACE_SECONDS = 3.0


def spawn(pids, watch_pid=None, **lease) -> subprocess.Popen:
    """Start a reaper for ``pids`` (and their children), watching ``watch_pid`` (default: this process).

    ``lease`` (``linger``, ``cluster_id``, ``cluster_file``, ``engines``, ``folder``; see
    :class:`distnb.cluster.keeper.Keeper`) makes it the world's lease keeper: a run outlives the kernel.
    """
    args = [sys.executable, "-m", "distnb.cluster.keeper" if lease else "distnb.cluster.reaper", str(watch_pid or os.getpid()),
            *map(str, pids)]
    if lease:
        args[3:3] = ["--lease", json.dumps(lease)]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reap(procs) -> None:
    """Terminate ``procs`` and all their descendants; kill what is left after the grace period."""
    import psutil

    everything = []
    for p in procs:
        try:
            everything += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for p in everything:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    kill_after(everything, GRACE_SECONDS, settle=0.0)


def kill_after(procs, grace: float, settle: float = 5.0) -> None:
    """Wait up to ``grace`` s for ``procs`` (psutil.Process) to exit, SIGKILL the rest, then wait up to ``settle``
    s for those."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    if settle and alive:
        psutil.wait_procs(alive, timeout=settle)


def sweep_shm(kernel_pid: int) -> None:
    """Remove the kernel's shared-memory transfer files (``distnb-<pid>-*``, see distnb.engine.transport.wire)."""
    folder = os.environ.get("DISTNB_SHM_DIR", "/dev/shm")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(f"distnb-{kernel_pid}-"):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def main(argv) -> int:
    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupt button is not for us
    try:
        kernel = psutil.Process(int(argv[0]))
    except psutil.NoSuchProcess:
        kernel = None
    procs = []
    for pid in argv[1:]:
        try:
            procs.append(psutil.Process(int(pid)))
        except psutil.NoSuchProcess:
            pass
    while True:
        if kernel is None or not _alive(kernel):
            reap([p for p in procs if _alive(p)])
            sweep_shm(int(argv[0]))
            return 0
        if not any(_alive(p) for p in procs):
            return 0
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
