"""Start and stop a separate real cluster: processes, ports and the GPU/CPU defaults."""

import time

import psutil
import pytest

from distnb.cluster import Cluster, default_spec, visible_gpus
from distnb.session import Session


def test_stop_leaves_no_process_behind():
    cluster = Cluster(default_spec(n=2, timeout=20)).start()
    session = Session(cluster, ns={})
    pids = cluster.pids
    procs = [psutil.Process(p) for p in pids["engines"] + [pids["controller"]]]
    assert all(p.is_running() for p in procs) and len(procs) == 3
    session.run("import torch\nx = torch.ones(1)\nimport torch.distributed as dist\ndist.all_reduce(x)")
    session.stop(quiet=True)
    deadline = time.monotonic() + 15
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert not session.running
    with pytest.raises(Exception, match="stopped"):
        session.run("1")


def test_cpu_default_is_one_engine_per_core(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec = default_spec()
    cores = len(psutil.Process().cpu_affinity())
    assert spec.device_type == "cpu" and spec.backend == "gloo" and spec.num_engines == cores
    assert spec.num_engines * spec.num_threads <= cores


def test_gpu_count_comes_from_the_environment_without_cuda(monkeypatch):
    # No second GPU exists here: the visible-device list stands in for one.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == ["3", "5"]
    spec = default_spec()
    assert (spec.device_type, spec.backend, spec.num_engines) == ("cuda", "nccl", 2)
    with pytest.raises(Exception, match="more GPU engines"):
        default_spec(n=3)
    import sys

    if "torch" in sys.modules:
        import torch

        assert not torch.cuda.is_initialized()


def test_a_dead_engine_is_named_and_restart_recovers():
    import signal

    from distnb.errors import ClusterError, RankError

    cluster = Cluster(default_spec(n=2, timeout=20)).start()
    session = Session(cluster, ns={})
    try:
        victim = cluster.ranks[1]["pid"]
        t0 = time.monotonic()
        with pytest.raises(RankError, match="rank 1's engine .* has exited.*%dist restart"):
            session.run(f"import os, time\nif rank == 1:\n    os.kill({victim}, {int(signal.SIGKILL)})\n"
                        "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)")
        assert time.monotonic() - t0 < 10
        table = session.status()
        assert [r["alive"] for r in table] == [True, False]
        with pytest.raises(ClusterError, match="rank 1's engine"):
            session.run("1")
        cluster.stop()
        session = Session(Cluster(cluster.spec).start(), ns={})
        assert session.run("rank", all_output=True) == ["0", "1"]
    finally:
        session.stop(quiet=True)
        cluster.stop()
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
