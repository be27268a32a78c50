"""Replicas checked for silent drift (--check-replicas): a copy that one rank changed is named, never trained on."""

import re

import pytest
import torch
import torch.nn.functional as F

from distnb.core.errors import PlanError, RankError
from support.data import parity_data, parity_model

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
#: At step 5, rank 1 alone adds noise to a weight: DDP's all-reduce keeps the gradients equal, so the copies
#: stay apart from then on, and nothing in torch notices.
NOISY = ("if ctx.rank == 1 and ctx.step == 4:\n"
         "    with torch.no_grad():\n"
         "        model.module[2].weight.add_(1e-3 * torch.randn_like(model.module[2].weight))\n") + BODY


def _fresh(shell, name):
    shell.user_ns[name], shell.user_ns["drift_data"], shell.user_ns["F"] = parity_model(), parity_data(), F
    shell.user_ns["torch"] = torch


def test_a_parameter_changed_on_one_rank_is_named_at_the_epochs_end_with_the_rank_and_the_difference(dist_session, shell):
    _fresh(shell, "drift_net")
    with pytest.raises(RankError) as info:
        dist_session.train(NOISY, model="drift_net", data="drift_data", epochs=2, batch_size=16, lr=0.1,
                           progress="none", quiet=True)
    text = str(info.value)
    assert "replicas drifted apart at the end of epoch 0: 2.weight: rank 1's copy differs from rank 0's" in text, text
    assert "either may be the one that changed" in text  # two copies: no majority says which one moved
    largest = float(text.split("largest difference ")[1].split()[0].rstrip(";."))
    assert 1e-5 < largest < 1e-2  # the noise (1e-3 x a normal sample), not a garbage figure
    # the cluster stays usable: the next cell (the notebook's model sent again) trains and the check passes
    r = dist_session.train(BODY, model="drift_net", data="drift_data", epochs=1, batch_size=16, lr=0.1, reset=True,
                           progress="none", quiet=True)
    assert r.epochs == [0] or len(r.epochs) == 1


def test_step_mode_names_the_optimizer_step_and_off_trains_on(dist_session, shell):
    _fresh(shell, "drift_step_net")
    with pytest.raises(RankError, match=r"replicas drifted apart after optimizer step 5: 2\.weight"):
        dist_session.train(NOISY, model="drift_step_net", data="drift_data", epochs=1, batch_size=16, lr=0.1,
                           check_replicas="step", progress="none", quiet=True)
    _fresh(shell, "drift_off_net")
    r = dist_session.train(NOISY, model="drift_off_net", data="drift_data", epochs=1, batch_size=16, lr=0.1,
                           check_replicas="off", progress="none", quiet=True)
    assert [row["steps"] for row in r.rows] == [7, 7]  # trained on: the user turned the check off


def test_a_copy_changed_between_cells_is_named_before_the_next_cells_first_step(dist_session, shell):
    _fresh(shell, "drift_between_net")
    dist_session.train(BODY, model="drift_between_net", data="drift_data", epochs=1, batch_size=16, lr=0.1,
                       progress="none", quiet=True)
    dist_session.run("if rank == 0:\n    import torch\n    with torch.no_grad():\n"
                     "        drift_between_net[0].bias[3] += 0.5")
    with pytest.raises(RankError, match=r"before the cell's first step: 0\.bias: rank 1's copy differs from rank "
                                        r"0's, largest difference 0\.5 \(no majority of equal copies: either may be "
                                        r"the one that changed\)"):
        dist_session.train(BODY, model="drift_between_net", data="drift_data", epochs=1, batch_size=16, lr=0.1,
                           progress="none", quiet=True)


def test_tensor_parallel_checks_the_layers_it_leaves_whole(dist_session, shell):
    """Under --strategy tensor every rank trains the same batches: the unsharded layers are copies too."""
    _fresh(shell, "drift_tp_net")
    r = dist_session.train(BODY, model="drift_tp_net", data="drift_data", epochs=1, batch_size=16, lr=0.1,
                           strategy="tensor", progress="none", quiet=True)
    assert len(r.epochs) == 1  # equal copies pass the check
    from distnb.engine.train import replicas
    from distnb.engine.strategies.tensor import Tensor

    assert Tensor.replicas and replicas.MODES == ("off", "epoch", "step")


def test_a_bad_mode_is_refused_before_anything_is_sent(dist_session, shell):
    _fresh(shell, "drift_bad_net")
    with pytest.raises(PlanError, match="check_replicas|check-replicas"):
        dist_session.train(BODY, model="drift_bad_net", data="drift_data", check_replicas="always", progress="none")


def test_the_tensor_and_its_difference_come_first_in_the_ranks_one_line_error(dist_session, shell):
    """The text progress shows each rank's error cut at 300 characters: the tensor, the rank and the difference come
    within the first 200 (the tester saw 'largest difference ' cut before its number)."""
    _fresh(shell, "drift_cause_net")
    body = ("if ctx.rank == 1 and ctx.step == 2:\n    with torch.no_grad():\n"
            "        model.module[2].bias[0] += 0.25\n") + BODY
    with pytest.raises(RankError) as info:
        dist_session.train(body, model="drift_cause_net", data="drift_data", epochs=1, batch_size=16, lr=0.1,
                           progress="none", quiet=True)
    line = str(info.value).split("RuntimeError: ", 1)[1]
    head = re.match(r"rank \d: replicas drifted apart at the end of epoch 0: 2\.bias: rank 1's copy differs from "
                    r"rank 0's, largest difference 0\.25", line)
    assert head is not None and head.end() < 200, line


def test_the_tensor_that_differs_most_is_named_first():
    from distnb.engine.train import replicas

    text = replicas._message([(3.7e-4, "c.weight", "rank 1's copy differs from rank 0's", True),
                              (0.25, "c.bias", "rank 1's copy differs from rank 0's", True)], 3, "at the end of epoch 0")
    assert ": c.bias: rank 1's copy differs from rank 0's, largest difference 0.25 (no majority" in text
    assert "; also c.weight (0.00037), 1 more." in text
