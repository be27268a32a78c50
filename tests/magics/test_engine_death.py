"""An engine process dies during a cell (issue 4, behaviour 3), on the shared real 2-rank cluster.

The cell ends within 10 s with an error naming the rank, its engine and pid, and how the
process ended (the signal, or the exit status); ``%dist restart`` then brings back a world
of full size with a fresh process group.
"""

import time

import psutil
import pytest

from distnb import session as session_mod
from distnb.core.errors import ClusterError, RankError

SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
g = torch.Generator().manual_seed(0)
X = torch.randn(400, 8, generator=g)
Y = (X[:, 0] > 0).long()
death_ds = torch.utils.data.TensorDataset(X, Y)
torch.manual_seed(0)
death_net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
"""


CELL = "%%distrain --model death_net --data death_ds --epochs 1 --batch-size 8\nx, y = batch\nloss = F.cross_entropy(model(x), y)"


def run(shell, code):
    return shell.run_cell(code, silent=False)


def _gone(pid):
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _restart_and_check(shell, old_pids, capsys):
    """%dist restart: a world of full size, fresh engines, a first-generation process group that works."""
    assert run(shell, "%dist restart").error_in_exec is None
    _check_fresh_world(shell, old_pids, capsys)


def _check_fresh_world(shell, old_pids, capsys):
    new = session_mod.current()
    assert new.world_size == 2
    table = run(shell, "%dist status").result
    assert [r["alive"] for r in table] == [True, True]
    assert set(r["pid"] for r in table).isdisjoint(old_pids)
    assert [r["generation"] for r in table] == [1, 1]  # a fresh process group, not a re-formed one
    capsys.readouterr()
    res = run(shell, "%%dist --all-output\nimport torch, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\n"
                     "dist.all_reduce(t)\nprint('sum', t.item())")
    assert res.error_in_exec is None, res.error_in_exec
    assert capsys.readouterr().out.count("[ranks 0-1] sum 3.0") == 1  # printed by both ranks: shown once
    assert all(_gone(p) for p in old_pids)


def test_sigkill_during_training_names_rank_and_signal_then_restart(shell, tmp_path, capsys):
    assert run(shell, SETUP).error_in_exec is None
    shell.user_ns["KILL_MARK"] = str(tmp_path / "killed-at")
    cluster = session_mod.current().cluster
    pid, eid = cluster.ranks[1]["pid"], cluster.engine_ids[1]
    old_pids = [r["pid"] for r in cluster.ranks]
    res = run(shell, "%%distrain --model death_net --data death_ds --epochs 200 --batch-size 8 --progress none\n"
                     "x, y = batch\n"
                     "if rank == 1 and ctx.step == 5:\n"
                     "    import os, signal, time\n"
                     "    open(KILL_MARK, 'w').write(repr(time.time()))\n"
                     "    time.sleep(0.3)\n"  # time to send what it reported (a SIGKILL loses what is still queued)
                     "    os.kill(os.getpid(), signal.SIGKILL)\n"
                     "loss = F.cross_entropy(model(x), y)")
    ended = time.time()
    err = res.error_in_exec
    assert isinstance(err, RankError), err
    killed_at = float((tmp_path / "killed-at").read_text())
    assert ended - killed_at < 10, f"the cell ended {ended - killed_at:.1f} s after the kill"
    assert err.rank == 1 and err.ename == "EngineDied"
    assert f"rank 1 (engine {eid}, pid {pid}) died: killed by SIGKILL" in str(err)
    # a dead rank's position is its last progress message, and said to be: with --progress none (a message an
    # hour, and at epoch ends) that is the cell's start, though it died in step 5
    assert str(err).startswith(f"training failed on rank 1 on {err.host}, last reported at epoch 0, step 0: "
                               "EngineDied"), err
    assert (err.failures[0]["epoch"], err.failures[0]["step"], err.failures[0]["reported"]) == (0, 0, True)
    assert "%dist restart" in str(err)
    # the world is not silently smaller: status shows the dead rank, cells say what to do
    assert [r["alive"] for r in run(shell, "%dist status").result] == [True, False]
    t0 = time.monotonic()
    nxt = run(shell, "%%dist\n1")
    assert isinstance(nxt.error_in_exec, ClusterError) and "killed by SIGKILL" in str(nxt.error_in_exec)
    assert time.monotonic() - t0 < 5
    _restart_and_check(shell, old_pids, capsys)


def test_exit_in_a_collective_names_the_status_and_auto_restart_brings_back_a_full_world(shell, capsys):
    capsys.readouterr()
    assert run(shell, "%dist start --auto-restart").error_in_exec is None
    assert "automatic restart after an engine death is now on" in capsys.readouterr().out
    session = session_mod.current()
    pid = session.cluster.ranks[1]["pid"]
    old_pids = [r["pid"] for r in session.cluster.ranks]
    try:
        t0 = time.monotonic()
        res = run(shell, "%%dist\nimport os, torch, torch.distributed as dist\nif rank == 1:\n    os._exit(3)\n"
                         "t = torch.ones(1)\ndist.all_reduce(t)  # rank 0 waits here for a peer that is gone")
        err = res.error_in_exec
        assert isinstance(err, RankError) and err.rank == 1, err
        assert f"pid {pid}) died: exited with status 3" in str(err)
        assert err.ranks == [1, 0] and "rank 0 was stopped as a consequence" in str(err)  # rank 0: not a second cause
        assert "fresh world of 2 ranks (auto restart)" in str(err)
        assert time.monotonic() - t0 < 10 + 15  # the death within 10 s, then a cluster start
        assert session_mod.current() is session  # the same session object, a new world
        _check_fresh_world(shell, old_pids, capsys)
    finally:
        run(shell, "%dist start --no-auto-restart")
    assert session_mod.current().auto_restart is False


def test_auto_restart_keeps_the_steps_every_rank_completed(shell, capsys):
    """--on-failure restart started the fresh world before rank 0 handed its weights back: the notebook kept the
    weights from before the cell, and the 6 steps trained were lost without a word."""
    assert run(shell, SETUP).error_in_exec is None
    assert run(shell, "%dist start --on-failure restart").error_in_exec is None
    try:
        run(shell, "import copy\nauto_net = copy.deepcopy(death_net)\nauto_before = copy.deepcopy(auto_net)")
        err = run(shell, "%%distrain --model auto_net --data death_ds --epochs 1 --batch-size 8 --optimizer adam "
                         "--progress none\nx, y = batch\nif rank == 1 and ctx.step == 6:\n    import os\n"
                         "    os._exit(4)\nloss = F.cross_entropy(model(x), y)").error_in_exec
        assert isinstance(err, RankError) and "fresh world of 2 ranks (auto restart)" in str(err), err
        moved = run(shell, "max((a - b).abs().max().item() for a, b in zip(auto_net.parameters(), "
                           "auto_before.parameters()))").result
        assert moved > 1e-4, moved  # rank 0's weights after the steps every rank completed
        assert [r["alive"] for r in run(shell, "%dist status").result] == [True, True]
        assert run(shell, CELL.replace("death_net", "auto_net")).error_in_exec is None  # goes on from them
    finally:
        run(shell, "%dist start --on-failure stop")


def test_status_says_how_a_dead_rank_died_and_the_fix(shell, capsys):
    """Between cells: the dead rank's row says how its engine ended (``died``), the title names it and the fix."""
    from distnb.train.results import StatusTable

    assert run(shell, SETUP).error_in_exec is None
    assert run(shell, CELL).error_in_exec is None
    cluster = session_mod.current().cluster
    pid = cluster.ranks[1]["pid"]
    old_pids = [r["pid"] for r in cluster.ranks]
    psutil.Process(pid).kill()  # SIGKILL, from outside the engine
    deadline = time.monotonic() + 10
    while 1 not in cluster.dead_ranks():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    table = run(shell, "%dist status").result
    assert [r["alive"] for r in table] == [True, False]  # the keys stay; died is added
    assert table[0]["died"] is None and table[1]["died"].startswith("killed by SIGKILL")
    assert table.columns == StatusTable.columns + ("died",)
    assert f"rank 1 died (its engine process, pid {pid}): killed by SIGKILL" in table.title
    assert "Run %dist restart -n 2 (session.restart(n=2)) for a fresh world of 2 ranks" in table.title
    assert "%dist scale 1 (session.scale(1)) to go on without it" in table.title
    last_row = table.text().splitlines()[-1 - len(table.notes)]  # the notes (carried settings) follow the rows
    assert "killed by SIGKILL" in last_row and "<th>died</th>" in table._repr_html_()
    capsys.readouterr()
    nxt = run(shell, CELL.replace("--batch-size 8", "--batch-size 16"))  # a new layout: said when a cell starts
    assert isinstance(nxt.error_in_exec, ClusterError) and "killed by SIGKILL" in str(nxt.error_in_exec)
    assert "distnb:" not in capsys.readouterr().out  # nothing of the cell's model or data before the dead rank
    _restart_and_check(shell, old_pids, capsys)
    table = run(shell, "%dist status").result
    assert "died" not in table.columns and "died" not in table.title and [r["died"] for r in table] == [None, None]


