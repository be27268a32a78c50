"""``%dist scale N`` on the real shared cluster: grow 2 -> 3 and shrink back, state carried, parity, faults.

Every test leaves the shared cluster at 2 ranks (the ``two_ranks`` fixture restarts it otherwise).
"""

import os
import re
import signal
import time

import psutil

import pytest
import torch
import torch.nn.functional as F
from IPython.core.error import UsageError

from distnb.elastic import scaling
from distnb.core.errors import BusyError, ClusterError, PlanError, RankError
from support.ports import pinned_port
from support.data import parity_data, parity_model
from support.reference import reference
from support.worlds import back_to_two_ranks

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
LOOP_THREE_STEPS = """for epoch in ctx.epochs():
    for x, y in ctx.loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        ctx.report(loss)
        if ctx.step == 3:
            break
    break"""


def run(shell, code):
    return shell.run_cell(code, silent=False)


@pytest.fixture(autouse=True)
def two_ranks(shell):
    """The shared cluster at 2 ranks before and after each test."""
    yield
    back_to_two_ranks()


def _step_lr(optimizer, total_steps):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)


def _replicas(sess, name):
    sess.run(f"import torch\n_scale_flat = torch.cat([p.detach().flatten() for p in {name}.parameters()])")
    return sess.pull("_scale_flat")


def test_ddp_2_ranks_then_3_matches_one_process_with_each_worlds_global_batches(shell, dist_session, capsys):
    """k epochs on 2 ranks, scale to 3, m more: one process on the per-world global batches, to 1e-5 (Adam, a schedule)."""
    ns = shell.user_ns
    ns.update(sc_net=parity_model(), sc_data=parity_data(), F=F)
    run(shell, "import torch\ndef sc_sched(optimizer, total_steps):\n"
               "    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)")  # by value
    ref = parity_model()
    r1 = dist_session.train(BODY, model="sc_net", data="sc_data", epochs=2, batch_size=16, optimizer="adam",
                            lr=0.02, lr_schedule="sc_sched", seed=3, progress="none", quiet=True)
    base = reference(ref, ns["sc_data"], num_shards=2, batch_size=16, epochs=2, seed=3, optimizer=torch.optim.Adam,
                     lr=0.02, scheduler=lambda opt: _step_lr(opt, None))
    capsys.readouterr()
    out = dist_session.scale(3)
    said = capsys.readouterr().out
    # the shared cluster may hold other tests' models too: each is carried
    assert out["world_size"] == (2, 3) and out["added"] == [2] and "sc_net" in out["models"]
    assert "sc_sched" in out["names"] and "F" in out["names"]
    assert re.search(r"rank 0 broadcast [^(]*\bsc_net\b[^(]* \((each its )?model, optimizer, lr schedule, epoch "
                     r"and sampler position\)", said), said
    assert "sc_data dealt again" in said and "global batch changes from 32 to 48" in said
    # 32 does not split over 3: the fix is not offered (it suggested --keep-global-batch, which then refused)
    assert "--keep-global-batch cannot keep 32: it does not split evenly over 3 data-parallel ranks" in said, said
    assert dist_session.world_size == 3 and len(dist_session.status().rows) == 3
    assert dist_session.run("world_size", all_output=True) == ["3", "3", "3"]

    r2 = dist_session.train(BODY, model="sc_net", data="sc_data", epochs=2, batch_size=16, seed=3,
                            progress="none", quiet=True)
    assert r2.epochs == [2, 3] and len(r2.rows) == 3  # epoch numbers go on: no epoch 0
    assert r2.rows[0]["global_steps"] == r1.rows[0]["global_steps"] + 2 * 5  # ceil(ceil(203 / 3) / 16) = 5
    reference(ref, ns["sc_data"], num_shards=3, batch_size=16, epochs=2, seed=3, optimizer=base.optimizer,
              scheduler=base.scheduler, first_epoch=2)
    for p_dist, p_ref in zip(ns["sc_net"].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)
    flats = _replicas(dist_session, "sc_net")
    assert all(torch.equal(flats[0], f) for f in flats[1:])  # the added rank trained the same replica
    assert r2.rows[2]["lr"] == r2.rows[0]["lr"] == base.optimizer.param_groups[0]["lr"]

    # shrinking back: the highest rank stops, nothing of it is left, training goes on at 2 ranks
    pid = dist_session.cluster.ranks[2]["pid"]
    out = dist_session.scale(2)
    assert out["removed"] == [2] and dist_session.world_size == 2
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    r3 = dist_session.train(BODY, model="sc_net", data="sc_data", epochs=1, batch_size=16, seed=3,
                            progress="none", quiet=True)
    assert r3.epochs == [4]
    reference(ref, ns["sc_data"], num_shards=2, batch_size=16, epochs=1, seed=3, optimizer=base.optimizer,
              scheduler=base.scheduler, first_epoch=4)
    for p_dist, p_ref in zip(ns["sc_net"].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)


