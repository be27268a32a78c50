"""No process outlives the kernel that started it: kernel shutdown and SIGKILL of the kernel."""

import os
import signal
import time

import psutil
import pytest
from jupyter_client import KernelManager


def _start_cluster_in_kernel():
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ, "DISTNB_PROGRESS": "text"})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    code = ("%load_ext distnb\n%dist start -n 2\nimport distnb, json\n"
            "_p = distnb.current().cluster.pids\nprint('PIDS', json.dumps([_p['controller'], *_p['engines']]))")
    out = []
    reply = kc.execute_interactive(code, timeout=90, output_hook=lambda m: out.append(m))
    assert reply["content"]["status"] == "ok", reply["content"]
    text = "".join(m["content"].get("text", "") for m in out if m["msg_type"] == "stream")
    import json

    pids = json.loads(text.split("PIDS", 1)[1].strip().splitlines()[0])
    kernel_pid = km.provisioner.process.pid
    procs = [psutil.Process(p) for p in pids]
    # the whole process tree the kernel started (engines, their nannies, controller)
    procs += [c for c in psutil.Process(kernel_pid).children(recursive=True) if c not in procs]
    return km, kc, procs


def _wait_gone(procs, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.25)
    return [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("how", ["shutdown", "sigkill"])
def test_cluster_dies_with_its_kernel(how):
    km, kc, procs = _start_cluster_in_kernel()
    assert len(procs) >= 3
    try:
        if how == "shutdown":
            km.shutdown_kernel(now=False)
        else:
            os.kill(km.provisioner.process.pid, signal.SIGKILL)
        left = _wait_gone(procs, 15)
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    assert left == [], f"{how}: processes left after 15 s: {left}"