def test_status_shows_an_engine_that_runs_but_is_no_longer_registered(shell, capsys):
    """A stopped engine misses the controller's heartbeats and is unregistered; its process still runs. The table
    shows it (alive, not registered) and the fix instead of failing with the ClusterError of a call to it."""
    import signal

    from distnb.train.results import StatusTable

    cluster = session_mod.current().cluster
    pid, eid = cluster.ranks[1]["pid"], cluster.engine_ids[1]
    old_pids = [r["pid"] for r in cluster.ranks]
    psutil.Process(pid).send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 20
        while eid in cluster.client.ids:
            assert time.monotonic() < deadline, "the controller kept the stopped engine"
            time.sleep(0.05)
    finally:
        psutil.Process(pid).send_signal(signal.SIGCONT)
    res = run(shell, "%dist status")
    assert res.error_in_exec is None, res.error_in_exec
    table = res.result
    assert [r["alive"] for r in table] == [True, True] and [r["registered"] for r in table] == [True, False]
    assert table.columns == StatusTable.columns + ("registered",) and "died" not in table.columns
    assert f"rank 1 (engine {eid}, pid {pid}) runs but is no longer registered with the controller" in table.title
    assert "Run %dist restart -n 2 (session.restart(n=2)) for a fresh world of 2 ranks" in table.title
    assert session_mod.current().status().title == table.title  # the Python API too
    _restart_and_check(shell, old_pids, capsys)
    assert "registered" not in run(shell, "%dist status").result.columns