def test_keep_global_batch_scales_the_per_rank_batch_and_says_so(shell, dist_session, capsys):
    ns = shell.user_ns
    ns.update(kg_net=parity_model(), kg_data=parity_data(n=192), F=F)
    ref = parity_model()
    dist_session.train(BODY, model="kg_net", data="kg_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.1,
                       seed=2, progress="none", quiet=True)
    base = reference(ref, ns["kg_data"], num_shards=2, batch_size=16, epochs=1, seed=2, optimizer=torch.optim.SGD,
                     lr=0.1)
    capsys.readouterr()
    assert run(shell, "%dist scale 4 --keep-global-batch").error_in_exec is None
    assert "the global batch stays 32 (4 x 8 per rank)" in capsys.readouterr().out
    res = run(shell, "%%distrain --model kg_net --data kg_data --epochs 1 --batch-size 16 --seed 2 --progress none\n"
              + BODY)
    assert res.error_in_exec is None
    assert "global batch 32 kept on 4 ranks as --batch-size 8 (this cell's --batch-size 16 is for 2 ranks)" in \
        capsys.readouterr().out
    result = res.result
    assert result.plan.batch_size == 8 and result.rows[0]["steps"] == 6  # 48 samples per rank, 8 at a time
    reference(ref, ns["kg_data"], num_shards=4, batch_size=8, epochs=1, seed=2, optimizer=base.optimizer,
              first_epoch=1)
    for p_dist, p_ref in zip(ns["kg_net"].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)
    # a global batch that 3 ranks cannot split evenly: refused before anything changes
    err = run(shell, "%dist scale 3 --keep-global-batch").error_in_exec
    assert isinstance(err, UsageError) and "cannot be split evenly over 3 data-parallel ranks" in str(err)
    assert dist_session.world_size == 4
    # back to 2 keeping the global batch: the cell's --batch-size 16 is for 2 ranks again
    assert run(shell, "%dist scale 2 --keep-global-batch").error_in_exec is None
    res = run(shell, "%%distrain --model kg_net --data kg_data --epochs 1 --batch-size 16 --seed 2 --progress none\n"
              + BODY)
    assert res.error_in_exec is None and res.result.plan.batch_size == 16


def test_pushed_names_and_mid_epoch_position_reach_the_added_rank(shell, dist_session):
    ns = shell.user_ns
    ns.update(pn_net=parity_model(), pn_data=parity_data(n=192), F=F, pn_scale=2.5)
    run(shell, "def pn_helper(v):\n    return v * pn_scale")
    run(shell, "%dist push pn_helper pn_scale")
    dist_session.train(LOOP_THREE_STEPS, model="pn_net", data="pn_data", epochs=1, batch_size=16, loop=True,
                       progress="none", quiet=True)
    dist_session.scale(3)
    assert dist_session.run("pn_helper(2)", all_output=True) == ["5.0", "5.0", "5.0"]
    # 3 of 6 steps of epoch 0 were trained on 2 ranks: which samples (48 positions of each of 2 shards) is carried,
    # so the 96 not trained yet are dealt over 3 (engine/epochrest.py), not a count of positions
    dist_session.run("from distnb.engine.train import loop\n_pos = (loop.RUNS['pn_net'].epoch, "
                     "loop.RUNS['pn_net'].epoch_samples, loop.RUNS['pn_net'].steps, "
                     "loop.RUNS['pn_net'].epoch_trail['segments'])")
    assert dist_session.pull("_pos") == [(0, 0, 3, [[2, 48]])] * 3


