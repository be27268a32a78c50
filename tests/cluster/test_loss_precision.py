"""A low-precision (bf16) loss tensor: reduced and reported in fp32, and said once."""

import math

import torch
import torch.nn.functional as F

from support.data import parity_data, parity_model

BF16_BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y).bfloat16()"


def test_a_bf16_loss_is_reduced_in_fp32_and_the_upcast_is_said_once(dist_session, shell, capsys):
    ns = shell.user_ns
    ns["lp_net"], ns["lp_data"], ns["lp_val"], ns["F"] = parity_model(), parity_data(n=96), parity_data(40, 5), F
    capsys.readouterr()
    result = dist_session.train(BF16_BODY, model="lp_net", data="lp_data", val_data="lp_val", epochs=2,
                                batch_size=16, optimizer="sgd", lr=0.1, progress="none")
    out = capsys.readouterr().out
    assert result.loss_dtype == "bfloat16"
    assert out.count("the body's loss is a bfloat16 tensor: distnb upcast it to float32 to reduce and log it") == 1
    for rank, history in result.loss_history.items():  # each step's value is the bf16 loss, exactly
        assert all(torch.tensor(v, dtype=torch.bfloat16).item() == v for _, v in history), rank
    per_step = {s: [dict(h)[s] for h in result.loss_history.values()] for s, _ in result.loss_history[0]}
    steps = sorted(per_step)
    last_epoch = steps[len(steps) // 2:]  # 2 epochs of 3 steps: the epoch mean is over every rank's steps, in fp64
    expected = math.fsum(v for s in last_epoch for v in per_step[s]) / (2 * len(last_epoch))
    assert abs(result.epoch_losses[-1] - expected) < 1e-6
    assert torch.tensor(result.epoch_losses[-1], dtype=torch.bfloat16).item() != result.epoch_losses[-1]
    assert result.val_loss is not None and math.isfinite(result.val_loss)
    fp32 = dist_session.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", model="lp_net", data="lp_data",
                              epochs=1, batch_size=16, optimizer="sgd", lr=0.1, progress="none")
    assert fp32.loss_dtype is None and "upcast" not in capsys.readouterr().out


def test_a_bf16_loss_under_pipeline_is_said_too(dist_session, shell, capsys):
    # the last stage computes the loss and sums the microbatches' in fp64; rank 0's notes said nothing of it
    ns = shell.user_ns
    ns["lp_pipe"], ns["lp_data"], ns["F"] = parity_model(), parity_data(n=96), F
    capsys.readouterr()
    result = dist_session.train(BF16_BODY, model="lp_pipe", data="lp_data", epochs=1, batch_size=16, optimizer="sgd",
                                lr=0.1, strategy="pipeline", microbatches=2, progress="none")
    assert result.loss_dtype == "bfloat16"
    assert capsys.readouterr().out.count("the body's loss is a bfloat16 tensor: distnb upcast it to float32") == 1
