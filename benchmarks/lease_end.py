"""Seconds from a kernel's SIGKILL to every process of its idle world gone: --linger 0 against the lease (issue 38).

A world with no training running must still end "within seconds, as today" when its kernel dies: with a lease,
the keeper first asks the controller whether a task runs (ipyparallel imported, a client connected), then ends
everything. Real kernels (jupyter_client), a real 2-rank world each, alternated ROUNDS times.

Usage: ``PYTHONPATH=$PWD python benchmarks/lease_end.py [ROUNDS]`` from the repository root.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2


def main() -> None:
    scratch = tempfile.mkdtemp(prefix="lease-bench-")
    os.environ["JUPYTER_RUNTIME_DIR"], os.environ["IPYTHONDIR"] = f"{scratch}/runtime", f"{scratch}/ipython"
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from jupyter_client import KernelManager

    from support import lease_world as lw

    for linger in ["0", "10m"] * ROUNDS:
        km = KernelManager(kernel_name="python3")
        km.start_kernel(cwd=scratch, env=dict(os.environ))
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        info, _ = lw.start_world(kc, linger)
        t0 = time.monotonic()
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        left = lw.wait_gone([*info["family"], info["keeper"]], 30)
        print(f"--linger {linger}: everything gone {time.monotonic() - t0:.2f} s after SIGKILL (left: {left})",
              flush=True)
        kc.stop_channels()


if __name__ == "__main__":
    main()
