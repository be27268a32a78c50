"""A polite kernel restart stops a running training cell at once (issue 36, "Restart"), end to end.

Here ipykernel's own shutdown also reaches the ranks (its SIGTERMs to the kernel's child processes), so this passes
without distnb's hook too; tests/magics/test_kernel_shutdown.py checks the hook itself, which does not depend on
that (the report's restart waited 34 s for the cell).

Jupyter's restart sends ``shutdown_request``; ipykernel stops its loops only once the running cell ends, so a long
training cell ran on (34 s in the report) until the client killed the kernel, and nothing of the interrupt's clean
stop happened. Now the request stops the cell as the interrupt button does: every rank after the same step, the
cell's --checkpoint-dir checkpoint written (ipykernel's shutdown terminated the engines, its child processes,
mid-cell: nothing written), then the kernel exits by itself (a real kernel through jupyter_client,
a real 2-rank cluster in it).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from test_jupyter_kernel import _execute, kernelspecs  # noqa: F401 - the fixture installs the kernel spec

WAIT = 12  # the client's shutdown_wait_time: it signals a kernel still alive after half of it, and kills it then
SETUP = """import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
X = torch.randn(256, 8)
train = torch.utils.data.TensorDataset(X, (X[:, 0] > 0).long())
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))"""


@pytest.mark.parametrize("restart", [True])
def test_a_shutdown_request_stops_a_running_training_cell_and_keeps_its_checkpoint(kernelspecs, tmp_path,  # noqa: F811
                                                                                     restart):
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="distnb")
    km.shutdown_wait_time = WAIT
    km.start_kernel(env=dict(os.environ, DISTNB_ZYGOTE="0"))  # engines launched apart from the kernel
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=30)
        # --linger 0: the run ends with its kernel (issue 38's lease would let it run on: tests/lifecycle/)
        for code in ("%dist start -n 2 --timeout 30 --linger 0", SETUP):
            _, err, error = _execute(kc, code, timeout=120)
            assert error is None, (error, err)
        ckpt = tmp_path / "ckpt"
        kc.execute(f"%%distrain --model net --data train --epochs 100000 --batch-size 4 --optimizer adam "
                   f"--checkpoint-dir {ckpt} --checkpoint-every 1000000 --progress none\nx, y = batch\nloss = F.cross_entropy(model(x), y)")
        time.sleep(6.0)  # training (the model sent, steps under way)
        t0, requested = time.monotonic(), time.time()
        if restart:
            km.restart_kernel(now=False)
        else:
            km.shutdown_kernel(now=False)
        took = time.monotonic() - t0
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
    assert took < WAIT - 1, f"the kernel took {took:.1f} s to stop: it was killed"
    # the interrupt's final checkpoint, the only one (--checkpoint-every is never reached): before, ipykernel's
    # shutdown terminated the engines (its child processes) in the middle of the cell, and none was written
    steps = sorted(d for d in os.listdir(ckpt) if d.startswith("step_")) if ckpt.exists() else []
    assert len(steps) == 1, steps
    meta = json.loads((ckpt / steps[0] / "distnb.json").read_text())
    assert meta["optimizer"] == "adam"
    # written within 2 s of the request: the cell stopped at once, not when the client signalled the kernel (at
    # WAIT / 2 = 6 s; the report's restart waited 34 s for the cell)
    stopped = os.path.getmtime(ckpt / steps[0] / "distnb.json") - requested
    assert stopped < 2.0, f"the cell stopped {stopped:.1f} s after the shutdown request"
