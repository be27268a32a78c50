"""Validation until converged on the real 2-rank cluster: exact figures, early stopping, the best weights.

The check of the issue: the accuracy (and loss) distnb reports equal what the notebook computes
from the returned weights on the same set, for a validation set whose shards differ in length
(one rank pads with a masked sample) and for every strategy that validates.
"""

import pytest
import torch
import torch.nn.functional as F

from distnb.core.errors import PlanError, RankError
from support.data import parity_data, parity_model

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


def setup(shell, name, n_val=65):
    ns = shell.user_ns
    ns[name], ns["val_train"], ns["F"] = parity_model(), parity_data(n=192), F
    ns["val_set"] = parity_data(n=n_val, seed=7)


def notebook_figures(model, data):
    x, y = data.tensors
    with torch.no_grad():
        out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(-1) == y).float().mean().item()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tensor", "ps", "pipeline"])
def test_reported_figures_equal_the_notebooks_on_the_returned_weights(dist_session, shell, strategy):
    name = f"val_{strategy}"
    setup(shell, name)  # 65 validation samples: shards of 33 and 32; rank 1 pads its 3rd forward (masked)
    result = dist_session.train(BODY, model=name, data="val_train", val_data="val_set", epochs=3, batch_size=16,
                                optimizer="adam", lr=0.01, seed=4, strategy=strategy, progress="none", quiet=True)
    assert [e["epoch"] for e in result.val_history] == [0, 1, 2]
    assert all(e["samples"] == 65 for e in result.val_history)  # every sample counted once, the pad never
    loss, acc = notebook_figures(shell.user_ns[name], shell.user_ns["val_set"])
    assert result.val_metric == pytest.approx(acc, abs=1e-6) and result.metric_name == "accuracy"
    assert result.val_loss == pytest.approx(loss, rel=1e-5)
    assert "validation loss" in result.title and not result.converged and result.stop_reason == "epochs"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_batchnorm_statistics_validated_are_the_ones_the_notebook_gets(dist_session, shell, strategy):
    # each rank's BatchNorm running statistics follow its own shard; the notebook gets rank 0's
    name = f"val_bn_{strategy}"
    setup(shell, name)
    torch.manual_seed(3)
    shell.user_ns[name] = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                              torch.nn.Linear(16, 3))
    result = dist_session.train(BODY, model=name, data="val_train", val_data="val_set", epochs=2, batch_size=16,
                                optimizer="adam", lr=0.01, seed=4, strategy=strategy, progress="none", quiet=True)
    model = shell.user_ns[name].eval()
    loss, acc = notebook_figures(model, shell.user_ns["val_set"])
    assert result.val_loss == pytest.approx(loss, rel=1e-5) and result.val_metric == pytest.approx(acc, abs=1e-6)


def test_a_notebook_metric_and_a_validation_every_two_epochs(dist_session, shell):
    setup(shell, "val_metric")
    shell.user_ns["abs_error"] = lambda out, y: (out.argmax(-1) - y).abs().float()  # per-sample scores
    result = dist_session.train(BODY, model="val_metric", data="val_train", val_data="val_set", epochs=5,
                                val_every=2, metric="abs_error", batch_size=16, optimizer="adam", lr=0.01,
                                progress="none", quiet=True)
    assert [e["epoch"] for e in result.val_history] == [1, 3, 4]  # every 2nd epoch and the cell's last
    x, y = shell.user_ns["val_set"].tensors
    with torch.no_grad():
        want = (shell.user_ns["val_metric"](x).argmax(-1) - y).abs().float().mean().item()
    assert result.val_metric == pytest.approx(want, abs=1e-6) and result.metric_name == "abs_error"


def test_patience_stops_when_the_validation_loss_stops_improving(dist_session, shell):
    setup(shell, "val_patience")
    result = dist_session.train(BODY, model="val_patience", data="val_train", val_data="val_set", epochs=20,
                                patience=2, batch_size=16, optimizer="sgd", lr=1e-9, progress="none", quiet=True)
    assert len(result.val_history) == 3 and result.epochs == [0, 1, 2]  # no improvement after the first
    assert result.converged and result.stop_reason == "patience" and result.stopped_early
    assert "converged" in result.title


def test_target_loss_applies_to_the_validation_loss(dist_session, shell, capsys):
    setup(shell, "val_target")
    result = dist_session.train(BODY, model="val_target", data="val_train", val_data="val_set", epochs=40,
                                target_loss=0.6, batch_size=16, optimizer="adam", lr=0.02, progress="none")
    assert "--target-loss 0.6 watches the validation loss (--val-data val_set), not the training loss" in \
        capsys.readouterr().out
    assert result.converged and result.stop_reason == "target"
    assert result.val_loss <= 0.6 and all(e["loss"] > 0.6 for e in result.val_history[:-1])
    assert len(result.epochs) < 40


def test_restore_best_loads_the_best_validation_weights_back(dist_session, shell):
    setup(shell, "val_best")
    # a learning rate that overshoots after a few epochs: the last weights are not the best ones
    result = dist_session.train(BODY, model="val_best", data="val_train", val_data="val_set", epochs=8,
                                restore_best=True, batch_size=16, optimizer="sgd", lr=6.0, progress="none",
                                quiet=True)
    best = min(result.val_history, key=lambda e: e["loss"])
    assert result.restored_best and result.best_epoch == best["epoch"]
    loss, _ = notebook_figures(shell.user_ns["val_best"], shell.user_ns["val_set"])
    assert loss == pytest.approx(best["loss"], rel=1e-5)
    assert best is not result.val_history[-1]  # it did overshoot: the result's figures are the best one's
    assert (result.val_loss, result.val_metric) == (best["loss"], best["metric"])



