"""The engine template (distnb.cluster.zygote): CPU engines (and their controller) forked with their imports done,
behaving as fresh ones.

Each test starts its own small cluster (the shared one is left alone) with the kernel's one template.
"""

import os
import signal

import psutil
import pytest

from distnb.cluster import zygote
from distnb.cluster.cluster import Cluster
from distnb.cluster.defaults import default_spec
from distnb.session import Session

PROBE = """
import os, sys, tempfile, numpy, torch
probe = dict(pid=os.getpid(), ppid=os.getppid(), mark=os.environ.get("DISTNB_TEST_MARK"),
             omp=os.environ.get("OMP_NUM_THREADS"), threads=torch.get_num_threads(), cwd=os.getcwd(),
             numpy_draw=float(numpy.random.random()), torch_seed=torch.initial_seed(),
             tmp=tempfile.gettempdir(), dynamo="torch._dynamo" in sys.modules, setsid=os.getsid(0) == os.getpid())
"""


def _start(n=2):
    session = Session(Cluster(default_spec(n=n, timeout=30)).start(), ns={})
    session.run(PROBE)
    return session, [session.pull("probe", rank=r) for r in range(n)]


def test_engines_are_forked_from_the_template_and_get_their_own_environment(monkeypatch, tmp_path):
    template = zygote.get()
    assert template is not None and template.ready(0)
    monkeypatch.setenv("DISTNB_TEST_MARK", "set after the template started")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # read once by tempfile: read again by each engine
    monkeypatch.chdir(tmp_path)  # the kernel's directory at %dist start, not when the template started
    session, probes = _start(2)
    try:
        for p in probes:
            assert p["ppid"] == template.pid  # forked, not started
            assert p["mark"] == "set after the template started"  # the kernel's environment now, not the template's
            assert p["omp"] == "1" and p["threads"] == 1  # the cluster's thread count, per engine
            assert p["dynamo"]  # DDP's import is done before the first cell
            assert p["setsid"]  # its own session: a Ctrl-C to the kernel's process group does not reach it
            assert p["cwd"] == str(tmp_path) and p["tmp"] == str(tmp_path)
            cmd = " ".join(psutil.Process(p["pid"]).cmdline())
            assert "distnb.engine.ipengine" in cmd and "--zygote" not in cmd  # ps shows an engine
        assert probes[0]["numpy_draw"] != probes[1]["numpy_draw"]  # each engine seeds numpy and torch afresh
        assert probes[0]["torch_seed"] != probes[1]["torch_seed"]
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


@pytest.mark.parametrize("how", ["DISTNB_ZYGOTE=0", "PYTHONPATH differs", "TORCH_LOGS differs"])
def test_engines_start_fresh_when_the_template_cannot_stand_in(monkeypatch, how):
    if how == "DISTNB_ZYGOTE=0":
        monkeypatch.setenv("DISTNB_ZYGOTE", "0")
    elif how == "PYTHONPATH differs":  # read at interpreter start: a fork cannot give it to the engine
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), "/nonexistent"])))
    else:  # read when torch is imported
        monkeypatch.setenv("TORCH_LOGS", "+dynamo")
    session, probes = _start(2)
    try:
        assert all(p["ppid"] == os.getpid() for p in probes)  # started by the kernel's launcher
        if how != "DISTNB_ZYGOTE=0":  # the start says why
            assert ("PYTHONPATH" if how == "PYTHONPATH differs" else "TORCH_LOGS") in session.cluster.note
        assert psutil.Process(session.cluster.pids["controller"]).ppid() == os.getpid()
        session.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)")
        assert float(session.pull("t", rank=0)) == 2.0
    finally:
        session.stop(quiet=True)


def test_variables_torch_sets_itself_do_not_stop_the_fork(monkeypatch):
    """torch sets TORCHINDUCTOR_CACHE_DIR when imported: in the template, and in a kernel that imported it.

    A template of its own, started without the variable: the session's template may have inherited it from this
    process, where an earlier test's torch import set it (then it is not torch's doing in the template)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    template = zygote.Zygote(env=env)
    try:
        assert template.ready()
        set_by_import = template.info["frozen_env_after"].get("TORCHINDUCTOR_CACHE_DIR")
        assert set_by_import  # torch 2.13 sets it while the template imports
        assert template.matches({**env, "TORCHINDUCTOR_CACHE_DIR": set_by_import})
        assert template.matches(env)
        assert template.mismatched({**env, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}) == ["TORCHINDUCTOR_CACHE_DIR"]
    finally:
        template.close()


def test_a_dead_template_is_replaced():
    import time

    old = zygote.get()
    os.kill(old.pid, signal.SIGKILL)  # from outside: nobody here has waited for it
    while old.alive():
        time.sleep(0.05)
    session, probes = _start(2)
    try:
        new = zygote.get(0)
        assert new is not None and new.pid != old.pid
        assert not psutil.pid_exists(old.pid) or psutil.Process(old.pid).status() != psutil.STATUS_ZOMBIE
        assert all(p["ppid"] == new.pid for p in probes)
    finally:
        session.stop(quiet=True)


def test_engines_outlive_a_dead_template_and_still_stop_promptly():
    """Killing the template leaves its engines running (orphans); a death is still reported, stop is prompt."""
    import time

    session, probes = _start(2)
    try:
        old = zygote.get(0)
        old.proc.kill()
        old.proc.wait()
        session.run("import torch.distributed as dist\nimport torch\nt = torch.ones(1)\ndist.all_reduce(t)")
        assert float(session.pull("t", rank=0)) == 2.0
        os.kill(probes[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while 1 not in session.cluster.dead_ranks() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 1 in session.cluster.dead_ranks()  # its status is lost with the template ("status unknown")
    finally:
        t0 = time.monotonic()
        session.stop(quiet=True)
        assert time.monotonic() - t0 < 5.0  # a zombie nobody reaps counts as ended, not waited for


def test_a_cluster_whose_template_died_still_grows():
    """%dist scale after the template died (killed, out of memory): the added engine starts as a fresh process,
    or from the kernel's new template once it is ready; never from the dead one."""
    session, probes = _start(2)
    try:
        old = zygote.get(0)
        old.proc.kill()
        old.proc.wait()
        session.scale(3, quiet=True)
        assert session.world_size == 3
        session.run("import os, torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                    "ppid = os.getppid()")
        assert [float(session.pull("t", rank=r)) for r in range(3)] == [3.0] * 3
        assert session.pull("ppid", rank=2) != old.pid
    finally:
        session.stop(quiet=True)