def test_bad_scales_are_usage_errors_and_change_nothing(shell, dist_session):
    for line, says in (("%dist scale 0", "at least 1"), ("%dist scale -1", "at least 1"),
                       ("%dist scale 100000", "use at most"), ("%dist scale two", "invalid int")):
        err = run(shell, line).error_in_exec
        assert isinstance(err, UsageError) and says in str(err), (line, err)
    assert dist_session.world_size == 2


ALL_REDUCE = "import torch, torch.distributed as dist\nx = torch.ones(1)\ndist.all_reduce(x)\nx.item()"


def test_a_world_on_a_pinned_master_port_grows_and_is_re_formed_on_it(dist_session):
    # the old world's store held the pinned port, so the new world could not form there (scale failed)
    port = pinned_port()  # below the ephemeral range, where clusters' random ports cannot take it first
    session = dist_session.restart(quiet=True, master_port=port)
    try:
        session.scale(3, quiet=True)
        assert session.world_size == 3 and session.cluster.master_port == port
        assert session.run(ALL_REDUCE) == ["3.0"] * 3
        with pytest.raises(RankError, match="rank 1"):
            session.run("if rank == 1:\n    raise ValueError('x')\n" + ALL_REDUCE)
        assert session.cluster.master_port == port and session.run(ALL_REDUCE) == ["3.0"] * 3  # re-formed there
    finally:
        session.restart(quiet=True, master_port=None)
        back_to_two_ranks()


def test_scale_to_the_same_size_changes_nothing(dist_session, capsys):
    pids = [r["pid"] for r in dist_session.cluster.ranks]
    assert dist_session.scale(2)["world_size"] == (2, 2)
    assert "already has 2 ranks; nothing changed" in capsys.readouterr().out
    assert [r["pid"] for r in dist_session.cluster.ranks] == pids


def test_scale_during_a_background_run_is_busy(shell, dist_session):
    ns = shell.user_ns
    ns.update(bs_net=parity_model(), bs_data=parity_data(n=256), F=F)
    run(shell, "import time")
    res = run(shell, "%%distrain --model bs_net --data bs_data --epochs 3 --batch-size 8 --background "
                     "--progress none\nx, y = batch\ntime.sleep(0.02)\nloss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None
    try:
        err = run(shell, "%dist scale 3").error_in_exec
        assert isinstance(err, BusyError) and "%dist wait" in str(err)
        with pytest.raises(BusyError):
            dist_session.scale(3)
    finally:
        dist_session.wait()
    assert dist_session.world_size == 2


def test_an_engine_that_dies_while_joining_leaves_the_old_world_usable(shell, dist_session):
    ns = shell.user_ns
    ns.update(fj_net=parity_model(), fj_data=parity_data(), F=F)
    r1 = dist_session.train(BODY, model="fj_net", data="fj_data", epochs=1, batch_size=16, optimizer="adam",
                            progress="none", quiet=True)
    old_pids = [r["pid"] for r in dist_session.cluster.ranks]
    started = []

    def kill(pids):
        started.extend(pids)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    scaling.ON_ENGINES_STARTED.append(kill)
    with pytest.raises(ClusterError) as info:
        dist_session.scale(3)
    assert "did not join" in str(info.value) and "the world of 2 ranks is as it was" in str(info.value)
    assert started and dist_session.world_size == 2
    assert [r["pid"] for r in dist_session.cluster.ranks] == old_pids
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in started):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r2 = dist_session.train(BODY, model="fj_net", data="fj_data", epochs=1, batch_size=16, progress="none",
                            quiet=True)
    assert r2.epochs == [1] and r2.rows[0]["global_steps"] == 2 * r1.rows[0]["global_steps"]  # no fresh start
    scaling.ON_ENGINES_STARTED.clear()
    assert dist_session.scale(3)["world_size"] == (2, 3)  # a scale after the failed one works


