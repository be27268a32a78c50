"""``%dist stop`` and ``%dist status`` during a background run, and Ctrl-C during ``%dist start``, on real clusters.

Each test that stops the shared cluster starts it again (``%dist start -n 2``) for the tests after it.
"""

import os
import signal
import time

import psutil
import pytest
import torch

from distnb import session as session_mod
from distnb.cluster.cluster import Cluster
from distnb.core.errors import Interrupted
from support import shm

# The gradient of sum(W x) over a batch of 16 rows of ones is 16 for every weight, on every rank: with sgd at
# lr 1/16 each optimizer step takes exactly 1.0 off every weight (exact in float32), so the kernel's weights
# say how many steps were applied: -N after N steps.
SETUP = """import time
import torch, torch.nn as nn, torch.distributed
bs_train = torch.utils.data.TensorDataset(torch.ones(256, 8), torch.zeros(256))
bs_net = nn.Linear(8, 2, bias=False)
nn.init.zeros_(bs_net.weight)"""
OPTIONS = "--model bs_net --data bs_train --epochs 500 --batch-size 16 --optimizer sgd --lr 0.0625 --background"


def run(shell, code):
    return shell.run_cell(code, silent=False)


def _alive(pids) -> list:
    """The pids of ``pids`` still running (a zombie counts as gone), after waiting up to 15 s for them to go."""
    deadline = time.monotonic() + 15
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _start_again(shell):
    res = run(shell, "%dist start -n 2 --timeout 30")
    assert res.error_in_exec is None and session_mod._CURRENT is not None


def test_dist_stop_during_a_background_run_stops_it_at_one_step_then_the_cluster(shell, capsys):
    run(shell, SETUP)
    res = run(shell, f"%%distrain {OPTIONS} -o bs_run\nx, y = batch\ntime.sleep(0.002)\nloss = model(x).sum()")
    assert res.error_in_exec is None
    pids = session_mod.current().cluster.pids
    time.sleep(0.5)  # let it train a while
    capsys.readouterr()
    try:
        res = run(shell, "%dist stop")
        assert res.error_in_exec is None
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("distnb:")]
        assert len(said) == 1, said
        assert "stopped the background training run" in said[0]
        assert "every rank stopped after the same step" in said[0]
        assert said[0].endswith("stopped 2 engines and the controller")
        stopped = shell.user_ns["bs_run"]  # -o is bound as after %dist stop-training
        assert stopped.interrupted and stopped.optimizer_steps > 0
        w = shell.user_ns["bs_net"].weight  # the weights of the last step every rank completed
        assert torch.equal(w, torch.full_like(w, -float(stopped.optimizer_steps))), (w, stopped.optimizer_steps)
        assert session_mod._CURRENT is None
        assert _alive([pids["controller"], *pids["engines"]]) == []
        assert shm.strays() == []
    finally:
        _start_again(shell)
    res = run(shell, f"%%distrain {OPTIONS.replace(' --background', '').replace('500', '1')}\n"
                     "x, y = batch\nloss = model(x).sum()")
    assert res.error_in_exec is None  # the new cluster trains


def test_status_during_a_background_run_and_stop_after_a_rank_was_killed(shell, capsys, monkeypatch):
    # rank 0 sleeps 20 s in its first step while rank 1 waits for it in the all-reduce: after rank 1 is
    # killed the run goes on (rank 0 has not reached the collective) until DEATH_GRACE ends it, here made long
    from distnb.execute import execute

    monkeypatch.setattr(execute, "DEATH_GRACE", 60.0)
    run(shell, SETUP)
    res = run(shell, f"%%distrain {OPTIONS}\nx, y = batch\n"
                     "time.sleep(20 if torch.distributed.get_rank() == 0 else 0)\nloss = model(x).sum()")
    assert res.error_in_exec is None
    sess = session_mod.current()
    pids = sess.cluster.pids
    table = run(shell, "%dist status").result
    assert sess._background is not None and sess._background.active
    assert [row["pid"] for row in table.rows] == pids["engines"] and all(row["alive"] for row in table.rows)
    assert "busy training in the background" in table.title and "died" not in table.text()
    os.kill(pids["engines"][1], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while 1 not in sess.cluster.dead_ranks() and time.monotonic() < deadline:
        time.sleep(0.05)
    res = run(shell, "%dist status")
    assert res.error_in_exec is None and sess._background.active  # still the busy path
    table = res.result
    assert [row["alive"] for row in table.rows] == [True, False]
    assert "SIGKILL" in table.rows[1]["died"] and "rank 1 died" in table.title
    capsys.readouterr()
    t0 = time.monotonic()
    try:
        res = run(shell, "%dist stop")  # the escape hatch after a kill -9
        assert res.error_in_exec is None and time.monotonic() - t0 < 30
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("distnb:")]
        assert len(said) == 1 and said[0].endswith("stopped 2 engines and the controller"), said
        assert "background" in said[0]
        assert session_mod._CURRENT is None
        assert _alive([pids["controller"], *pids["engines"]]) == []
    finally:
        _start_again(shell)


