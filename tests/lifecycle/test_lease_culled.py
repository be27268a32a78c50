"""The lease under a real Jupyter Server whose culler ends the kernel (issue 38, "culling the kernel").

A Jupyter Server on 127.0.0.1 with ``cull_idle_timeout`` 10 s, ``cull_interval`` 1 s and ``cull_busy`` off; the
kernel is started through its REST API and the cells run through the kernel's connection file (jupyter_client;
no websocket stays open, so the culler counts the kernel as unconnected). A ``--background`` run returns at once,
the kernel goes idle, the culler shuts it down (a polite ``shutdown_request``, then a kill), the run goes on to
its end, the lease expires, the state is saved and everything ends, as in test_lease.py's killed kernel.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time

import pytest
import requests
from jupyter_client import BlockingKernelClient
from jupyter_core.paths import jupyter_runtime_dir

from distnb.core.net import free_port
from support import lease_world as lw

EPOCHS = 12
TOKEN = "distnb-lease-test"


@pytest.fixture
def server(tmp_path):
    """A Jupyter Server that culls idle kernels after 10 s; yields its base URL."""
    port = free_port("127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter_server", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", "--ServerApp.allow_root=True", f"--IdentityProvider.token={TOKEN}",
         "--ServerApp.open_browser=False",
         f"--ServerApp.root_dir={tmp_path}", "--MappingKernelManager.cull_idle_timeout=10",
         "--MappingKernelManager.cull_interval=1", "--MappingKernelManager.cull_busy=False",
         "--MappingKernelManager.cull_connected=False"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/api/status", headers=_auth(), timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _auth() -> dict:
    return {"Authorization": f"token {TOKEN}"}


def _wait_for_kernel_info(kc, timeout=60.0) -> None:
    """The kernel answers (jupyter_client's wait_for_ready reads a silent heartbeat as a dead kernel here)."""
    deadline = time.monotonic() + timeout
    while True:
        msg_id = kc.kernel_info()
        try:
            while kc.get_shell_msg(timeout=2)["parent_header"].get("msg_id") != msg_id:
                pass
            return
        except queue.Empty:
            assert time.monotonic() < deadline, "the kernel did not answer kernel_info"


def _kernel_ids(url) -> list:
    return [k["id"] for k in requests.get(f"{url}/api/kernels", headers=_auth(), timeout=10).json()]


def test_e_a_culled_kernel_s_run_finishes_then_the_lease_saves_it_and_everything_ends(server, shell, tmp_path):
    (tmp_path / "train.ipynb").write_text(json.dumps(dict(cells=[], metadata={}, nbformat=4, nbformat_minor=5)))
    session = requests.post(f"{server}/api/sessions", headers=_auth(), timeout=60, json=dict(
        path="train.ipynb", name="train.ipynb", type="notebook", kernel={"name": "python3"})).json()
    kernel = session["kernel"]  # as JupyterLab opens a notebook: the kernel runs in its folder
    kc = BlockingKernelClient(connection_file=os.path.join(jupyter_runtime_dir(), f"kernel-{kernel['id']}.json"))
    kc.load_connection_file()
    kc.start_channels()
    try:
        _wait_for_kernel_info(kc)
        info, said = lw.start_world(kc, "3s", epochs=EPOCHS, sleep=0.13)  # 25 s of training or more
    finally:
        kc.stop_channels()
    assert info["folder"].startswith(str(tmp_path / "distnb-lease" / "train-")) and info["folder"] in said
    deadline = time.monotonic() + 30
    while kernel["id"] in _kernel_ids(server):  # the culler: 10 s idle, then shutdown
        assert time.monotonic() < deadline, "the server did not cull the idle kernel"
        time.sleep(0.5)
    assert lw.wait_gone([info["kernel"]], 15) == []
    lw.wait_state(info["cluster_id"], ("training",), 10)  # the kernel is gone, the run goes on
    assert lw.alive(info["family"]) == info["family"]
    record = lw.wait_state(info["cluster_id"], ("ended",), 60)
    assert record["error"] is None and len(record["saved"]) == 1, record
    lw.assert_all_gone(info)
    got, meta, torch = lw.load_checkpoint(record["saved"][0]["path"])
    assert meta["steps"] == EPOCHS * lw.STEPS_PER_EPOCH and meta["epoch"] == EPOCHS, meta
    for name, value in lw.trained_reference(shell, EPOCHS).items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
    assert not json.dumps(record).count("Traceback")