def test_a_rank_killed_during_the_re_form_is_reported_and_restart_works(shell, dist_session):
    victim = dist_session.cluster.ranks[1]["pid"]
    scaling.ON_ENGINES_STARTED.append(lambda pids: os.kill(victim, signal.SIGKILL))
    with pytest.raises(ClusterError) as info:
        dist_session.scale(3)
    assert "rank 1" in str(info.value) and "killed by SIGKILL" in str(info.value)
    assert "%dist restart" in str(info.value)
    scaling.ON_ENGINES_STARTED.clear()
    new = dist_session.restart(n=2, quiet=True)
    assert new.world_size == 2 and new.run("world_size", all_output=True) == ["2", "2"]


def _kill_rank(sess, rank):
    """SIGKILL ``rank``'s engine and wait until the kernel sees it dead; its pid."""
    pid = sess.cluster.ranks[rank]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while rank not in sess.cluster.dead_ranks():
        assert time.monotonic() < deadline, f"rank {rank} (pid {pid}) not seen dead"
        time.sleep(0.05)
    return pid


def test_a_grow_with_a_dead_rank_is_refused_at_once_and_a_scale_below_it_goes_on(shell, dist_session):
    """A rank killed between cells: %dist scale 3 says so before starting an engine (not 'did not join')."""
    dist_session.run("dr_value = 40 + rank")
    ids = list(dist_session.cluster.engine_ids)
    started = []
    scaling.ON_ENGINES_STARTED.append(started.extend)
    pid = _kill_rank(dist_session, 1)
    try:
        t0 = time.monotonic()
        err = run(shell, "%dist scale 3").error_in_exec
        assert time.monotonic() - t0 < 3, "refused only after trying"
        assert isinstance(err, ClusterError), err
        said = str(err)
        assert said.startswith(f"%dist scale 3: rank 1 (engine {ids[1]}, pid {pid}) died: killed by SIGKILL"), said
        assert "so the world cannot grow; nothing changed (no engine was started)" in said
        assert "did not join" not in said and "%dist restart -n 3 (session.restart(n=3))" in said
        assert "%dist scale 1 (session.scale(1)) to go on without it, keeping what rank 0 holds" in said
        assert started == [] and dist_session.cluster.engine_ids == ids and dist_session.world_size == 2
        with pytest.raises(ClusterError, match="so the world cannot grow"):  # the Python API says the same
            dist_session.scale(4)
        same = run(shell, "%dist scale 2").error_in_exec  # the same size: not "nothing changed" with a rank dead
        assert isinstance(same, ClusterError), same
        assert str(same).startswith(f"%dist scale 2: rank 1 (engine {ids[1]}, pid {pid}) died: killed by SIGKILL")
        assert "so the world cannot go on at 2 ranks; nothing changed (no engine was started)" in str(same)
        assert "%dist restart -n 2 (session.restart(n=2))" in str(same) and "%dist scale 1 (session.scale(1))" in \
            str(same)
        with pytest.raises(ClusterError, match="so the world cannot go on at 2 ranks"):
            dist_session.scale(2)
        assert dist_session.scale(1, quiet=True)["world_size"] == (2, 1)  # the fix it names: rank 0's state kept
        assert dist_session.run("dr_value") == ["40"]
        scaling.ON_ENGINES_STARTED.clear()
        assert dist_session.scale(2, quiet=True)["world_size"] == (1, 2)
        assert dist_session.run(ALL_REDUCE) == ["2.0"] * 2
    finally:
        scaling.ON_ENGINES_STARTED.clear()
        if dist_session.running and dist_session.cluster.dead_ranks():  # failed: the next test gets a whole world
            dist_session.restart(n=2, quiet=True)


