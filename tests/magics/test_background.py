"""Background training, one run at a time, rank output and the dashboard, through the magics on the real cluster."""

import os
import re
import signal
import threading
import time

import torch

from distnb import session as session_mod
from distnb.core.errors import BusyError, RankError
from support import shm

SETUP = """import time
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
bgX = torch.randn(256, 8)
bg_train = torch.utils.data.TensorDataset(bgX, (bgX.sum(1) > 0).long())
bg_net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))"""


def run(shell, code):
    return shell.run_cell(code, silent=False)


def _replicas_equal_kernel(shell):
    run(shell, "%%dist\nbg_w = {k: v.clone() for k, v in bg_net.state_dict().items()}")
    ranks = run(shell, "%dist pull bg_w").result
    net = shell.user_ns["bg_net"]
    return all(torch.equal(w[k], v) for w in ranks for k, v in net.state_dict().items())


def test_background_run_frees_the_kernel_refuses_other_commands_and_wait_returns(shell, capsys):
    run(shell, SETUP)
    before = {k: v.clone() for k, v in shell.user_ns["bg_net"].state_dict().items()}
    t0 = time.monotonic()
    res = run(shell, "%%distrain --model bg_net --data bg_train --epochs 4 --batch-size 16 --background -o bg\n"
                     "x, y = batch\ntime.sleep(0.01)\nloss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None and time.monotonic() - t0 < 10
    assert "training in the background" in capsys.readouterr().out
    sess = session_mod.current()
    assert sess._background is not None and sess._background.active
    for cell in ("%%dist\nprint(1)", "%dist restart", "%dist push SETUP",
                 "%%distrain --model bg_net --data bg_train\nx, y = batch\nloss = F.cross_entropy(model(x), y)"):
        err = run(shell, cell).error_in_exec
        assert isinstance(err, BusyError), (cell, err)
        assert "%dist wait" in str(err) and "%dist stop-training" in str(err) and "%dist stop " in str(err)
    assert shell.run_cell("1 + 1").result == 2  # ordinary cells run meanwhile
    result = run(shell, "res = %dist wait").result
    result = shell.user_ns["res"]
    assert result is shell.user_ns["bg"] and result.epochs == [0, 1, 2, 3] and sess._background is None
    assert all(row["steps"] == 32 for row in result.rows)
    net = shell.user_ns["bg_net"]
    assert not all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # weights are back
    assert _replicas_equal_kernel(shell)
    assert "no background training run" in (run(shell, "%dist wait"), capsys.readouterr().out)[1]


def test_a_finished_run_is_kept_for_wait_whatever_ran_in_between(shell, capsys):
    # %dist status (and %dist where) after the run had finished took it off the session with a
    # one-line note, so a later `r = %dist wait` said there was nothing to wait for: without -o the
    # TrainResult was lost
    run(shell, SETUP)
    before = {k: v.clone() for k, v in shell.user_ns["bg_net"].state_dict().items()}
    res = run(shell, "%%distrain --model bg_net --data bg_train --epochs 2 --batch-size 16 --background\n"
                     "x, y = batch\nloss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None
    sess = session_mod.current()
    assert sess._background.join(60)  # finished before any other command
    trained = {k: v.clone() for k, v in shell.user_ns["bg_net"].state_dict().items()}
    assert not all(torch.equal(before[k], v) for k, v in trained.items())  # the run's own weights-back
    capsys.readouterr()
    for cell in ("%dist status", "%dist where", "%dist status", "%%dist\nprint('meanwhile')"):
        assert run(shell, cell).error_in_exec is None, cell
    out = capsys.readouterr().out
    assert out.count("the background run finished: ddp") == 1 and "no background training run" not in out
    res = run(shell, "r = %dist wait")
    assert res.error_in_exec is None and "no background training run" not in capsys.readouterr().out
    result = shell.user_ns["r"]
    assert result is not None and result.epochs == [0, 1] and all(row["steps"] == 16 for row in result.rows)
    net = shell.user_ns["bg_net"]
    assert all(torch.equal(trained[k], v) for k, v in net.state_dict().items())  # put back once, not again
    assert _replicas_equal_kernel(shell)
    assert sess._background is None
    assert "no background training run" in (run(shell, "%dist wait"), capsys.readouterr().out)[1]  # once


def test_stop_training_stops_every_rank_at_the_same_step(shell, capsys):
    run(shell, SETUP)
    run(shell, "%%distrain --model bg_net --data bg_train --epochs 500 --batch-size 16 --background -o bg_stopped\n"
               "x, y = batch\ntime.sleep(0.002)\nloss = F.cross_entropy(model(x), y)")
    time.sleep(0.5)  # let it train a while (the thing under test is stopping a run in progress)
    t0 = time.monotonic()
    res = run(shell, "%dist stop-training")
    assert res.error_in_exec is None and time.monotonic() - t0 < 10
    stopped = shell.user_ns["bg_stopped"]  # bound by -o: the TrainResult of what was trained, marked interrupted
    assert res.result is stopped and stopped.interrupted and stopped.rows[0]["steps"] > 0
    out = capsys.readouterr().out
    assert "every rank stopped after the same step" in out
    assert session_mod.current()._background is None
    assert _replicas_equal_kernel(shell)  # the kernel's model has the weights the ranks stopped with
    res = run(shell, "%%distrain --model bg_net --data bg_train --epochs 1 --batch-size 16\n"
                     "x, y = batch\nloss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None  # the cluster works on


def test_interrupting_wait_stops_the_run_like_stop_training(shell, capsys):
    # a SIGINT to the kernel during %dist wait: Thread.join interrupted by KeyboardInterrupt marked the
    # still-running thread as stopped (CPython 3.11), so wait collected an empty run, the weights never
    # came back and the next cell raced the run's own weights-back (FileNotFoundError on /dev/shm)
    run(shell, SETUP)
    before = {k: v.clone() for k, v in shell.user_ns["bg_net"].state_dict().items()}
    run(shell, "%%distrain --model bg_net --data bg_train --epochs 500 --batch-size 16 --background\n"
               "x, y = batch\ntime.sleep(0.002)\nloss = F.cross_entropy(model(x), y)")
    capsys.readouterr()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        t0 = time.monotonic()
        res = run(shell, "%dist wait")
    finally:
        timer.cancel()
    assert res.error_in_exec is None and time.monotonic() - t0 < 10
    assert res.result is not None and res.result.interrupted  # the result of what was trained
    assert "every rank stopped after the same step" in capsys.readouterr().out  # the Interrupted, as one line
    assert session_mod.current()._background is None
    net = shell.user_ns["bg_net"]
    assert not all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # weights are back
    assert _replicas_equal_kernel(shell)
    res = run(shell, "%%distrain --model bg_net --data bg_train --epochs 1 --batch-size 16\n"
                     "x, y = batch\nloss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None  # the next cell works
    assert shm.strays() == []  # only the segments the transfers reuse


def test_a_failed_background_run_raises_at_wait(shell, capsys):
    run(shell, SETUP)
    run(shell, "%%distrain --model bg_net --data bg_train --epochs 2 --batch-size 16 --background\n"
               "x, y = batch\nif ctx.rank == 1 and ctx.step == 3:\n    raise ValueError('background failure')\n"
               "loss = F.cross_entropy(model(x), y)")
    err = run(shell, "%dist wait").error_in_exec
    assert isinstance(err, RankError) and err.rank == 1 and "background failure" in str(err)
    assert session_mod.current()._background is None
    assert run(shell, "%%dist\nprint('still usable')").error_in_exec is None


def test_a_failed_ranks_output_is_shown_without_all_output(shell, capsys):
    run(shell, SETUP)
    res = run(shell, "%%distrain --model bg_net --data bg_train --epochs 1 --batch-size 16\n"
                     "x, y = batch\nif ctx.rank == 1 and ctx.step == 2:\n"
                     "    print('rank 1 says why', flush=True)\n    raise ValueError('failing on purpose')\n"
                     "loss = F.cross_entropy(model(x), y)")
    assert isinstance(res.error_in_exec, RankError)
    out = capsys.readouterr().out
    assert "[rank 1] rank 1 says why" in out


def test_a_line_printed_in_pieces_is_tagged_once(shell, capsys):
    run(shell, "%%dist\nimport sys, time\nprint('first half', end='')\nsys.stdout.flush()\ntime.sleep(0.4)\n"
               "print(' second half')")
    out = capsys.readouterr().out
    assert "[rank 0] first half second half" in out


def test_the_dashboard_shows_each_ranks_pipeline_stage(shell, monkeypatch):
    from distnb.display import render

    html = []
    snapshot_init = render.Snapshot.__init__

    def keep(self, state, *args, **kwargs):
        snapshot_init(self, state, *args, **kwargs)
        html.append(self.html)

    monkeypatch.setattr(render.Snapshot, "__init__", keep)
    run(shell, SETUP)
    res = run(shell, "%%distrain --model bg_net --data bg_train --epochs 1 --batch-size 16 --strategy pipeline "
                     "--progress widgets\nx, y = batch\nloss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None
    assert ">stage<" in html[-1]
    stages = [int(s) for s in re.findall(r"class='distnb-stage'[^>]*>(\d+)<", html[-1])]
    assert stages == [0, 1]
