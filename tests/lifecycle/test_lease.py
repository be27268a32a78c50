"""The lease (issue 38): a run outlives its killed kernel, then the world waits, saves and ends.

Real kernels (jupyter_client's KernelManager, distnb loaded by %load_ext), a real 2-rank
world in each, killed with SIGKILL; the reference run is the shared 2-rank cluster's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from distnb.cluster import lease
from support import lease_world as lw

EPOCHS = 12
LINGER = 10  # test_a's --linger, in seconds: its check that the lease counts from the run's end needs 5 s of it


@pytest.fixture
def kernel(tmp_path):
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="python3")  # ipykernel's own spec: this interpreter; distnb by %load_ext
    km.start_kernel(cwd=str(tmp_path), env=dict(os.environ))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def _kill(km) -> None:
    os.kill(km.provisioner.process.pid, signal.SIGKILL)


def test_a_killed_kernel_s_run_finishes_then_the_lease_saves_it_and_everything_ends(kernel, shell, tmp_path):
    km, kc = kernel
    info, said = lw.start_world(kc, f"{LINGER}s", epochs=EPOCHS, sleep=0.04)  # about 8 s of training
    assert info["folder"] in said and info["folder"].startswith(str(tmp_path))  # the start line names it
    _kill(km)
    killed = time.monotonic()
    record = lw.wait_state(info["cluster_id"], ("training",), 15)  # the ranks still train: the keeper waits
    record = lw.wait_state(info["cluster_id"], ("lingering",), 60)
    # the lease counts from the run's end (counted from the kill, it would have about LINGER - 8 s left here)
    assert record["expires"] - time.time() > LINGER - 5
    record = lw.wait_state(info["cluster_id"], ("ended",), 60)
    assert time.monotonic() - killed > LINGER
    assert record["error"] is None and len(record["saved"]) == 1, record
    saved = record["saved"][0]
    assert saved["model"] == "net" and os.path.dirname(saved["path"]) == info["folder"]
    lw.assert_all_gone(info)
    got, meta, torch = lw.load_checkpoint(saved["path"])
    # no step lost, none twice: every step of the cell, and the weights of the uninterrupted run
    assert meta["steps"] == EPOCHS * lw.STEPS_PER_EPOCH and meta["epoch"] == EPOCHS, meta
    want = lw.trained_reference(shell, EPOCHS)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
    with pytest.raises(Exception, match="expired"):
        lease.claim(info["cluster_id"], os.getpid(), timeout=2)


def test_a2_a_foreground_cell_s_run_outlives_its_killed_kernel_too(kernel, tmp_path):
    km, kc = kernel
    info, _ = lw.start_world(kc, "1s")
    ckpt = tmp_path / "ckpt"  # the cell's --checkpoint-dir: the lease saves there, not in the default folder
    kc.execute(f"%%distrain {lw.OPTIONS.format(epochs=6)} --checkpoint-dir {ckpt}\n{lw.BODY.format(sleep=0.05)}")
    lw.wait_state(info["cluster_id"], ("watching",), 5)
    time.sleep(4)  # the model sent, steps under way (6 epochs take about 5 s more)
    _kill(km)
    lw.wait_state(info["cluster_id"], ("training",), 15)
    record = lw.wait_state(info["cluster_id"], ("ended",), 60)
    assert record["error"] is None and [s["model"] for s in record["saved"]] == ["net"], record
    assert os.path.dirname(record["saved"][0]["path"]) == str(ckpt)
    assert record["saved"][0]["steps"] == 6 * lw.STEPS_PER_EPOCH
    lw.assert_all_gone(info)


def test_b_no_training_running_everything_ends_within_seconds(kernel):
    km, kc = kernel
    info, _ = lw.start_world(kc, "10m")
    _kill(km)
    lw.assert_all_gone(info, timeout=10)
    assert lease.read_keeper(info["cluster_id"]) is None  # nothing saved: nothing kept


def test_c_linger_0_ends_a_running_training_with_its_kernel(kernel):
    km, kc = kernel
    info, said = lw.start_world(kc, "0", epochs=50, sleep=0.05)
    assert "--linger 0" in said
    _kill(km)
    lw.assert_all_gone(info, timeout=10)


def test_d_a_claim_keeps_the_world_while_its_claimer_lives(kernel):
    km, kc = kernel
    info, _ = lw.start_world(kc, "2s", epochs=2, sleep=0.0)
    claimer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\nfrom distnb.cluster import lease\nlease.claim(sys.argv[1], os.getpid())\n"
        "print('claimed', flush=True)\ntime.sleep(600)"), info["cluster_id"]], stdout=subprocess.PIPE, text=True)
    try:
        assert claimer.stdout.readline().strip() == "claimed"
        _kill(km)
        time.sleep(8)  # past the run's end and the 2 s lease
        record = lease.read_keeper(info["cluster_id"])
        assert record["state"] == "watching" and record["owner"] == claimer.pid, record
        assert lw.alive(info["family"]) == info["family"], "the world must live while its claimer does"
    finally:
        claimer.kill()
        claimer.wait()
    lw.assert_all_gone(info, timeout=15)  # its owner gone, nothing running: it ends as today
