"""What a step can know and ask, and what the cell says it did (issue 36, items 9-11), on the real 2-rank cluster.

``ctx.epoch``, ``step``, ``micro_step``, ``global_step``, ``lr``, ``loss_scale``, ``grad_norm`` as the
body reads them; ``ctx.request_stop`` in a step body and in a ``--loop`` body; the notes on a short
last accumulation group, a step ``--nan skip`` dropped, bf16's missing loss scaling; fp16 with a
``torch.amp.GradScaler("cpu")`` against one process doing the same.
"""

import pytest
import torch
import torch.nn.functional as F

from support.data import parity_data, parity_model
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)\n"
RECORD = ("seen.append((ctx.epoch, ctx.step, ctx.micro_step, ctx.global_step, ctx.lr, ctx.loss_scale, "
          "ctx.grad_norm))\n")


def fresh(shell, name, n=192):
    ns = shell.user_ns
    ns[name], ns["ctx_data"], ns["F"] = parity_model(), parity_data(n=n), F
    return parity_model()


def test_ctx_exposes_the_steps_position_lr_and_norm(dist_session, shell):
    fresh(shell, "ctx_seen")  # 96 per rank, batches of 8: 12 micro-steps, 6 optimizer steps per epoch
    dist_session.run("seen = []")
    result = dist_session.train(RECORD + BODY, model="ctx_seen", data="ctx_data", epochs=2, batch_size=8,
                                accumulate=2, clip_grad_norm=1e9, lr_schedule="linear", optimizer="sgd",
                                lr=0.1, seed=4, progress="none", quiet=True)
    seen = dist_session.pull("seen")
    assert seen[0] == seen[1] and len(seen[0]) == 24
    epochs, steps, micro, global_steps, lrs, scales, norms = zip(*seen[0])
    assert epochs == (0,) * 12 + (1,) * 12
    assert micro == (0, 1) * 12
    assert steps == tuple(i // 2 for i in range(24)) == global_steps  # a fresh model: the cell's count is the model's
    assert [lrs[i] for i in range(0, 24, 2)] == pytest.approx([v for _, v in result.lr_history])
    assert set(scales) == {None}
    assert norms[:2] == (None, None)  # before the first optimizer step
    history = [v for _, v in result.grad_norm_history]
    assert [norms[i] for i in range(2, 24, 2)] == pytest.approx(history[:-1])  # the last pre-clip norm
    assert result.grad_norm == pytest.approx(history[-1])
    # a next cell: ctx.step counts this cell's steps, ctx.global_step the model's
    dist_session.run("seen = []")
    dist_session.train(RECORD + BODY, model="ctx_seen", data="ctx_data", epochs=1, batch_size=8, accumulate=2,
                       seed=4, progress="none", quiet=True)
    first = dist_session.pull("seen", rank=0)[0]
    assert (first[0], first[1], first[3]) == (2, 0, 12)


def test_request_stop_in_a_step_body_stops_every_rank_after_the_same_step(dist_session, shell):
    fresh(shell, "ctx_stop")
    body = "if ctx.rank == 1 and ctx.global_step == 3:\n    ctx.request_stop('loss plateaued')\n" + BODY
    result = dist_session.train(body, model="ctx_stop", data="ctx_data", epochs=5, batch_size=8, optimizer="sgd",
                                lr=0.1, seed=4, progress="none", quiet=True)
    steps = [r["steps"] for r in result.rows]
    assert steps[0] == steps[1] and 3 < steps[0] < 5 * 12
    assert result.stop_reason == "requested" and result.stopped_early and not result.interrupted
    request = result.stop_request
    assert request["ranks"] == [1] and request["reason"] == "loss plateaued" and request["asked_at"] == 3
    assert request["step"] == result.rows[0]["global_steps"] >= 4
    assert any("rank 1 asked to stop (ctx.request_stop: loss plateaued)" in n for n in result.step_notes)
    assert "stopped on request" in result.title
    # the position is kept: the next cell goes on, and the cluster is usable
    again = dist_session.train(BODY, model="ctx_stop", data="ctx_data", epochs=1, batch_size=8, seed=4,
                               progress="none", quiet=True)
    assert again.stop_reason == "epochs" and again.stop_request is None


def test_request_stop_in_a_loop_body(dist_session, shell):
    fresh(shell, "ctx_loop_stop")
    body = ("for epoch in ctx.epochs():\n"
            "    for x, y in ctx.loader:\n"
            "        optimizer.zero_grad()\n"
            "        loss = F.cross_entropy(model(x), y)\n"
            "        loss.backward()\n"
            "        optimizer.step()\n"
            "        if ctx.rank == 0 and ctx.step == 5:\n"
            "            ctx.request_stop('enough')\n"
            "        ctx.report(loss)\n")
    result = dist_session.train(body, model="ctx_loop_stop", data="ctx_data", epochs=5, batch_size=8, loop=True,
                                optimizer="sgd", lr=0.1, seed=4, progress="none", quiet=True)
    steps = [r["steps"] for r in result.rows]
    assert steps[0] == steps[1] and 5 <= steps[0] < 5 * 12
    assert result.stop_request["ranks"] == [0] and result.stop_request["reason"] == "enough"


def test_a_short_last_accumulation_group_is_said(dist_session, shell):
    fresh(shell, "ctx_short", n=160)  # 80 per rank: 10 batches of 8 -> groups of 4, 4, 2
    result = dist_session.train(BODY, model="ctx_short", data="ctx_data", epochs=1, batch_size=8, accumulate=4,
                                optimizer="sgd", lr=0.1, seed=4, progress="none", quiet=True)
    assert any(n.startswith("3 optimizer steps per epoch, the last of 2 micro-batches") for n in result.step_notes)
    full = dist_session.train(BODY, model="ctx_short", data="ctx_data", epochs=1, batch_size=8, accumulate=5,
                              seed=4, progress="none", quiet=True)
    assert not any("optimizer steps per epoch" in n for n in full.step_notes)


def test_a_step_dropped_by_nan_skip_is_named_with_its_ranks(dist_session, shell):
    fresh(shell, "ctx_nan")
    body = BODY + "if ctx.rank == 1 and ctx.step == 2 and ctx.micro_step == 1:\n    loss = loss * float('nan')\n"
    result = dist_session.train(body, model="ctx_nan", data="ctx_data", epochs=1, batch_size=8, accumulate=2,
                                nan="skip", optimizer="sgd", lr=0.1, seed=4, progress="none", quiet=True)
    assert result.skipped == [dict(step=3, micro_steps=[5, 6], ranks=[1])]
    assert result.optimizer_steps == 5
    note = next(n for n in result.step_notes if "--nan skip" in n)
    assert "optimizer step 3 of the cell (micro-steps 5-6: on rank 1)" in note


def test_bf16_says_it_runs_without_loss_scaling(dist_session, shell):
    fresh(shell, "ctx_bf16")
    result = dist_session.train(BODY, model="ctx_bf16", data="ctx_data", epochs=1, batch_size=32, precision="bf16",
                                optimizer="sgd", lr=0.1, seed=4, progress="none", quiet=True)
    assert any("bf16 autocast runs without loss scaling" in n for n in result.step_notes)
    assert result.loss_scale is None


def fp16_reference(model, data, *, num_shards, batch_size, epochs, seed, lr, blow_up_at=None):
    """One process on the global batches with CPU fp16 autocast and torch.amp.GradScaler("cpu")."""
    from distnb.engine.transport import shard

    opt, scaler = torch.optim.SGD(model.parameters(), lr=lr), torch.amp.GradScaler("cpu")
    x, y = data.tensors
    step = 0
    for epoch in range(epochs):
        for idx in shard.global_batches(len(x), num_shards, seed, epoch, batch_size, False):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x[idx]), y[idx])
            if step == blow_up_at:
                loss = loss * 1e30
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            step += 1
    return scaler


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp16_on_cpu_with_a_grad_scaler_matches_one_process(dist_session, shell, strategy):
    name = f"ctx_fp16_{strategy}"
    ref = fresh(shell, name)
    # rank 1's loss overflows at global step 2: every rank skips that step and halves the scale, as one process does
    body = BODY + "if ctx.rank == 1 and ctx.global_step == 2:\n    loss = loss * 1e30\n"
    result = dist_session.train(body, model=name, data="ctx_data", epochs=2, batch_size=16, precision="fp16",
                                optimizer="sgd", lr=0.1, seed=4, strategy=strategy, progress="none", quiet=True)
    scaler = fp16_reference(ref, shell.user_ns["ctx_data"], num_shards=2, batch_size=16, epochs=2, seed=4, lr=0.1,
                            blow_up_at=2)
    assert [r["loss_scale"] for r in result.rows] == [scaler.get_scale()] * 2 == [2.0 ** 15] * 2
    assert [r["scaler_skips"] for r in result.rows] == [1, 1]
    for p, q in zip(shell.user_ns[name].parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-3, rtol=1e-3)
    assert any("fp16 with a GradScaler: loss scale 32768 now; it skipped 1 optimizer step" in n
               for n in result.step_notes)


def test_fp16_ranks_agree_on_a_skip_when_one_ranks_gradients_overflow(dist_session, shell):
    """tensor: every rank back-propagates its own copy of the loss; rank 1's alone overflows, and both skip."""
    fresh(shell, "ctx_fp16_tp")
    body = BODY + "if ctx.rank == 1 and ctx.global_step == 1:\n    loss = loss * 1e30\n"
    result = dist_session.train(body, model="ctx_fp16_tp", data="ctx_data", epochs=1, batch_size=32,
                                precision="fp16", optimizer="sgd", lr=0.1, seed=4, strategy="tensor",
                                progress="none", quiet=True)
    assert [r["scaler_skips"] for r in result.rows] == [1, 1]
    assert [r["loss_scale"] for r in result.rows] == [2.0 ** 15] * 2