@pytest.mark.parametrize("when", ["registered", "registering"])
def test_an_interrupted_grow_ends_in_one_line_and_leaves_the_old_world(shell, dist_session, monkeypatch, when):
    """Ctrl-C (a real SIGINT) once the added engine registered, or while it registers: rolled back, one line."""
    from distnb.cluster import engines
    from distnb.core.errors import Interrupted

    dist_session.run("ig_value = 40 + rank")
    pids = [r["pid"] for r in dist_session.cluster.ranks]
    started = []

    def interrupt(new_pids):
        started.extend(new_pids)
        os.kill(os.getpid(), signal.SIGINT)

    if when == "registered":
        scaling.ON_ENGINES_STARTED.append(interrupt)
    else:
        wait_registered = engines.Engines._wait_registered

        def interrupted_wait(self, known, k, new_pids):
            interrupt(new_pids)
            return wait_registered(self, known, k, new_pids)

        monkeypatch.setattr(engines.Engines, "_wait_registered", interrupted_wait)
    err = run(shell, "%dist scale 3").error_in_exec
    monkeypatch.undo()
    scaling.ON_ENGINES_STARTED.clear()
    assert isinstance(err, Interrupted), err
    stopped = "the added engine was stopped" if when == "registered" else "the engines being started were stopped"
    assert str(err) == f"%dist scale 3 interrupted: {stopped}; the world of 2 ranks is as it was (its state intact)"
    assert err._render_traceback_() == [f"KeyboardInterrupt: {err}"]  # one line, no traceback
    assert started and dist_session.world_size == 2 and [r["pid"] for r in dist_session.cluster.ranks] == pids
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in started):
        assert time.monotonic() < deadline, "the added engine outlived the interrupted scale"
        time.sleep(0.1)
    assert dist_session.run("ig_value", all_output=True) == ["40", "41"] and dist_session.run(ALL_REDUCE) == ["2.0"] * 2


@pytest.mark.parametrize("strategy,worlds,num_shards", [("fsdp", (2, 3), (2, 3)), ("tensor", (2, 4), (1, 1))])
def test_sharded_models_are_resharded_through_dcp(shell, dist_session, capsys, strategy, worlds, num_shards):
    """fsdp 2 -> 3 and tensor 2 -> 4: DCP written by the old world, loaded resharded; parity with one process."""
    ns = shell.user_ns
    name = f"rs_{strategy}"
    ns.update({name: parity_model(), "rs_data": parity_data(), "F": F})
    ref = parity_model()
    r1 = dist_session.train(BODY, model=name, data="rs_data", strategy=strategy, epochs=1, batch_size=16,
                            optimizer="adam", lr=0.01, seed=5, progress="none", quiet=True)
    base = reference(ref, ns["rs_data"], num_shards=num_shards[0], batch_size=16, epochs=1, seed=5,
                     optimizer=torch.optim.Adam, lr=0.01)
    capsys.readouterr()
    out = dist_session.scale(worlds[1])
    said = capsys.readouterr().out
    assert name in out["resharded"] and "resharded onto" in said and "sends it again" not in said
    assert ("global batch stays 16 (1 x 16 per rank): under --strategy tensor the data-parallel size does not "
            "change" in said) if strategy == "tensor" else "global batch changes from 32 to 48" in said, said
    capsys.readouterr()
    r2 = dist_session.train(BODY, model=name, data="rs_data", epochs=1, batch_size=16, seed=5, progress="none")
    said = capsys.readouterr().out
    assert "sent" not in said and "fresh" not in said, said  # the ranks' resharded copy goes on
    assert r2.epochs == [1] and r2.rows[0]["global_steps"] > r1.rows[0]["global_steps"]
    reference(ref, ns["rs_data"], num_shards=num_shards[1], batch_size=16, epochs=1, seed=5,
              optimizer=base.optimizer, first_epoch=1)
    for p_dist, p_ref in zip(ns[name].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)
    assert name in dist_session.scale(2)["resharded"]  # and back, shrinking
    r3 = dist_session.train(BODY, model=name, data="rs_data", epochs=1, batch_size=16, seed=5, progress="none",
                            quiet=True)
    assert r3.epochs == [2]
    reference(ref, ns["rs_data"], num_shards=num_shards[0], batch_size=16, epochs=1, seed=5,
              optimizer=base.optimizer, first_epoch=2)
    for p_dist, p_ref in zip(ns[name].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)
    if strategy == "tensor":  # its 16 columns cannot be split over 3 ranks: a scale to 3 is refused while it lives
        with pytest.raises(PlanError, match="cannot be laid out on 3 ranks.*nothing changed"):
            dist_session.scale(3)
        assert dist_session.world_size == 2
        del ns[name]  # as the error says: then the scale goes ahead


