"""The engine template (distnb.zygote): CPU engines (and their controller) forked with their imports done,
behaving as fresh ones.

Each test starts its own small cluster (the shared one is left alone) with the kernel's one template.
"""

import os
import signal

import psutil
import pytest

from distnb import zygote
from distnb.cluster import Cluster, default_spec
from distnb.session import Session

PROBE = """
import os, sys, numpy, torch
probe = dict(pid=os.getpid(), ppid=os.getppid(), mark=os.environ.get("DISTNB_TEST_MARK"),
             omp=os.environ.get("OMP_NUM_THREADS"), threads=torch.get_num_threads(), cwd=os.getcwd(),
             numpy_draw=float(numpy.random.random()), dynamo="torch._dynamo" in sys.modules,
             setsid=os.getsid(0) == os.getpid())
"""


def _start(n=2):
    session = Session(Cluster(default_spec(n=n, timeout=30)).start(), ns={})
    session.run(PROBE)
    return session, [session.pull("probe", rank=r) for r in range(n)]


def test_engines_are_forked_from_the_template_and_get_their_own_environment(monkeypatch):
    template = zygote.get()
    assert template is not None and template.ready(0)
    monkeypatch.setenv("DISTNB_TEST_MARK", "set after the template started")
    session, probes = _start(2)
    try:
        for p in probes:
            assert p["ppid"] == template.pid  # forked, not started
            assert p["mark"] == "set after the template started"  # the kernel's environment now, not the template's
            assert p["omp"] == "1" and p["threads"] == 1  # the cluster's thread count, per engine
            assert p["dynamo"]  # DDP's import is done before the first cell
            assert p["setsid"]  # its own session: a Ctrl-C to the kernel's process group does not reach it
            assert p["cwd"] == os.getcwd()
            cmd = " ".join(psutil.Process(p["pid"]).cmdline())
            assert "distnb.engine.ipengine" in cmd and "--zygote" not in cmd  # ps shows an engine
        assert probes[0]["numpy_draw"] != probes[1]["numpy_draw"]  # each engine seeds numpy afresh
        controller = psutil.Process(session.cluster.pids["controller"])
        assert controller.ppid() == template.pid and "ipyparallel.controller" in " ".join(controller.cmdline())
        session.run("import torch, torch.distributed as dist\nt = torch.ones(1) * (dist.get_rank() + 1)\n"
                    "dist.all_reduce(t)")
        assert float(session.pull("t", rank=1)) == 3.0
    finally:
        session.stop(quiet=True)


def test_a_forked_engine_uses_several_threads_and_reports_how_it_died():
    """One engine with both cores (OpenMP's pool is made after the fork), then SIGKILLed: the template's status."""
    cores = len(psutil.Process().cpu_affinity())
    session, (p,) = _start(1)
    try:
        assert p["threads"] == cores
        session.run("import torch\nx = torch.randn(512, 512)\ny = (x @ x).sum().item()")  # a parallel op, no hang
        os.kill(p["pid"], signal.SIGKILL)
        cluster = session.cluster
        assert cluster.exit_status(0, wait=5.0) == -signal.SIGKILL
        assert "SIGKILL" in cluster.dead_ranks()[0]
    finally:
        session.stop(quiet=True)


@pytest.mark.parametrize("how", ["DISTNB_ZYGOTE=0", "PYTHONPATH differs"])
def test_engines_start_fresh_when_the_template_cannot_stand_in(monkeypatch, how):
    if how == "DISTNB_ZYGOTE=0":
        monkeypatch.setenv("DISTNB_ZYGOTE", "0")
    else:  # read at interpreter start: a fork cannot give it to the engine
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), "/nonexistent"])))
    session, probes = _start(2)
    try:
        assert all(p["ppid"] == os.getpid() for p in probes)  # started by the kernel's launcher
        assert psutil.Process(session.cluster.pids["controller"]).ppid() == os.getpid()
        session.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)")
        assert float(session.pull("t", rank=0)) == 2.0
    finally:
        session.stop(quiet=True)


def test_a_dead_template_is_replaced():
    old = zygote.get()
    old.proc.kill()
    old.proc.wait()
    session, probes = _start(2)
    try:
        new = zygote.get(0)
        assert new is not None and new.pid != old.pid
        assert all(p["ppid"] == new.pid for p in probes)
    finally:
        session.stop(quiet=True)