def test_status_names_the_failure_policy(shell):
    """The title says what a cell does when an engine dies (--on-failure), not only whether it restarts."""
    try:
        for policy in ("shrink", "restart", "stop"):
            assert run(shell, f"%dist start --on-failure {policy}").error_in_exec is None
            table = run(shell, "%dist status").result
            assert table.on_failure == policy and table.title.endswith(f" · on failure: {policy}"), table.title
            assert "auto restart" not in table.title
    finally:
        session_mod.current().on_failure = "stop"


def test_a_ddp_cell_whose_peer_died_leaves_the_notebook_rank_0s_last_completed_step(shell, capsys):
    """A peer's death ends a ddp cell as any failure does: the notebook gets rank 0's weights after the last step
    every rank completed (the README's promise for a failed ddp cell), so ``%dist restart`` and the next cell go on
    from them. The kernel asked every rank for them, the dead one too, and kept the last cell's weights instead."""
    import torch

    assert run(shell, SETUP).error_in_exec is None
    net = shell.user_ns["death_net"]
    before = torch.cat([p.detach().flatten() for p in net.parameters()]).clone()
    res = run(shell, "%%distrain --model death_net --data death_ds --epochs 50 --batch-size 8 --progress none\n"
                     "x, y = batch\nif rank == 1 and ctx.step == 5:\n    import os, signal\n"
                     "    os.kill(os.getpid(), signal.SIGKILL)\nloss = F.cross_entropy(model(x), y)")
    assert isinstance(res.error_in_exec, RankError) and res.error_in_exec.ename == "EngineDied", res.error_in_exec
    after = torch.cat([p.detach().flatten() for p in net.parameters()])
    assert not torch.equal(before, after), "the notebook lost the steps rank 0 completed"
    # rank 0's replica, kept by a scale to the survivor, is what the notebook holds
    assert run(shell, "%dist scale 1").error_in_exec is None
    assert run(shell, "%%dist\nimport torch\n_w = torch.cat([p.detach().flatten() for p in death_net.parameters()])").error_in_exec \
        is None
    assert torch.equal(run(shell, "%dist pull _w --rank 0").result, after)
    assert run(shell, "%dist restart -n 2").error_in_exec is None
    assert session_mod.current().world_size == 2


def test_a_dead_controller_is_named_with_the_fix_at_once_not_a_hang(shell, capsys):
    """Every call and result goes through the ipyparallel controller. Killed (its pid is in %dist status), a running
    %%dist cell waited forever, and after the interrupt 50 s more to re-form the group; the next cells hung too, and
    %dist status said the ranks were 'busy, or still loading'. Now each names the controller's death and the fix."""
    import threading

    cluster = session_mod.current().cluster
    pid = cluster.pids["controller"]
    old_pids = [r["pid"] for r in cluster.ranks]
    killer = threading.Timer(1.0, psutil.Process(pid).kill)
    killer.start()
    t0 = time.monotonic()
    res = run(shell, "%%dist\nimport time\ntime.sleep(60)")
    killer.join()
    said = f"the ipyparallel controller (pid {pid}) died: killed by SIGKILL"
    assert isinstance(res.error_in_exec, ClusterError) and said in str(res.error_in_exec), res.error_in_exec
    assert "%dist restart" in str(res.error_in_exec) and time.monotonic() - t0 < 10
    t0 = time.monotonic()
    nxt = run(shell, "%%dist\n1")
    assert isinstance(nxt.error_in_exec, ClusterError) and said in str(nxt.error_in_exec), nxt.error_in_exec
    table = run(shell, "%dist status").result
    assert said in table.title and "did not answer" not in table.title, table.title
    assert [r["alive"] for r in table] == [True, True]  # the engines run; the controller is what is gone
    assert time.monotonic() - t0 < 5
    _restart_and_check(shell, old_pids, capsys)
