"""``%dist attach`` / ``distnb.attach()`` (issue 38): a world started in one process, joined from another.

The first kernel is a real process (``support/world_owner.py``: ``distnb.start`` and a ``--background``
training run); this test process is the second kernel. The record's privacy and the attaches it refuses
(another uid, an altered key): test_attach_refused.py, on one first kernel for them all.

Until the lease branch is merged, ``distnb.cluster.lease`` is absent: these tests then give ``attach`` a stand-in
``distnb.cluster.lease.claim`` that records the call (the world's first kernel stays alive, so nothing needs the
keeper); the kill-the-first-kernel proof needs the real one and is skipped without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types

import psutil
import pytest
import torch

import distnb
from distnb import session as sessions
from distnb.cluster import worlds
from support.data import blobs, mlp

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
EPOCHS, STEPS_PER_EPOCH = 10, 4  # 64 samples, 2 ranks, --batch-size 8


@pytest.fixture
def claims(monkeypatch):
    """The lease claims attach made; a recording stand-in for ``distnb.cluster.lease`` until the lease branch is merged."""
    made = []
    if importlib.util.find_spec("distnb.cluster.lease") is None:
        monkeypatch.setitem(sys.modules, "distnb.cluster.lease", types.SimpleNamespace(
            claim=lambda cluster_id, kernel_pid, timeout=10.0: made.append((cluster_id, kernel_pid))))
        monkeypatch.setattr(distnb, "lease", sys.modules["distnb.cluster.lease"], raising=False)
    monkeypatch.setattr(sessions, "_CURRENT", None)  # this process is a fresh kernel: no world of its own
    return made


@contextlib.contextmanager
def first_kernel(tmp_path, gate_open=False):
    """A first kernel (a real process) running a background run of EPOCHS epochs, slow until ``gate`` exists."""
    gate = tmp_path / "gate"
    if gate_open:
        gate.touch()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS]))
    proc = subprocess.Popen([sys.executable, "-m", "support.world_owner", str(EPOCHS), "0.3", str(gate)], cwd=TESTS,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = {}
    try:
        line = proc.stdout.readline()
        assert line, f"the first kernel ended before its run started (exit status {proc.wait(30)})"
        info = json.loads(line)
        deadline = time.monotonic() + 15.0  # the record notes the run from a thread, just after the cell started
        while not (worlds.read(info["record"]) or {}).get("run") and time.monotonic() < deadline:
            time.sleep(0.05)
        info.update(proc=proc, gate=gate, record_data=worlds.read(info["record"]))
        yield info
    finally:
        gate.touch()
        with contextlib.suppress(OSError):
            proc.stdin.write("exit\n")
            proc.stdin.flush()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rec = info.get("record_data") or {}
        _end([rec.get("controller_pid"), *(r["pid"] for r in rec.get("ranks", []))])


def _end(pids) -> None:
    """Kill what of ``pids`` still runs (a failed test's world); wait for them."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error, TypeError, ValueError):
            procs.append(psutil.Process(pid))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def _gone(record, timeout=15.0) -> bool:
    pids = [record["controller_pid"], *(r["pid"] for r in record["ranks"])]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.2)
    return False


def _rank_weights(s, rank):
    s.run("_w = {k: v.detach().clone() for k, v in net.state_dict().items()}", targets=[rank])
    return s.pull("_w", rank=rank)


def test_attach_lists_joins_follows_the_run_and_stops_the_world(claims, tmp_path):
    with first_kernel(tmp_path) as world:
        table = distnb.attach()  # every live world of this user: the shared cluster's too, when this run has it
        rows = [r for r in table.rows if r["world"] == world["cluster_id"]]
        assert len(rows) == 1, table
        row = rows[0]
        assert row["ranks"] == 2 and row["strategy"] == "ddp" and row["cell"].startswith("import os, time")
        assert row["progress"].startswith("epoch ") and f"of {EPOCHS * STEPS_PER_EPOCH}" in row["progress"]

        s = distnb.attach(world["cluster_id"][:-1], quiet=True)  # a unique prefix will do
        assert sessions._CURRENT is s and s.world_size == 2
        assert claims in ([], [(world["cluster_id"], os.getpid())])  # [] with the real lease
        status = s.status()
        assert [r["alive"] for r in status.rows] == [True, True] and "busy training" in status.title
        assert worlds.read(world["record"])["kernel_pid"] == os.getpid()  # this kernel owns the world now
        world["gate"].touch()
        result = s.wait()
        assert result is not None and result.epochs == list(range(EPOCHS))
        assert s.holdings.trained_steps["net"] == EPOCHS * STEPS_PER_EPOCH
        assert s.wait() is None  # returned once
        record = worlds.read(world["record"])
        assert record["run"] is None and record["kernel_pid"] == os.getpid()  # the first kernel left it to this one
        assert s.where().rows[0]["state"] == "idle"
        rec = world["record_data"]
        s.stop(quiet=True)
        assert _gone(rec), "the engines or the controller outlived %dist stop from the attached kernel"
        assert not os.path.exists(world["record"])
        assert world["cluster_id"] not in [r["world"] for r in distnb.attach().rows]


