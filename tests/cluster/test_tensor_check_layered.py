"""The tensor-plan check runs the whole model one module at a time (issue 34, item 2).

The check compared the split model with the whole one by gathering the whole state on every rank, so it
was skipped above ``VERIFY_MAX_BYTES`` (256 MiB) and, below it, doubled a rank's peak (1.95x torchrun's for
a meta model in benchmarks/memory.py). Now the whole model's forward fills one module's tensors at a time
(:mod:`distnb.engine.strategies.layered`): a model above the limit is still verified. Here the limit is
set to 1 KiB on the ranks, so every model below is "too big" for the old check.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.core.errors import RankError

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"

SMALL_LIMIT = """
from distnb.engine.strategies import tensor_check as _tc
_tc._saved_limit = getattr(_tc, "_saved_limit", _tc.VERIFY_MAX_BYTES)
_tc.VERIFY_MAX_BYTES = 1024
"""
RESTORE = """
from distnb.engine.strategies import tensor_check as _tc
_tc.VERIFY_MAX_BYTES = _tc._saved_limit
"""


def classes():
    class Meaned(nn.Module):
        """fc1 -> a mean over the hidden dim -> fc2: the default plan splits the mean (a wrong result)."""

        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 3)

        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(torch.relu(h - h.mean(-1, keepdim=True)))

    class Outside(nn.Module):
        """Reads ``norm.weight`` in its own forward, never calling ``norm``: it cannot run one module at a time."""

        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x * self.norm.weight)))

    return Meaned, Outside


def data(n=128):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long())


@pytest.fixture
def small_limit(dist_session):
    dist_session.run(SMALL_LIMIT)
    yield
    dist_session.run(RESTORE)


@pytest.mark.parametrize("strategy,mesh,meta", [("tensor", None, False), ("tensor", None, True),
                                                ("fsdp+tensor", "1x2", False)])
def test_a_wrong_plan_on_a_model_above_the_limit_is_still_caught(dist_session, shell, small_limit, strategy, mesh,
                                                                 meta):
    ns = shell.user_ns
    name = f"tcl_mean_{strategy.replace('+', '_')}_{int(meta)}"
    torch.manual_seed(1)
    with torch.device("meta" if meta else "cpu"):
        ns[name] = classes()[0]()
    ns["tcl_data"], ns["F"] = data(), F
    with pytest.raises(RankError, match=r"tensor plan changes what the model computes.*'fc1' \(column-wise\)"):
        dist_session.train(BODY, model=name, data="tcl_data", epochs=1, batch_size=32, optimizer="sgd", lr=0.1,
                           seed=3, strategy=strategy, mesh=mesh, progress="none", quiet=True)


def test_a_forward_reading_a_tensor_outside_its_module_falls_back_to_the_whole_model(dist_session, shell, capsys):
    ns = shell.user_ns
    torch.manual_seed(2)
    ns["tcl_outside"], ns["tcl_data"], ns["F"] = classes()[1](), data(), F
    dist_session.train(BODY, model="tcl_outside", data="tcl_data", epochs=1, batch_size=32, optimizer="sgd", lr=0.1,
                       seed=3, strategy="tensor", progress="none")  # small: checked on the whole model, and right
    assert "not verified" not in capsys.readouterr().out


def test_above_the_limit_such_a_forward_is_not_verified_and_says_why(dist_session, shell, small_limit, capsys):
    ns = shell.user_ns
    torch.manual_seed(2)
    ns["tcl_outside_big"], ns["tcl_data"], ns["F"] = classes()[1](), data(), F
    dist_session.train(BODY, model="tcl_outside_big", data="tcl_data", epochs=1, batch_size=32, optimizer="sgd",
                       lr=0.1, seed=3, strategy="tensor", progress="none")
    out = capsys.readouterr().out
    assert "is not verified against the whole model: its forward cannot run one module at a time" in out
