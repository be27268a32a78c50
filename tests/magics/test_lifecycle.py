"""Start and stop a separate real cluster: no process or file is left behind (the GPU/CPU defaults: tests/unit)."""

import os
import time

import psutil
import pytest

from distnb.cluster.cluster import Cluster
from distnb.cluster.defaults import default_spec
from distnb.session import Session


def test_stop_leaves_no_process_behind():
    cluster = Cluster(default_spec(n=2, timeout=20)).start()
    session = Session(cluster, ns={})
    pids = cluster.pids
    ipp = cluster._ipp
    files = [ipp.cluster_file, os.path.join(ipp.profile_dir, "log", f"engines{ipp.cluster_id}.json")]
    assert all(os.path.exists(f) for f in files), files  # the cluster file; the controller's engine state
    procs = [psutil.Process(p) for p in pids["engines"] + [pids["controller"]]]
    assert all(p.is_running() for p in procs) and len(procs) == 3
    session.run("import torch\nx = torch.ones(1)\nimport torch.distributed as dist\ndist.all_reduce(x)")
    session.stop(quiet=True)
    deadline = time.monotonic() + 15
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert [f for f in files if os.path.exists(f)] == []  # ipyparallel leaves the engine state file behind
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




def test_a_start_that_fails_while_the_controller_starts_leaves_none_of_its_processes(monkeypatch):
    """Engines that fail to start (sbatch refusing the job, say) while the controller is still coming up: the
    stop began before the controller had forked its schedulers, so they were no child of it then; the
    controller then died (here: killed), and they lived on as orphans. Its process group still names them."""
    import os
    import signal

    from distnb.cluster import launchers
    from distnb.core.errors import ClusterError

    group = {}

    def engines_fail(self, n):
        controller = psutil.Process(self.parent.controller.pid)
        deadline = time.monotonic() + 20
        while not controller.children() and time.monotonic() < deadline:  # its schedulers are forked
            time.sleep(0.05)
        group["pid"], group["children"] = controller.pid, controller.children(recursive=True)
        assert group["children"], "the controller forked no scheduler within 20 s"
        os.kill(controller.pid, signal.SIGKILL)  # dies while starting: nobody ends its schedulers
        while any(c.is_running() and c.ppid() == controller.pid for c in group["children"]):
            time.sleep(0.02)  # orphaned (reparented) before the stop begins, as when they came after its start
        raise RuntimeError("the batch system refused the engines' job")

    monkeypatch.setattr(launchers._EngineSetLauncher, "start", engines_fail)
    with pytest.raises(ClusterError, match="refused the engines' job"):
        Cluster(default_spec(n=2, timeout=20)).start()
    deadline = time.monotonic() + 10
    alive = group["children"]
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert alive == [] and launchers.controller_group(group["pid"]) == []


def test_an_interrupt_during_stop_still_leaves_no_process_behind(monkeypatch):
    """Ctrl-C landing in %dist stop (here: in its wait for the engines to leave) ends the stop early, but the
    controller and the engines still go (a fresh user's find: the controller lived until the kernel exited)."""
    from distnb.cluster import cluster as cluster_mod

    cluster = Cluster(default_spec(n=2, timeout=20)).start()
    procs = [psutil.Process(p) for p in cluster.family]

    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(cluster_mod.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cluster.stop()
    monkeypatch.undo()
    deadline = time.monotonic() + 15
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert alive == []
