"""The optimizer step on the real 2-rank cluster: --accumulate, --clip-grad-norm, --lr-schedule, --precision.

Each is checked against the single-process reference (tests/support/reference.py) to 1e-5:
2 ranks x batch B x accumulate N equals one process on the global batch 2*B*N; clipping at X
equals one process clipping at X (and the reported pre-clip norms are its norms); the lr of
every optimizer step is the reference scheduler's.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from distnb.engine.train import stepping
from support.data import parity_data, parity_model
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
TOL = dict(atol=1e-5, rtol=1e-5)
OPTIMIZERS = [("sgd", torch.optim.SGD, 0.1), ("adam", torch.optim.Adam, 0.01)]


def assert_params_close(model, ref):
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL, msg=lambda m: f"{name}: {m}")


def fresh(shell, name, n=192):
    ns = shell.user_ns
    ns[name], ns["step_data"], ns["F"] = parity_model(), parity_data(n=n), F
    return parity_model()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("optimizer,opt_cls,lr", OPTIMIZERS)
def test_accumulation_equals_one_process_on_the_global_batch(dist_session, shell, strategy, optimizer, opt_cls, lr):
    name = f"acc_{strategy}_{optimizer}"
    ref = fresh(shell, name)  # 192 samples: 96 per rank, 12 batches of 8, 4 optimizer steps of 3 per epoch
    result = dist_session.train(BODY, model=name, data="step_data", epochs=2, batch_size=8, accumulate=3,
                                optimizer=optimizer, lr=lr, seed=4, strategy=strategy, progress="none", quiet=True)
    assert [r["steps"] for r in result.rows] == [24, 24]  # micro-steps
    assert result.optimizer_steps == 8
    reference(ref, shell.user_ns["step_data"], num_shards=2, batch_size=8, epochs=2, seed=4, optimizer=opt_cls,
              lr=lr, accumulate=3)
    assert_params_close(shell.user_ns[name], ref)


@pytest.mark.parametrize("strategy,num_shards", [("tensor", 1), ("pipeline", 1), ("ps", 2)])
def test_accumulation_with_the_other_strategies(dist_session, shell, strategy, num_shards):
    name = f"acc_{strategy}"
    ref = fresh(shell, name)
    dist_session.train(BODY, model=name, data="step_data", epochs=1, batch_size=8, accumulate=3, optimizer="adam",
                       lr=0.01, seed=4, strategy=strategy, progress="none", quiet=True)
    reference(ref, shell.user_ns["step_data"], num_shards=num_shards, batch_size=8, epochs=1, seed=4,
              optimizer=torch.optim.Adam, lr=0.01, accumulate=3)
    assert_params_close(shell.user_ns[name], ref)


def test_accumulation_with_a_short_last_group_steps_at_the_epoch_end(dist_session, shell):
    ref = fresh(shell, "acc_tail", n=160)  # 80 per rank: 10 batches of 8 -> groups of 4, 4, 2
    result = dist_session.train(BODY, model="acc_tail", data="step_data", epochs=1, batch_size=8, accumulate=4,
                                optimizer="sgd", lr=0.1, seed=4, progress="none", quiet=True)
    assert result.optimizer_steps == 3
    reference(ref, shell.user_ns["step_data"], num_shards=2, batch_size=8, epochs=1, seed=4,
              optimizer=torch.optim.SGD, lr=0.1, accumulate=4)
    assert_params_close(shell.user_ns["acc_tail"], ref)


@pytest.mark.parametrize("strategy,num_shards,n", [("ddp", 2, 150), ("pipeline", 1, 142)])
def test_accumulation_weights_a_partial_last_batch_by_its_samples(dist_session, shell, strategy, num_shards, n):
    """A group holding the epoch's partial last batch is the mean over the group's samples, as one process's batch.

    ddp: 150 samples, 75 per rank: 9 batches of 8 and one of 3; pipeline: 142 on every rank, 17 of 8 and one of 6.
    With --accumulate 2 the last group is 8 + 3 (8 + 6) samples; scaling each micro-step by 1/2 gave the short
    batch the weight of a full one (0.003 off after an epoch).
    """
    name = f"acc_partial_{strategy}"
    ref = fresh(shell, name, n=n)
    dist_session.train(BODY, model=name, data="step_data", epochs=2, batch_size=8, accumulate=2, optimizer="sgd",
                       lr=0.5, seed=4, strategy=strategy, progress="none", quiet=True)
    reference(ref, shell.user_ns["step_data"], num_shards=num_shards, batch_size=8, epochs=2, seed=4,
              optimizer=torch.optim.SGD, lr=0.5, accumulate=2)
    assert_params_close(shell.user_ns[name], ref)


@pytest.mark.parametrize("strategy,num_shards", [("ddp", 2), ("fsdp", 2), ("tensor", 1), ("pipeline", 1)])
def test_clipping_uses_the_whole_models_norm(dist_session, shell, strategy, num_shards):
    name = f"clip_{strategy}"
    ref = fresh(shell, name)
    result = dist_session.train(BODY, model=name, data="step_data", epochs=2, batch_size=16, clip_grad_norm=0.05,
                                optimizer="sgd", lr=0.5, seed=4, strategy=strategy, progress="none", quiet=True)
    run = reference(ref, shell.user_ns["step_data"], num_shards=num_shards, batch_size=16, epochs=2, seed=4,
                    optimizer=torch.optim.SGD, lr=0.5, clip_grad_norm=0.05)
    assert_params_close(shell.user_ns[name], ref)
    norms = [v for _, v in result.grad_norm_history]
    assert len(norms) == len(run.grad_norms) and min(norms) > 0.05  # every step clipped
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(run.grad_norms), **TOL)
    assert result.grad_norm == pytest.approx(run.grad_norms[-1], rel=1e-5)
    assert "grad norm" in result.title


def test_cosine_schedule_with_warmup_is_the_reference_lr_sequence_and_lives_across_cells(dist_session, shell):
    ref = fresh(shell, "sched")  # 6 steps of 16 per rank per epoch
    result = dist_session.train(BODY, model="sched", data="step_data", epochs=2, batch_size=16, optimizer="sgd",
                                lr=0.2, seed=4, lr_schedule="cosine", warmup_steps=3, progress="none", quiet=True)
    want = stepping.lr_sequence("cosine", 0.2, 3, 12)
    assert [v for _, v in result.lr_history] == pytest.approx(want, rel=1e-12)
    assert want[0] < want[2] < want[3] == pytest.approx(0.2) and want[-1] < 0.01
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, stepping.Schedule("cosine", 3, 12))
    run = reference(ref, shell.user_ns["step_data"], num_shards=2, batch_size=16, epochs=2, seed=4, optimizer=opt,
                    scheduler=sched)
    assert run.lrs == pytest.approx(want, rel=1e-12)
    assert_params_close(shell.user_ns["sched"], ref)
    assert result.lr == pytest.approx(sched.get_last_lr()[0])
    # the schedule stays live on the ranks: a next cell without --lr-schedule goes on with it
    nxt = dist_session.train(BODY, model="sched", data="step_data", epochs=1, batch_size=16, seed=4,
                             progress="none", quiet=True)
    assert nxt.lr_history[0][1] == pytest.approx(0.0, abs=1e-12)  # the cosine of 12 steps has ended
    # a notebook callable f(optimizer, total_steps)
    shell.user_ns["halve"] = lambda optimizer, total: torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    third = dist_session.train(BODY, model="sched", data="step_data", epochs=1, batch_size=16, seed=4, lr=0.4,
                               lr_schedule="halve", progress="none", quiet=True)
    assert [v for _, v in third.lr_history] == pytest.approx([0.4, 0.4, 0.2, 0.2, 0.1, 0.1])


def test_schedule_and_position_come_back_from_a_checkpoint(dist_session, shell, tmp_path):
    fresh(shell, "sched_ckpt")  # 6 steps per epoch; checkpoints after step 4 and at the cell's last step, 6
    opts = dict(model="sched_ckpt", data="step_data", batch_size=16, seed=4, progress="none", quiet=True)
    first = dist_session.train(BODY, epochs=1, optimizer="sgd", lr=0.2, lr_schedule="linear", warmup_steps=2,
                               checkpoint_dir=str(tmp_path), checkpoint_every=4, **opts)
    want = stepping.lr_sequence("linear", 0.2, 2, 6)
    assert [v for _, v in first.lr_history] == pytest.approx(want)
    dist_session.restart(quiet=True)
    from distnb import session

    import shutil

    shutil.rmtree(tmp_path / "step_00000006")  # as if the engines died after step 4's checkpoint
    session.current().holdings.trained_steps.pop("sched_ckpt")  # ... and the notebook never got step 6's weights
    result = session.current().train(BODY, epochs=1, checkpoint_dir=str(tmp_path), **opts)
    assert result.rows[0]["resumed"].endswith("step_00000004")
    assert [v for _, v in result.lr_history] == pytest.approx(want[4:])  # the schedule went on where it was


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # fsdp: with a MixedPrecisionPolicy
def test_bf16_trains_to_a_loss_bound_with_fp32_weights_back(dist_session, shell, strategy):
    name = f"bf16_{strategy}"
    fresh(shell, name)
    result = dist_session.train(BODY, model=name, data="step_data", epochs=15, batch_size=16, precision="bf16",
                                optimizer="adam", lr=0.02, seed=4, strategy=strategy, progress="none", quiet=True)
    assert result.final_loss < 0.35 and result.epoch_losses[0] > result.final_loss
    assert all(p.dtype == torch.float32 for p in shell.user_ns[name].parameters())
    dist_session.run(f"_dt = sorted({{str(p.dtype) for p in {name}.parameters()}})")
    assert dist_session.pull("_dt") == [["torch.float32"], ["torch.float32"]]  # master weights stay fp32


def test_after_backward_runs_once_per_optimizer_step_with_complete_gradients(dist_session, shell):
    fresh(shell, "hooked")
    body = ("x, y = batch\nloss = F.cross_entropy(model(x), y)\n"
            "ctx.after_backward(lambda: seen.append(float(sum(p.grad.norm() ** 2 for p in model.parameters()))))")
    dist_session.run("seen = []")
    result = dist_session.train(body, model="hooked", data="step_data", epochs=1, batch_size=8, accumulate=3,
                                optimizer="sgd", lr=0.1, seed=4, progress="none", quiet=True)
    seen = dist_session.pull("seen")
    assert len(seen[0]) == result.optimizer_steps == 4
    assert seen[0] == pytest.approx(seen[1])  # reduced gradients: the same on both ranks


def test_a_clip_call_in_the_body_warns_naming_the_option(dist_session, shell):
    fresh(shell, "warned")
    shell.user_ns["torch"] = torch
    body = BODY + "\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
    with pytest.warns(UserWarning, match="--clip-grad-norm"):
        dist_session.train(body, model="warned", data="step_data", epochs=1, batch_size=32, progress="none",
                           quiet=True)


LOOP = """
for epoch in ctx.epochs():
    for x, y in ctx.loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        ctx.report(loss)
