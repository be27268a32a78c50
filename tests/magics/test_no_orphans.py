"""No process outlives what stops it (issue 4, behaviour 5), in a real Jupyter kernel.

After ``%dist stop``, a kernel restart, a kernel shutdown and a SIGKILL of the kernel, no engine,
controller or other process the cluster started (the controller's schedulers, engine nannies if any)
is left after 15 s. The pids checked are the ones ``%dist status`` shows (controller and
engines) plus every descendant of the kernel at that moment. The engine template
(:mod:`distnb.cluster.zygote`) belongs to the kernel, not to a cluster: it outlives ``%dist stop`` and
must be gone with the kernel.
"""

import json
import os
import signal
import time

import psutil
import pytest
from jupyter_client import KernelManager

BOUND = 15  # seconds


def _execute(kc, code, timeout=90):
    out = []
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=out.append)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(m["content"].get("text", "") for m in out if m["msg_type"] == "stream")


def _start_kernel():
    km = KernelManager(kernel_name="python3")
    km.shutdown_wait_time = 10
    km.start_kernel(env={**os.environ, "DISTNB_PROGRESS": "text"})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def _start_cluster(km, kc):
    """``%dist start -n 2`` in the kernel; the processes to watch: what ``%dist status`` shows, and descendants."""
    text = _execute(kc, "%load_ext distnb\n%dist start -n 2\nimport json\n_t = get_ipython().run_line_magic('dist', "
                        "'status')\nprint('PIDS', json.dumps([_t.controller_pid, *[r['pid'] for r in _t]]))")
    pids = json.loads(text.split("PIDS", 1)[1].strip().splitlines()[0])
    assert len(pids) == 3 and all(pids), pids
    procs = [psutil.Process(p) for p in pids]
    kernel = psutil.Process(km.provisioner.process.pid)
    procs += [c for c in kernel.children(recursive=True) if c not in procs]  # nannies, schedulers
    assert len(procs) >= 3  # the controller (and its schedulers), 2 engines (and any nannies)
    return procs


def _alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(procs, seconds=BOUND):
    t0 = time.monotonic()
    deadline = t0 + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in procs):
            print(f"all {len(procs)} processes gone after {time.monotonic() - t0:.1f} s")
            return []
        time.sleep(0.25)
    return [(p.pid, " ".join(p.cmdline()[:3])) for p in procs if _alive(p)]


def test_dist_stop_then_kernel_restart():
    km, kc = _start_kernel()
    try:
        procs = _start_cluster(km, kc)
        templates = [p for p in procs if "--zygote" in p.cmdline()]
        assert len(templates) == 1, "the engine template is one of the kernel's processes"
        _execute(kc, "%dist stop")
        assert _wait_gone([p for p in procs if p not in templates]) == [], "processes left 15 s after %dist stop"
        assert _alive(templates[0]), "the engine template is kept for the next %dist start"
        assert km.is_alive()  # the kernel itself goes on
        procs = _start_cluster(km, kc)  # a second cluster in the same kernel, then a kernel restart
        old_kernel = km.provisioner.process.pid
        km.restart_kernel(now=False)
        assert km.provisioner.process.pid != old_kernel
        left = _wait_gone(procs)
        assert left == [], f"processes left 15 s after a kernel restart: {left}"
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


@pytest.mark.parametrize("how", ["shutdown", "sigkill"])
def test_cluster_dies_with_its_kernel(how):
    km, kc = _start_kernel()
    try:
        procs = _start_cluster(km, kc)
        if how == "shutdown":
            km.shutdown_kernel(now=False)
        else:
            os.kill(km.provisioner.process.pid, signal.SIGKILL)
        left = _wait_gone(procs)
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    assert left == [], f"{how}: processes left after 15 s: {left}"