def test_attach_model_takes_the_weights_and_the_next_cell_continues_the_live_model(claims, tmp_path):
    with first_kernel(tmp_path) as world:
        ns = {"net": mlp(12, 16, 3, seed=7), "train": blobs(64, seed=0)}  # same structure, other weights
        world["gate"].touch()
        alone = [r["cluster_id"] for r in worlds.live()] == [world["cluster_id"]]  # else the shared cluster's too
        result = distnb.attach(None if alone else world["cluster_id"], model="net", ns=ns, quiet=True)  # waits
        s = sessions.current()
        assert result.epochs == list(range(EPOCHS))
        for rank in (0, 1):
            ranks = _rank_weights(s, rank)
            for k, v in ns["net"].state_dict().items():
                torch.testing.assert_close(v, ranks[k], atol=1e-6, rtol=0)
        s.run("_id = id(net)")
        before = s.pull("_id", rank=0)
        more = s.train("x, y = batch\nloss = torch.nn.functional.cross_entropy(model(x), y)", model="net",
                       data="train", epochs=2, batch_size=8, quiet=True)
        s.run("_id = id(net)")
        assert s.pull("_id", rank=0) == before  # the live model trained on: it was not sent again
        assert more.epochs == [EPOCHS, EPOCHS + 1]  # and its epochs go on
        for k, v in ns["net"].state_dict().items():
            torch.testing.assert_close(v, _rank_weights(s, 0)[k], atol=1e-6, rtol=0)
        rec = world["record_data"]
        s.stop(quiet=True)
        assert _gone(rec)


def test_attach_after_the_first_kernel_was_killed(tmp_path, monkeypatch):
    """The proof of issue 38 (needs the lease keeper of the lease branch): SIGKILL the first kernel during a
    background run; a new kernel attaches with --model and gets every step, none twice."""
    pytest.importorskip("distnb.cluster.lease")  # without it the first kernel's reaper ends the world with its kernel
    monkeypatch.setattr(sessions, "_CURRENT", None)
    with first_kernel(tmp_path) as world:
        deadline = time.monotonic() + 15.0  # the record notes the run from a thread, just after the cell started
        while not (worlds.read(world["record"]) or {}).get("run") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(world["proc"].pid, signal.SIGKILL)
        world["proc"].wait(10)
        world["gate"].touch()
        ns = {"net": mlp(12, 16, 3, seed=7), "train": blobs(64, seed=0)}
        result = distnb.attach(world["cluster_id"], model="net", ns=ns, quiet=True)
        s = sessions.current()
        assert result.epochs == list(range(EPOCHS))
        assert s.holdings.trained_steps["net"] == EPOCHS * STEPS_PER_EPOCH
        for k, v in ns["net"].state_dict().items():
            torch.testing.assert_close(v, _rank_weights(s, 1)[k], atol=1e-6, rtol=0)
        rec = world["record_data"]
        s.stop(quiet=True)
        assert _gone(rec)


def test_the_dist_attach_magic_lists_joins_waits_and_stops(claims, tmp_path, monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("DISTNB_ZYGOTE", "0")  # no engine template: this test starts no engines itself
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False  # as the shared shell of conftest.py (the same instance, if made)
    sh = InteractiveShell.instance(config=config)
    sh.run_line_magic("load_ext", "distnb")
    with first_kernel(tmp_path) as world:
        listing = sh.run_line_magic("dist", "attach")
        assert world["cluster_id"] in [r["world"] for r in listing.rows]
        assert sh.run_line_magic("dist", f"attach {world['cluster_id']}") is None
        assert sh.run_line_magic("dist", "status").title.count("busy training") == 1
        world["gate"].touch()
        result = sh.run_line_magic("dist", "wait")
        assert result.epochs == list(range(EPOCHS))
        sh.run_line_magic("dist", "stop")
        assert _gone(world["record_data"])
        assert sessions._CURRENT is None


def test_interrupting_the_wait_of_attach_model_takes_what_was_trained_so_far(claims, tmp_path):
    """The interrupt button while ``attach(model=...)`` waits stops the run after the same step on every rank, and
    the notebook's model gets what was trained so far, with the TrainResult (as ``%dist wait`` does in the kernel
    that started the run): before, the result was None and the model untouched."""
    import threading

    with first_kernel(tmp_path) as world:  # the gate stays closed: 0.3 s a step, about 12 s in all
        ns = {"net": mlp(12, 16, 3, seed=7)}
        untrained = {k: v.clone() for k, v in ns["net"].state_dict().items()}
        alone = [r["cluster_id"] for r in worlds.live()] == [world["cluster_id"]]
        timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            result = distnb.attach(None if alone else world["cluster_id"], model="net", ns=ns, quiet=True)
        finally:
            timer.cancel()
        s = sessions.current()
        assert result is not None and result.interrupted, result
        assert 0 < result.optimizer_steps < EPOCHS * STEPS_PER_EPOCH
        changed = any(not torch.equal(v, untrained[k]) for k, v in ns["net"].state_dict().items())
        assert changed, "the notebook's model did not get the weights trained so far"
        for rank in (0, 1):
            ranks = _rank_weights(s, rank)
            for k, v in ns["net"].state_dict().items():
                torch.testing.assert_close(v, ranks[k], atol=1e-6, rtol=0)
        rec = world["record_data"]
        s.stop(quiet=True)
        assert _gone(rec)
