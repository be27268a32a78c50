"""A refused or failed training cell leaves no state behind that changes what later cells do.

- The options a later cell keeps "as in the last cell" come from a cell the ranks accepted, never from
  one whose plan they refused (before, a refused ``--strategy tensor --tp-plan`` cell's options were taken
  again, and failed again, by the next cell that left them out).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.core.errors import RankError

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
QUIET = dict(progress="none", quiet=True)


def data(n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long())


def normed():
    """fc1 -> mean over the hidden units -> fc2: a tensor plan that splits the hidden units changes its forward."""

    class Normed(nn.Module):  # defined here: it travels to the ranks by value
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 3)

        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(torch.relu(h - h.mean(-1, keepdim=True)))

    torch.manual_seed(1)
    return Normed()


def records(session) -> dict:
    """The kernel's records of what the ranks hold and what carries over, as text (they hold tensors)."""
    held = session.holdings
    return {what: repr(getattr(held, what)) for what in ("models", "distributed", "data", "pushed", "names", "carried",
                                                         "lr_of", "trained_steps")}


def rank_names(session) -> list:
    """Each rank's engine namespace: its names (the engines' own underscore names left out)."""
    return session.run("sorted(k for k in globals() if not k.startswith('_'))")


def test_a_refused_cells_options_do_not_carry_over(dist_session, shell, capsys):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    ns = shell.user_ns
    ns["rc_tp"], ns["rc_data"], ns["F"] = normed(), data(), F
    ns["rc_tp_plan"] = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    dist_session.train(BODY, model="rc_tp", data="rc_data", epochs=1, batch_size=32, optimizer="sgd", lr=0.1, seed=3,
                       **QUIET)
    with pytest.raises(RankError, match="--tp-plan rc_tp_plan changes what the model computes"):
        dist_session.train(BODY, model="rc_tp", data="rc_data", epochs=1, batch_size=32, optimizer="adam", lr=0.01,
                           seed=3, strategy="tensor", tp_plan="rc_tp_plan", **QUIET)
    assert dist_session.holdings.carried["rc_tp"]["strategy"] == "ddp"
    capsys.readouterr()
    # the next cell leaves the options out: those of the last cell that ran (ddp, sgd), not of the refused one
    result = dist_session.train(BODY, model="rc_tp", data="rc_data", epochs=1, batch_size=32, seed=3,
                                progress="none")
    out = capsys.readouterr().out
    assert "distnb: --optimizer sgd, as in rc_tp's last cell" in out and "--tp-plan" not in out, out
    assert (result.plan.strategy, result.plan.tp_plan, result.plan.optimizer) == ("ddp", None, "sgd")
    dist_session.run("_rc_opt = type(optimizer).__name__")
    assert dist_session.pull("_rc_opt", rank=0) == "SGD"