KILL_RANK_1 = """import os, signal
x, y = batch
if rank == 1 and world_size == 3 and ctx.step == 7:  # once: the cell goes on on 2 ranks
    os.kill(os.getpid(), signal.SIGKILL)
loss = F.cross_entropy(model(x), y)"""
# the same, with 0.3 s for rank 1 to send what it reported before the kill (a SIGKILL loses what is still queued)
KILL_RANK_1_REPORTED = KILL_RANK_1.replace("x, y = batch\n", "x, y = batch\nif rank == 1 and world_size == 3 and "
                                           "ctx.step == 7:\n    import time\n    time.sleep(0.3)\n")


def test_a_shrink_in_a_background_run_is_said_by_dist_wait(shell, dist_session, capsys):
    shell.user_ns.update(bw_net=parity_model(), bw_data=parity_data(), F=F)
    dist_session.on_failure = "shrink"
    dist_session.scale(3, quiet=True)
    res = run(shell, "%%distrain --model bw_net --data bw_data --epochs 3 --batch-size 16 --seed 6 --progress none "
                     "--background\n" + KILL_RANK_1)
    assert res.error_in_exec is None, res.error_in_exec
    capsys.readouterr()
    res = run(shell, "%dist wait")
    said = capsys.readouterr().out
    assert res.error_in_exec is None, res.error_in_exec
    assert "during the background run, --on-failure shrink: lost rank 1 (engine" in said
    assert "the cell finished on 2 ranks (was 3)" in said and res.result.lost["world_size"] == (3, 2)