"""


def test_a_loop_body_gets_its_schedule_stepped_at_each_report(dist_session, shell):
    fresh(shell, "loop_sched")
    result = dist_session.train(LOOP, model="loop_sched", data="step_data", epochs=1, batch_size=16, loop=True,
                                optimizer="sgd", lr=0.3, lr_schedule="linear", progress="none", quiet=True)
    assert [v for _, v in result.lr_history] == pytest.approx(stepping.lr_sequence("linear", 0.3, 0, 6))


LOOP_EVERY_SECOND_REPORT = """
for epoch in ctx.epochs():
    for i, (x, y) in enumerate(ctx.loader):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if i % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
        ctx.report(loss)
"""
LOOP_OWN_OPTIMIZER = LOOP.replace("for epoch", "optimizer = torch.optim.SGD(model.parameters(), lr=0.05)\nfor epoch", 1)


def test_a_loop_body_s_optimizer_steps_are_the_steps_it_took(dist_session, shell, capsys):
    """optimizer_steps of a --loop cell counts the body's optimizer.step() calls (it said 0), its own optimizer's too."""
    shell.user_ns["torch"] = torch
    fresh(shell, "loop_steps")  # 192 samples: 96 per rank, 6 batches of 16 per epoch
    result = dist_session.train(LOOP, model="loop_steps", data="step_data", epochs=2, batch_size=16, loop=True,
                                optimizer="sgd", lr=0.1, progress="none", quiet=True)
    assert result.rows[0]["steps"] == 12 and result.optimizer_steps == 12
    assert [s for s, _ in result.lr_history] == list(range(1, 13))  # each optimizer step's lr, numbered across it
    result = dist_session.train(LOOP_EVERY_SECOND_REPORT, model="loop_steps", data="step_data", epochs=1,
                                batch_size=16, loop=True, progress="none", quiet=True)
    assert result.rows[0]["steps"] == 6 and result.optimizer_steps == 3
    result = dist_session.train(LOOP_OWN_OPTIMIZER, model="loop_steps", data="step_data", epochs=1, batch_size=16,
                                loop=True, progress="none", quiet=True)
    assert result.optimizer_steps == 6
    capsys.readouterr()
    result = dist_session.train(LOOP.replace("        optimizer.step()\n", ""), model="loop_steps", data="step_data",
                                epochs=1, batch_size=16, loop=True, progress="none")
    assert result.optimizer_steps == 0
    assert "the --loop body reported 6 steps but no optimizer stepped" in capsys.readouterr().out


LOOP_NO_EPOCHS = """
for x, y in ctx.loader:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    ctx.report(loss)
"""


def test_a_loop_body_without_ctx_epochs_keeps_the_epoch_count_and_says_epochs_went_unused(dist_session, shell,
                                                                                          capsys):
    """Only ctx.epochs() runs --epochs and moves the epoch count: a body that walks ctx.loader alone leaves it (it
    advanced by one per full pass, at the next cell), and an explicit --epochs it ignored is named."""
    fresh(shell, "loop_no_epochs")
    capsys.readouterr()
    result = dist_session.train(LOOP_NO_EPOCHS, model="loop_no_epochs", data="step_data", epochs=3, batch_size=16,
                                loop=True, progress="none")
    out = capsys.readouterr().out
    assert result.epochs == [] and result.rows[0]["steps"] == 6
    assert ("--epochs 3 was not used: the --loop body never iterated ctx.epochs(), so it ran only the passes it "
            "writes itself and loop_no_epochs stays at epoch 0; to run 3 epochs, loop `for epoch in ctx.epochs():` "
            "around `for batch in ctx.loader:`") in out
    result = dist_session.train(LOOP_NO_EPOCHS, model="loop_no_epochs", data="step_data", batch_size=16, loop=True,
                                progress="none")
    assert "was not used" not in capsys.readouterr().out  # --epochs not given: nothing to say
    assert result.rows[0]["first_epoch"] == result.rows[0]["next_epoch"] == 0
    result = dist_session.train(LOOP, model="loop_no_epochs", data="step_data", epochs=2, batch_size=16, loop=True,
                                progress="none")
    assert result.epochs == [0, 1] and result.rows[0]["steps"] == 12
    assert "was not used" not in capsys.readouterr().out


def test_rows_carry_the_ranks_cpu_seconds_not_their_wall_time(dist_session, shell):
    """``cpu_seconds`` (benchmarks/char_transformers.py's load-proof figure) is CPU time: a step that sleeps adds none."""
    fresh(shell, "cpu_time")  # 192 samples: 12 steps of 8 per rank, each sleeping 50 ms (0.6 s per rank)
    result = dist_session.train("import time\ntime.sleep(0.05)\n" + BODY, model="cpu_time", data="step_data",
                                epochs=1, batch_size=8, progress="none", quiet=True)
    for row in result.rows:
        assert row["steps"] == 12
        assert 0.0 < row["cpu_seconds"] < row["seconds"] - 0.3, row  # the 0.6 s asleep is wall time only


COUNT_COLLECTIVES = """
import sys
import torch.distributed.distributed_c10d as _c10d
_counts = {"sync": 0, "async": 0}
_names = {"all_reduce", "broadcast", "barrier", "all_gather", "reduce", "all_gather_into_tensor"}
def _count(frame, event, arg):  # sees every call of c10d's Python functions, however dist.* is wrapped
    code = frame.f_code
    if event == "call" and code.co_name in _names and code.co_filename == _c10d.__file__:
        _counts["async" if frame.f_locals.get("async_op") else "sync"] += 1
sys.setprofile(_count)
"""


def test_a_ddp_step_adds_no_synchronous_collective_of_the_loop(dist_session, shell):
    """The loop's own blocking collectives are per cell and epoch, never per step (issue 17: a per-step sync
    costs every step a wait for the slowest rank). DDP's gradient all-reduce is C++ (not counted here); the
    stop check is asynchronous. Twice the steps per epoch must give the same number of blocking calls."""
    fresh(shell, "sync_count")  # 192 samples: 96 per rank
    train = dict(model="sync_count", data="step_data", epochs=1, optimizer="adam", lr=0.01, progress="none",
                 quiet=True)
    dist_session.train(BODY, batch_size=8, **train)  # builds DDP and the optimizer (their set-up syncs)
    dist_session.run(COUNT_COLLECTIVES)
    try:
        counts = []
        for batch_size in (8, 4):  # 12, then 24 steps per rank
            dist_session.run("_counts.update({\"sync\": 0, \"async\": 0})")
            result = dist_session.train(BODY, batch_size=batch_size, **train)
            assert [r["steps"] for r in result.rows] == [96 // batch_size] * 2
            counts.append(dist_session.pull("_counts"))
    finally:
        dist_session.run("sys.setprofile(None)")
    assert all(c[0]["async"] >= 1 for c in counts), counts  # the counter sees the loop's (async) stop checks
    assert counts[0][0]["sync"] == counts[1][0]["sync"], counts
    assert counts[0][0]["sync"] <= 4, counts  # the epoch's mean loss, not one per step
