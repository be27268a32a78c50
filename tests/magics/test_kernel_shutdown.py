"""A kernel shutdown request stops a running training cell the interrupt's way (issue 36, "Restart").

ipykernel answers ``shutdown_request`` in its control thread and stops its loops, which the main thread reaches only
when the running cell ends: a training cell ran on to its end (34 s in the report). distnb wraps the kernel's
``do_shutdown`` (distnb/kernelstop.py). Here the request comes as ipykernel sends it, from another thread, while
the main thread (this test's) runs a training cell on the real cluster; the cluster's own stop at that point is
recorded, not done (the shared cluster serves the next tests). That is ``--linger 0``; with a lease (issue 38) the
request leaves the cell running: the world's keeper takes it over once the kernel is gone.
"""

import asyncio
import dataclasses
import threading
import time

import pytest

from distnb import kernelstop
from distnb.execute import presses
from distnb.core.errors import Interrupted

SETUP = """import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
ks_X = torch.randn(256, 8)
ks_train = torch.utils.data.TensorDataset(ks_X, (ks_X[:, 0] > 0).long())
ks_net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))"""


class Kernel:
    """What distnb wraps of ipykernel's IPythonKernel: ``do_shutdown`` (a coroutine in ipykernel 7)."""

    def __init__(self):
        self.calls = []

    async def do_shutdown(self, restart):
        self.calls.append((restart, time.monotonic()))
        return {"status": "ok", "restart": restart}


def test_a_shutdown_request_stops_the_running_training_cell_after_the_same_step(shell, dist_session, monkeypatch):
    shell.run_cell(SETUP)
    kernel, stopped_cluster = Kernel(), []
    monkeypatch.setattr(dist_session.cluster, "spec", dataclasses.replace(dist_session.cluster.spec, linger=0.0))
    monkeypatch.setattr(shell, "kernel", kernel, raising=False)
    monkeypatch.setattr(kernelstop, "_stop_cluster", lambda: stopped_cluster.append(presses.IDLE.is_set()))
    assert kernelstop.install(shell) and not kernelstop.install(shell)  # once
    replies = []

    def request():  # ipykernel's control thread
        time.sleep(3.0)
        reply = asyncio.run(kernel.do_shutdown(True))
        replies.append((presses.IDLE.is_set(), reply))

    thread = threading.Thread(target=request)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupted, match="every rank stopped after the same step") as caught:
            dist_session.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", model="ks_net", data="ks_train",
                               epochs=400, batch_size=4, optimizer="adam", progress="none", quiet=True)
        ended = time.monotonic()
    finally:
        thread.join(30)
    assert ended - t0 < 3.0 + 2.0  # within 2 s of the request (400 epochs take far longer)
    assert caught.value.result.rows[0]["steps"] == caught.value.result.rows[1]["steps"] > 0
    (idle, reply), = replies
    assert reply == {"status": "ok", "restart": True} and len(kernel.calls) == 1  # then ipykernel's own
    assert idle and stopped_cluster == [True]  # the reply (and the cluster's stop) waited for the cell's conclusion
    ok = dist_session.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", model="ks_net", data="ks_train",
                            epochs=1, batch_size=4, progress="none", quiet=True)
    assert ok.rows[0]["first_epoch"] == caught.value.result.rows[0]["next_epoch"]  # the state the stop kept


def test_b_with_a_lease_the_request_leaves_the_cell_and_the_cluster_running(shell, dist_session, monkeypatch):
    shell.run_cell(SETUP)
    kernel, stopped_cluster = Kernel(), []
    assert dist_session.cluster.spec.linger > 0  # the default, 10 minutes
    monkeypatch.setattr(shell, "kernel", kernel, raising=False)
    monkeypatch.setattr(kernelstop, "_stop_cluster", lambda: stopped_cluster.append(presses.IDLE.is_set()))
    kernelstop.install(shell)
    replies = []

    def request():  # ipykernel's control thread
        time.sleep(1.5)  # the cell takes about 4 s
        replies.append((presses.IDLE.is_set(), asyncio.run(kernel.do_shutdown(False))))

    thread = threading.Thread(target=request)
    thread.start()
    try:
        result = dist_session.train("x, y = batch\n__import__('time').sleep(0.03)\nloss = F.cross_entropy(model(x), y)",
                                    model="ks_net", data="ks_train", epochs=4, batch_size=4, progress="none",
                                    quiet=True)
    finally:
        thread.join(30)
    (idle, reply), = replies
    assert not idle and reply == {"status": "ok", "restart": False}  # answered at once, the cell still running
    assert stopped_cluster == [] and not result.rows[0]["interrupted"]  # the cell ran to its end: 4 epochs
    assert result.rows[0]["next_epoch"] - result.rows[0]["first_epoch"] == 4
