"""A world in a real kernel whose kernel then dies (issue 38's lease): start it, read it, wait for its keeper.

Used by tests/lifecycle/: a kernel started by jupyter_client's KernelManager (or a Jupyter Server),
``%dist start`` in it, and what the test checks afterwards: the keeper's record
(:func:`distnb.cluster.lease.read_keeper`), the world's processes, its kernel's /dev/shm files, its port.
"""

from __future__ import annotations

import glob
import json
import os
import time

import psutil

from distnb.cluster import lease
from distnb.engine.transport import segments
from support import kernels

#: What the kernel computes and trains: 256 samples, 2 ranks x batch 8 = 16 steps an epoch; the sleep makes a run
#: long enough to outlive its kernel, and changes no weight.
SETUP = """import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
X = torch.randn(256, 8)
train = torch.utils.data.TensorDataset(X, (X[:, 0] > 0).long())
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))"""
BODY = "x, y = batch\n__import__('time').sleep({sleep})\nloss = F.cross_entropy(model(x), y)"
OPTIONS = "--model net --data train --epochs {epochs} --batch-size 8 --optimizer sgd --lr 0.05 --progress none"
STEPS_PER_EPOCH = 16
INFO = """import json as _json, distnb as _distnb
_c = _distnb.session.current().cluster
print("WORLD" + _json.dumps(dict(cluster_id=_c._ipp.cluster_id, family=_c.family, keeper=_c.reaper.pid,
      folder=_c.lease_folder, port=_c.master_port, kernel=__import__("os").getpid())))"""


def execute(kc, code, timeout=120.0):
    """Run ``code`` in the kernel; (stdout, error content or None)."""
    out, _, error = kernels.execute(kc, code, timeout)
    return out, error


def run(kc, code, timeout=120.0) -> str:
    out, error = execute(kc, code, timeout)
    assert error is None, (code, error, out)
    return out


def start_world(kc, linger: str, epochs: int = 0, sleep: float = 0.0) -> tuple[dict, str]:
    """``%dist start -n 2 --linger LINGER`` in the kernel, the model and data made, and with ``epochs`` a
    ``--background`` training run started; (the world's facts, the start's output)."""
    started = run(kc, "%load_ext distnb")
    started += run(kc, f"%dist start -n 2 --timeout 30 --linger {linger}")
    run(kc, SETUP)
    info = json.loads(run(kc, INFO).split("WORLD", 1)[1])
    if epochs:
        run(kc, f"%%distrain --background {OPTIONS.format(epochs=epochs)}\n{BODY.format(sleep=sleep)}")
    return info, started


def alive(pids) -> list:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def wait_gone(pids, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


def wait_state(cluster_id: str, states, timeout: float, keeper_pid=None) -> dict | None:
    """The keeper's record once its state is one of ``states`` (None: the keeper ended without one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = lease.read_keeper(cluster_id)
        if record is not None and record.get("state") in states:
            return record
        if keeper_pid is not None and not alive([keeper_pid]) and record is None:
            return None
        time.sleep(0.1)
    raise AssertionError(f"keeper of {cluster_id} not in {states} within {timeout} s: {lease.read_keeper(cluster_id)}")


def shm_files(kernel_pid: int) -> list:
    return glob.glob(os.path.join(segments.SHM_DIR, f"distnb-{int(kernel_pid)}-*"))


def port_listeners(port: int) -> list:
    """Who listens on ``port``: ``[(pid, command line)]``, empty once the world's TCPStore is gone.

    Only a listening socket is a leak: once the world has ended, the OS may hand the same number to any
    process's outgoing connection as its ephemeral source port (seen in CI: a bind test then called the port
    taken although every process of the world had ended)."""
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            try:
                who = " ".join(psutil.Process(conn.pid).cmdline()) if conn.pid else "?"
            except psutil.Error:
                who = "?"
            out.append((conn.pid, who))
    return out


def wait_port_released(port: int, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while port_listeners(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    return port_listeners(port)


def assert_all_gone(info: dict, timeout: float = 10.0) -> None:
    """Every process of the world and its keeper ended, its kernel's /dev/shm files and its port released."""
    left = wait_gone([*info["family"], info["keeper"]], timeout)
    assert left == [], f"processes left: {left}"
    assert shm_files(info["kernel"]) == []
    listeners = wait_port_released(info["port"], timeout)
    assert listeners == [], f"port {info['port']} still listened on by {listeners}"


def trained_reference(shell, epochs: int) -> dict:
    """The uninterrupted run's weights: the same cell, foreground, on the shared 2-rank cluster (state_dict)."""
    shell.run_cell(SETUP.replace("net =", "lease_net =").replace("train =", "lease_train ="))
    options = OPTIONS.format(epochs=epochs).replace("--model net", "--model lease_net").replace(
        "--data train", "--data lease_train")
    shell.run_cell_magic("distrain", options, BODY.format(sleep=0))
    return {k: v.clone() for k, v in shell.user_ns["lease_net"].state_dict().items()}


def load_checkpoint(path: str):
    """The model state saved at ``path`` (a ``step_*`` folder) loaded into a one-process copy of the net."""
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn

    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    state = {"model": net.state_dict()}
    dcp.load(state, checkpoint_id=path)
    net.load_state_dict(state["model"])
    with open(os.path.join(path, "distnb.json")) as f:
        meta = json.load(f)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, meta, torch
