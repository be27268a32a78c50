"""``%dist start --launcher slurm`` on a real Slurm cluster (slurm.py): sbatch submits, srun starts the engines.

The cluster (session fixture ``slurm_cluster``) has slurmctld on one network-namespace host and a
slurmd on each of two others; the kernel (this process) submits from the machine's own namespace,
and the ipyparallel controller listens on the bridge address, the one toward slurmctld.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import psutil
import pytest

from distnb import session
from distnb.core.errors import ClusterError, PlanError, RankError

from .parity import train_and_check_parity

pytestmark = pytest.mark.timeout(240)

ALL_REDUCE = "import torch, torch.distributed as dist\n_t = torch.ones(1) * (rank + 1)\ndist.all_reduce(_t)"
START = dict(launcher="slurm", nodes=2, engines_per_node=1, timeout=20, quiet=True)


@pytest.fixture(scope="module")
def two_nodes(slurm_cluster, own_shell):
    """``%dist start --launcher slurm --nodes 2 --engines-per-node 1``; the running session."""
    own_shell.run_line_magic("dist", "start --launcher slurm --nodes 2 --engines-per-node 1 --timeout 20")
    assert session._CURRENT is not None
    yield session._CURRENT
    if session._CURRENT is not None:
        session._CURRENT.stop(quiet=True)


def _no_job_left(slurm_cluster, timeout=20.0):
    """squeue lists no job, and no process of a job (slurmstepd, engine) is left on any node."""
    assert slurm_cluster.jobs() == [], slurm_cluster.squeue_cmd("squeue").stdout
    deadline = time.monotonic() + timeout
    while True:
        left = slurm_cluster.job_processes()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"left on the nodes: {left}"


def test_srun_starts_one_engine_per_node_ranked_by_slurm(slurm_cluster, two_nodes):
    cluster = two_nodes.cluster
    job = cluster.job_id
    assert job and slurm_cluster.jobs() == [job]
    line = slurm_cluster.squeue_cmd("squeue", "-h", "-j", job, "-o", "%T %D %N").stdout.split()
    assert line[:2] == ["RUNNING", "2"]
    table = two_nodes.status()
    assert f"slurm job {job} · " in table.title and table.job_id == job
    assert [r["alive"] for r in table.rows] == [True, True]
    assert [r["host"] for r in table.rows] == slurm_cluster.nodes  # each engine on its own node, in srun order
    assert [(r["node_rank"], r["local_rank"]) for r in table.rows] == [(0, 0), (1, 0)]
    two_nodes.run("import os\n_slurm = [os.environ[k] for k in ('SLURM_JOB_ID', 'SLURM_PROCID', 'SLURM_LOCALID', "
                  "'SLURMD_NODENAME')]")
    assert two_nodes.pull("_slurm") == [[job, "0", "0", slurm_cluster.nodes[0]], [job, "1", "0",
                                                                                slurm_cluster.nodes[1]]]
    # the controller listens on the bridge (this machine's address toward slurmctld) only
    listening = {c.laddr.ip for c in psutil.Process(cluster.pids["controller"]).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert listening == {slurm_cluster.hosts.bridge_address}
    assert table.store.startswith(slurm_cluster.hosts.addresses[1] + ":")  # rank 0's node
    # the job script is in the cluster's profile folder, not left in the notebook's working directory
    assert os.path.exists(os.path.join(cluster._ipp.profile_dir, f"slurm_engine-{cluster._ipp.cluster_id}.sbatch"))
    assert not os.path.exists("slurm_engine.sbatch")


def test_training_on_slurm_nodes_matches_one_process(own_shell, two_nodes):
    train_and_check_parity(own_shell.user_ns, two_nodes, "slurm")


def test_scale_says_a_jobs_allocation_is_fixed_and_what_to_do(own_shell, two_nodes):
    err = own_shell.run_cell("%dist scale 3").error_in_exec
    assert err is not None and "one slurm batch job" in str(err) and "allocation" in str(err), err
    assert "%dist restart -n 3" in str(err) and "may queue" in str(err), err
    assert two_nodes.world_size == 2 and two_nodes.run("world_size", all_output=True) == ["2", "2"]


def test_stop_cancels_the_job(slurm_cluster, own_shell, two_nodes):
    job = two_nodes.cluster.job_id
    own_shell.run_line_magic("dist", "stop")
    assert session._CURRENT is None
    _no_job_left(slurm_cluster)
    state = slurm_cluster.squeue_cmd("scontrol", "-o", "show", "job", job).stdout
    assert "JobState=CANCELLED" in state, state


def test_node_down_during_a_cell_is_named(slurm_cluster, own_shell):
    sess = session.start(**START)
    sess.run(ALL_REDUCE)
    node = slurm_cluster.nodes[1]
    timer = threading.Timer(2.0, slurm_cluster.set_node, (node, "DOWN"))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(RankError) as info:
            sess.run("import time, torch, torch.distributed as dist\nfor _ in range(600):\n"
                     "    _t = torch.ones(1)\n    dist.all_reduce(_t)\n    time.sleep(0.1)\n")
        took = time.monotonic() - t0
        text = str(info.value)
        print(f"node down after {took:.1f} s: {text}")
        assert f"node {node} is down" in text and "heartbeat" in text, text
        assert took < sess.cluster.spec.timeout + 30, took
        t0 = time.monotonic()
        sess.stop(quiet=True)
        assert time.monotonic() - t0 < 30
        _no_job_left(slurm_cluster)
    finally:
        timer.cancel()
        if session._CURRENT is not None:
            session._CURRENT.stop(quiet=True)
        slurm_cluster.set_node(node, "RESUME")
        slurm_cluster.wait_idle()


def _interrupt_once_pending(slurm_cluster, delay):
    """SIGINT this process ``delay`` s after squeue first lists a pending job (as the interrupt button does)."""
    def wait_then_interrupt():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if slurm_cluster.squeue_cmd("squeue", "-h", "-t", "PD", "-o", "%i").stdout.strip():
                time.sleep(delay)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=wait_then_interrupt, daemon=True)
    thread.start()
    return thread


def test_pending_job_is_reported_and_interrupt_cancels_it(slurm_cluster, own_shell, capsys):
    thread = _interrupt_once_pending(slurm_cluster, 3.0)
    with pytest.raises(KeyboardInterrupt):
        own_shell.run_line_magic("dist", "start --launcher slurm --nodes 2 --engines-per-node 1 --partition down")
    thread.join(timeout=10)
    out = capsys.readouterr().out
    assert "pending: PartitionDown (the partition is down); waiting (interrupt to cancel it)" in out, out
    assert session._CURRENT is None
    _no_job_left(slurm_cluster)


def test_job_killed_at_its_time_limit_is_reported(slurm_cluster, own_shell):
    sess = session.start(time_limit="1", **START)
    try:
        job = sess.cluster.job_id
        assert slurm_cluster.squeue_cmd("squeue", "-h", "-j", job, "-o", "%l").stdout.strip() == "1:00"
        with pytest.raises(RankError) as info:  # Slurm checks limits every 30 s: killed 60 to 90 s in
            sess.run("import time\nfor _ in range(1500):\n    time.sleep(0.1)\n")
        text = str(info.value)
        print(f"time limit: {text}")
        assert f"Slurm job {job} reached its time limit (--time 1) and was killed" in text, text
    finally:
        if session._CURRENT is not None:
            session._CURRENT.stop(quiet=True)
    _no_job_left(slurm_cluster)


@pytest.mark.parametrize("given, match", [
    (dict(queue="nope"), r"--partition nope: Slurm has no such partition \(it has: debug, down\)"),
    (dict(nodes=3), r"--nodes 3 x --engines-per-node 1 is more than Slurm can give \(partition debug has 2 nodes"),
    (dict(time_limit="soon"), r"--time soon: sbatch refused it \(Invalid --time specification\)"),  # sbatch's own
])
def test_bad_request_is_refused_naming_the_option(slurm_cluster, own_shell, given, match):
    with pytest.raises(ClusterError, match=match):
        session.start(**{**START, **given})
    assert session._CURRENT is None
    _no_job_left(slurm_cluster)


def test_sbatch_missing_is_named(slurm_cluster, own_shell, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PlanError, match="--launcher slurm needs sbatch on PATH"):
        session.start(**START)
    monkeypatch.undo()
    _no_job_left(slurm_cluster)


def test_slurmctld_unreachable_is_named(slurm_cluster, own_shell, monkeypatch, tmp_path):
    conf = tmp_path / "slurm.conf"  # the same cluster, but a port slurmctld does not listen on
    text = open(slurm_cluster.conf).read()
    conf.write_text(text + "SlurmctldPort=6899\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="could not reach slurmctld, the Slurm controller"):
        session.start(**START)
    assert time.monotonic() - t0 < 60
    monkeypatch.undo()
    assert session._CURRENT is None
    _no_job_left(slurm_cluster)
    assert shutil.which("sbatch")