def test_a_metric_that_raises_names_the_rank_and_the_cluster_stays_usable(dist_session, shell):
    setup(shell, "val_raise")

    def broken(out, y):
        raise ValueError("this metric is broken")

    shell.user_ns["broken"] = broken
    with pytest.raises(RankError) as info:
        dist_session.train(BODY, model="val_raise", data="val_train", val_data="val_set", metric="broken",
                           epochs=1, batch_size=16, progress="none", quiet=True)
    assert "this metric is broken" in str(info.value) and "--metric broken raised on rank" in str(info.value)
    assert info.value.rank in (0, 1)
    ok = dist_session.train(BODY, model="val_raise", data="val_train", val_data="val_set", epochs=1, batch_size=16,
                            progress="none", quiet=True)
    assert ok.val_history


def test_a_body_that_fails_on_a_validation_batch_says_it_was_one(dist_session, shell):
    setup(shell, "val_shape")
    x, y = parity_data(n=7, seed=3).tensors
    shell.user_ns["val_2d"] = (x, y[:, None])  # targets of shape (7, 1): cross_entropy refuses them
    with pytest.raises(RankError) as info:
        dist_session.train(BODY, model="val_shape", data="val_train", val_data="val_2d", epochs=1, batch_size=16,
                           progress="none", quiet=True)
    text = str(info.value)
    assert "on a --val-data val_2d batch (validation after epoch 0); the training batches ran" in text, text


def test_a_validation_dataset_changed_in_the_notebook_is_collated_and_sent_again(dist_session, shell):
    """Its holdings kept the Dataset's identity: after `val.shift = 50.0` the ranks validated on the set as it was."""
    setup(shell, "val_shift")
    shell.run_cell("import torch\nclass ValShifted(torch.utils.data.Dataset):\n    def __init__(self, x, y):\n"
                   "        self.x, self.y, self.shift = x, y, 0.0\n    def __len__(self):\n        return len(self.x)\n"
                   "    def __getitem__(self, i):\n        return self.x[i] + self.shift, self.y[i]")
    x, y = parity_data(n=16, seed=4).tensors
    ns = shell.user_ns
    ns["val_shifted"] = ns["ValShifted"](x, y)
    opts = dict(model="val_shift", data="val_train", val_data="val_shifted", epochs=1, batch_size=16, lr=1e-9,
                progress="none", quiet=True)
    before = dist_session.train(BODY, **opts).val_loss
    ns["val_shifted"].shift = 50.0
    after = dist_session.train(BODY, **opts).val_loss
    with torch.no_grad():
        expected = float(F.cross_entropy(ns["val_shift"](x + 50.0), y))
    assert after == pytest.approx(expected, rel=1e-4) and abs(after - before) > 0.1, (before, after, expected)


def test_bad_validation_options_are_plan_errors_before_anything_is_sent(dist_session, shell):
    setup(shell, "val_bad")
    shell.user_ns["not_data"] = "a string"
    opts = dict(model="val_bad", data="val_train", epochs=1, progress="none", quiet=True)
    with pytest.raises(PlanError, match="--val-data not_data is a str, not a data set"):
        dist_session.train(BODY, val_data="not_data", **opts)
    with pytest.raises(PlanError, match="--val-data 'nowhere' is not defined"):
        dist_session.train(BODY, val_data="nowhere", **opts)
    with pytest.raises(PlanError, match="--patience needs validation"):
        dist_session.train(BODY, patience=2, **opts)
    with pytest.raises(PlanError, match="--metric 'nope' is not defined"):
        dist_session.train(BODY, val_data="val_set", metric="nope", **opts)
    assert "val_bad" not in dist_session.holdings.models  # nothing was sent


def test_the_python_api_takes_the_validation_set_and_metric_as_objects(dist_session, shell):
    # objects with no notebook name (a new user's local variables): the same figures as names give
    setup(shell, "val_objects")
    held_out = parity_data(n=65, seed=7)

    def abs_error(out, y):
        return (out.argmax(-1) - y).abs().float()

    result = dist_session.train(BODY, model="val_objects", data="val_train", val_data=held_out, metric=abs_error,
                                epochs=2, batch_size=16, optimizer="adam", lr=0.01, progress="none", quiet=True)
    x, y = held_out.tensors
    with torch.no_grad():
        want = (shell.user_ns["val_objects"](x).argmax(-1) - y).abs().float().mean().item()
    assert result.val_metric == pytest.approx(want, abs=1e-6) and result.metric_name == "abs_error"
    assert len(result.val_history) == 2 and all(e["samples"] == 65 for e in result.val_history)
    shell.user_ns["nb_three"] = 3  # a notebook int is the same (interned) object: never taken as the one named
    with pytest.raises(PlanError, match=r"--val-data _distnb_val_data is a int, not a data set"):
        dist_session.train(BODY, model="val_objects", data="val_train", val_data=3, progress="none", quiet=True)
