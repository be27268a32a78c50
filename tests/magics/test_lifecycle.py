"""Start and stop a separate real cluster: processes, ports and the GPU/CPU defaults."""

import time

import psutil
import pytest

from distnb.cluster import Cluster
from distnb.defaults import default_spec
from distnb.net import visible_gpus
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


def test_a_killed_controller_leaves_no_scheduler_behind():
    """The controller's scheduler processes outlive a SIGKILLed controller; stop still ends them."""
    import os
    import signal

    cluster = Cluster(default_spec(n=2, timeout=20)).start()
    session = Session(cluster, ns={})
    family = list(cluster.family)
    assert len(family) > 3  # controller, its schedulers, engines
    os.kill(cluster.pids["controller"], signal.SIGKILL)
    session.stop(quiet=True)
    deadline = time.monotonic() + 15
    alive = family
    while alive and time.monotonic() < deadline:
        alive = [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert alive == []


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