@pytest.mark.parametrize("line", ["%dist restart", "%dist stop"])
def test_ctrl_c_while_stop_or_restart_stops_the_cluster_is_one_line_saying_what_was_done(shell, monkeypatch, line):
    """The cluster's processes were ended and the session forgotten, but the interrupt came out as ipyparallel's
    frames (a KeyboardInterrupt in a thread join), and the restart left no hint that %dist start was what to run."""
    import ipyparallel

    pids = session_mod.current().cluster.pids
    stop_cluster = ipyparallel.Cluster.stop_cluster

    async def interrupted_stop(self, *args, **kwargs):  # a Ctrl-C while ipyparallel stops: the real SIGINT, here
        os.kill(os.getpid(), signal.SIGINT)
        return await stop_cluster(self, *args, **kwargs)

    monkeypatch.setattr(ipyparallel.Cluster, "stop_cluster", interrupted_stop)
    try:
        err = run(shell, line).error_in_exec
        assert isinstance(err, Interrupted), err
        assert str(err) == (f"{line} interrupted while it stopped the cluster: its engines and controller were "
                            "ended all the same; %dist start starts a new one")
        assert err._render_traceback_() == [f"KeyboardInterrupt: {err}"]  # one line, no ipyparallel frames
        assert _alive([pids["controller"], *pids["engines"]]) == [] and session_mod._CURRENT is None
    finally:
        monkeypatch.undo()
        _start_again(shell)


def test_ctrl_c_during_dist_start_stops_the_engines_started_so_far(shell, monkeypatch):
    run(shell, "%dist stop")
    started = {}
    wait_for_engines = Cluster._wait_for_engines

    def interrupted_wait(self, timeout):  # a Ctrl-C while the engines register: the real SIGINT, to this process
        started.update(engines=list(self._procs), controller=self.pids["controller"])
        os.kill(os.getpid(), signal.SIGINT)
        return wait_for_engines(self, timeout)

    monkeypatch.setattr(Cluster, "_wait_for_engines", interrupted_wait)
    try:
        res = run(shell, "%dist start -n 2 --timeout 30")
        err = res.error_in_exec
        assert isinstance(err, Interrupted), err
        assert str(err) == "%dist start interrupted: stopped the 2 engines started so far"
        assert err._render_traceback_() == [f"KeyboardInterrupt: {err}"]  # one line, no ipyparallel frames
        assert len(started["engines"]) == 2 and started["controller"]
        assert _alive([started["controller"], *started["engines"]]) == []
        assert session_mod._CURRENT is None
    finally:
        monkeypatch.undo()
        _start_again(shell)


def test_dist_stop_ends_a_run_whose_ranks_ignore_the_interrupt_with_the_engines(shell, capsys, monkeypatch):
    from distnb.execute import execute

    monkeypatch.setattr(execute, "STOP_WAIT", 0.5)  # the stop's bounded waits, shortened for the test
    monkeypatch.setattr(execute, "INTERRUPT_WAIT", 1.0)
    run(shell, SETUP)
    res = run(shell, f"%%distrain {OPTIONS}\nimport signal\nx, y = batch\n"
                     "signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(0.01)\nloss = model(x).sum()")
    assert res.error_in_exec is None
    pids = session_mod.current().cluster.pids
    time.sleep(0.5)
    capsys.readouterr()
    try:
        t0 = time.monotonic()
        res = run(shell, "%dist stop")
        took = time.monotonic() - t0
        assert res.error_in_exec is None
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("distnb:")]
        assert len(said) == 1 and "did not stop within 6.5 s, so it ended with the engines" in said[0], said
        assert said[0].endswith("stopped 2 engines and the controller") and took >= 6.5
        assert session_mod._CURRENT is None
        assert _alive([pids["controller"], *pids["engines"]]) == []
    finally:
        monkeypatch.undo()
        _start_again(shell)


def test_ctrl_c_while_the_template_forks_an_engine_leaves_no_engine_behind(shell, monkeypatch):
    # the template forks the engine whether or not the kernel waits for its reply: an interrupted wait left
    # an engine nobody knew the pid of (and the launcher's pid -1 made the stop raise ValueError)
    from distnb.cluster import zygote

    run(shell, "%dist stop")
    template = zygote.get()
    assert template is not None and template.ready()
    real = template.proc.stdin

    class InterruptAfterAnEngineRequest:  # the real pipe; a real SIGINT once an engine's fork request is sent
        def write(self, data):
            self.engine = b'"main": "engine"' in data
            return real.write(data)

        def flush(self):
            real.flush()
            if self.engine:
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(template.proc, "stdin", InterruptAfterAnEngineRequest())
    try:
        err = run(shell, "%dist start -n 2 --timeout 30").error_in_exec
        assert isinstance(err, Interrupted) and str(err).startswith("%dist start interrupted: stopped the "), err
        assert session_mod._CURRENT is None
        deadline = time.monotonic() + 15
        children = psutil.Process(template.pid).children()
        while time.monotonic() < deadline and _alive([c.pid for c in children]):
            time.sleep(0.2)
            children = psutil.Process(template.pid).children()
        assert _alive([c.pid for c in children]) == []
    finally:
        monkeypatch.undo()
        _start_again(shell)
