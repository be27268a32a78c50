"""Token-weighted losses (issue 36, item 8) on the real 2-rank cluster, against one process on the whole batch.

The body sums its loss over the valid tokens of padded sequences and says how many with
``ctx.num_items``; distnb divides by the count over the accumulation group's micro-steps and the
ranks. Every split of the same global batch of 16 (2 ranks x 4 x accumulate 2, 2 x 8 x 1, and one
data shard x 4 x accumulate 4 under tensor parallelism) must give the update one process makes
on those 16 sequences with the mean over their valid tokens, to 1e-6. The padding is uneven (1 to
10 valid tokens of 10), so the mean of per-micro-batch means is measurably off.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from support.reference import reference
from support.tokens import MEANS, SUMMED, padded_tokens, token_mean, token_model

TOL = dict(atol=1e-6, rtol=1e-6)


def fresh(shell, name):
    ns = shell.user_ns
    ns[name], ns["tokens"], ns["F"] = token_model(), padded_tokens(), F
    return token_model()


def max_diff(model, ref):
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("strategy,num_shards,batch_size,accumulate", [
    ("ddp", 2, 4, 2), ("ddp", 2, 8, 1), ("fsdp", 2, 4, 2), ("tensor", 1, 4, 4), ("fsdp+tensor:2x1", 2, 4, 2),
    ("fsdp+tensor:1x2", 1, 4, 4)])
def test_token_weighted_loss_equals_one_process_on_the_whole_batch(dist_session, shell, strategy, num_shards,
                                                                   batch_size, accumulate):
    strategy, _, mesh = strategy.partition(":")
    name = f"tok_{strategy}_{mesh}_{batch_size}_{accumulate}".replace("+", "_")
    ref = fresh(shell, name)
    result = dist_session.train(SUMMED, model=name, data="tokens", epochs=2, batch_size=batch_size,
                                accumulate=accumulate, optimizer="sgd", lr=0.5, seed=4, strategy=strategy,
                                progress="none", quiet=True, **({"mesh": mesh} if mesh else {}))
    reference(ref, shell.user_ns["tokens"], num_shards=num_shards, batch_size=batch_size, epochs=2, seed=4,
              optimizer=torch.optim.SGD, lr=0.5, accumulate=accumulate, loss_fn=token_mean)
    for (pname, p), q in zip(shell.user_ns[name].named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=lambda m: f"{pname}: {m}")
    assert result.token_weighted and result.loss_convention is None
    assert any("token-weighted" in n for n in result.step_notes)


def test_the_mean_of_micro_batch_means_is_measurably_off_and_says_its_convention(dist_session, shell):
    ref = fresh(shell, "tok_naive")
    result = dist_session.train(MEANS, model="tok_naive", data="tokens", epochs=2, batch_size=4, accumulate=2,
                                optimizer="sgd", lr=0.5, seed=4, progress="none", quiet=True)
    reference(ref, shell.user_ns["tokens"], num_shards=2, batch_size=4, epochs=2, seed=4,
              optimizer=torch.optim.SGD, lr=0.5, accumulate=2, loss_fn=token_mean)
    assert max_diff(shell.user_ns["tok_naive"], ref) > 1e-3  # what ctx.num_items fixes
    assert not result.token_weighted
    assert "mean per micro-batch, then averaged over micro-steps and ranks" in result.loss_convention


def test_the_logged_loss_and_the_validation_loss_are_token_weighted_means(dist_session, shell):
    fresh(shell, "tok_logged")
    shell.user_ns["tokens_val"] = val = padded_tokens(n=37, seed=5)
    model, data = token_model(), shell.user_ns["tokens"]
    with torch.no_grad():
        want = float(token_mean(model(data.tensors[0]), data.tensors[1]))  # lr 0: the weights never move
        want_val = float(token_mean(model(val.tensors[0]), val.tensors[1]))
        per_batch = float(token_mean(model(data.tensors[0][:4]), data.tensors[1][:4]))
    result = dist_session.train(SUMMED, model="tok_logged", data="tokens", val_data="tokens_val", epochs=1,
                                batch_size=4, accumulate=2, optimizer="sgd", lr=0.0, seed=4, progress="none",
                                quiet=True)
    assert result.epoch_losses[0] == pytest.approx(want, rel=1e-6)
    assert result.final_loss == pytest.approx(want, rel=1e-6)
    assert result.val_loss == pytest.approx(want_val, rel=1e-6)
    first_step = [v for _, v in result.loss_history[0]][0]  # a step's figure: its own sum over its own count
    assert math.isfinite(first_step) and 0 < first_step < 10 and per_batch > 0


def test_num_items_on_some_ranks_only_is_an_error_on_every_rank_and_the_cluster_goes_on(dist_session, shell):
    fresh(shell, "tok_half")
    body = SUMMED.replace("ctx.num_items = ", "if ctx.rank == 0:\n    ctx.num_items = ")
    with pytest.raises(Exception, match="ctx.num_items was set on"):
        dist_session.train(body, model="tok_half", data="tokens", epochs=1, batch_size=4, accumulate=2,
                           optimizer="sgd", lr=0.1, seed=4, progress="none", quiet=True)
    result = dist_session.train(SUMMED, model="tok_half", data="tokens", epochs=1, batch_size=4, optimizer="sgd",
                                lr=0.1, seed=4, progress="none", quiet=True)
    assert result.token_weighted


@pytest.mark.parametrize("strategy,words", [("pipeline", "not available with --strategy pipeline"),
                                            ("ps", "not available with --strategy ps")])
def test_num_items_is_refused_where_it_cannot_apply(dist_session, shell, strategy, words):
    name = f"tok_refused_{strategy}"
    fresh(shell, name)
    with pytest.raises(Exception, match=words):
        dist_session.train(SUMMED, model=name, data="tokens", epochs=1, batch_size=4, optimizer="sgd", lr=0.1,
                           seed=4, strategy=strategy, progress="none", quiet=True)


def test_num_items_is_refused_in_a_loop_body(dist_session, shell):
    fresh(shell, "tok_loop")
    body = ("for batch in ctx.loader:\n"
            "    x, y = batch\n"
            "    ctx.num_items = (y != -100).sum()\n")
    with pytest.raises(Exception, match="with --loop the body runs backward itself"):
        dist_session.train(body, model="tok_loop", data="tokens", epochs=1, batch_size=4, loop=True,
                           optimizer="sgd", lr=0.1, seed=4, progress="none", quiet=True)


def test_the_convention_is_stated_once_per_session_and_a_weighted_cell_says_what_it_did(dist_session, shell, capsys):
    fresh(shell, "tok_said")
    dist_session.loss_convention_said = False  # as in a new session
    for _ in range(2):
        dist_session.train(MEANS, model="tok_said", data="tokens", epochs=1, batch_size=8, seed=4, progress="none")
    out = capsys.readouterr().out
    assert out.count("distnb: loss: the body's loss is taken as a mean per micro-batch, then averaged over "
                     "micro-steps and ranks") == 1
    dist_session.train(SUMMED, model="tok_said", data="tokens", epochs=1, batch_size=8, seed=4, progress="none")
    out = capsys.readouterr().out
    assert "mean per micro-batch" not in out and "distnb: loss: token-weighted (ctx.num_items)" in out


def test_a_weighted_group_dropped_by_nan_skip_leaves_the_counts_of_the_next_ones_alone(dist_session, shell):
    """The dropped group's count all-reduce (started before its last backward) is finished and discarded."""
    ref = fresh(shell, "tok_nan")
    body = SUMMED + "if ctx.rank == 1 and ctx.step == 2 and ctx.micro_step == 1:\n    loss = loss * float('nan')\n"
    result = dist_session.train(body, model="tok_nan", data="tokens", epochs=1, batch_size=4, accumulate=2,
                                nan="skip", optimizer="sgd", lr=0.0, seed=4, progress="none", quiet=True)
    assert result.skipped == [dict(step=3, micro_steps=[5, 6], ranks=[1])]
    assert result.optimizer_steps == 96 // 16 - 1 and result.token_weighted
    assert max_diff(shell.user_ns["tok_nan"], ref) == 0.0  # lr 0: nothing moved, nothing went NaN