def test_on_failure_shrink_goes_on_on_the_survivors_from_the_last_completed_step(shell, dist_session, capsys):
    """3 ranks, rank 1 killed at epoch 1 step 2: the cell finishes on 2 ranks; parity with one process."""
    ns = shell.user_ns
    ns.update(of_net=parity_model(), of_data=parity_data(), F=F)
    assert run(shell, "%dist start --on-failure shrink").error_in_exec is None
    assert "the cell goes on on the surviving ranks" in capsys.readouterr().out
    assert dist_session.on_failure == "shrink" and not dist_session.auto_restart
    dist_session.scale(3, quiet=True)
    victim = dist_session.cluster.ranks[1]["pid"]
    res = run(shell, "%%distrain --model of_net --data of_data --epochs 3 --batch-size 16 --optimizer sgd --lr 0.1 "
                     "--seed 6 --progress none\n" + KILL_RANK_1_REPORTED)
    said = capsys.readouterr().out
    assert res.error_in_exec is None, res.error_in_exec
    assert "--on-failure shrink: rank 1 (engine" in said and "killed by SIGKILL" in said
    # where the lost rank was: what it last reported (--progress none: its start or an epoch end), said so, and the
    # same in result.lost, which holds the lost ranks only
    assert set(res.result.lost["where"]) == {1}, res.result.lost
    epoch, step = res.result.lost["where"][1]
    assert epoch in (0, 1) and step is not None, res.result.lost
    assert (f"killed by SIGKILL (from outside the engine, or by the out-of-memory killer); last reported at epoch "
            f"{epoch}, step {step}; going on on 2 surviving ranks") in said, said
    assert "the cell finished on 2 ranks (was 3)" in said and "no completed step lost" in said
    result = res.result
    assert result.epochs == [1, 2] and len(result.rows) == 2 and dist_session.world_size == 2
    assert result.lost["samples_reassigned"] == 68 and result.lost["world_size"] == (3, 2)  # ceil((203 - 1) / 3)
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE

    from distnb.engine.train import epochrest
    from distnb.engine.transport import shard

    ref = parity_model()
    base = reference(ref, ns["of_data"], num_shards=3, batch_size=16, epochs=1, seed=6, optimizer=torch.optim.SGD,
                     lr=0.1)
    x, y = ns["of_data"].tensors
    # epoch 1: 7 - 5 = 2 steps on 3 ranks (32 samples each: 96), then exactly the samples not trained yet, dealt
    # over 2 (engine/epochrest.py); each step's loss the mean of the ranks' means, as DDP averages (the last
    # step's batches differ by one sample where the rest does not split evenly)
    steps = [[idx] for idx in list(shard.global_batches(len(x), 3, 6, 1, 16, False))[:2]]
    trail = epochrest.new_trail(("of_data", len(x)), 1, 6, False)
    trail["segments"].append([3, 32])
    parts = epochrest.layout(len(x), trail, 2)
    cuts = [epochrest.cut([len(p) for p in parts], r, 0, 16, False) for r in range(2)]
    steps += [[parts[r][cuts[r][j]] for r in range(2)] for j in range(len(cuts[0]))]
    for per_rank in steps:
        base.optimizer.zero_grad()
        (sum(F.cross_entropy(ref(x[idx]), y[idx]) for idx in per_rank) / len(per_rank)).backward()
        base.optimizer.step()
    reference(ref, ns["of_data"], num_shards=2, batch_size=16, epochs=1, seed=6, optimizer=base.optimizer,
              first_epoch=2)
    for p_dist, p_ref in zip(ns["of_net"].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)
    flats = _replicas(dist_session, "of_net")
    assert torch.equal(flats[0], flats[1])


def test_on_failure_shrink_without_a_checkpoint_fails_a_sharded_cell_but_leaves_a_usable_world(shell, dist_session):
    ns = shell.user_ns
    ns.update(ofs_net=parity_model(), ofs_data=parity_data(), F=F)
    dist_session.on_failure = "shrink"
    dist_session.scale(3, quiet=True)
    res = run(shell, "%%distrain --model ofs_net --data ofs_data --strategy fsdp --epochs 2 --batch-size 16 "
                     "--progress none\n" + KILL_RANK_1)
    err = res.error_in_exec
    assert err is not None and "give --checkpoint-dir" in str(err) and "world is now 2 ranks" in str(err)
    assert dist_session.world_size == 2 and dist_session.run("world_size", all_output=True) == ["2", "2"]


def test_on_failure_shrink_resumes_a_sharded_model_from_its_newest_checkpoint(shell, dist_session, tmp_path, capsys):
    ns = shell.user_ns
    ns.update(ofc_net=parity_model(), ofc_data=parity_data(), F=F, ofc_dir=str(tmp_path / "ck"))
    dist_session.on_failure = "shrink"
    dist_session.scale(3, quiet=True)
    capsys.readouterr()
    res = run(shell, "%%distrain --model ofc_net --data ofc_data --strategy fsdp --epochs 3 --batch-size 16 "
                     "--optimizer adam --checkpoint-dir {ofc_dir} --checkpoint-every 3 --progress none\n"
              + KILL_RANK_1)
    said = capsys.readouterr().out
    assert res.error_in_exec is None, res.error_in_exec
    result = res.result
    lost = result.lost
    assert lost["world_size"] == (3, 2) and lost["resumed_from"].endswith("step_00000006")
    assert lost["steps_lost"] == 1  # steps 1-7 trained, the checkpoint holds 6: step 7 is trained again
    assert "1 step after the checkpoint" in said and "resumes from the newest checkpoint" in said
    assert result.epochs == [1, 2] and len(result.rows) == 2 and dist_session.world_size == 2

