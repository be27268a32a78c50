"""A refused or failed training cell leaves no state behind that changes what later cells do.

- The options a later cell keeps "as in the last cell" come from a cell the ranks accepted, never from
  one whose plan they refused (before, a refused ``--strategy tensor --tp-plan`` cell's options were taken
  again, and failed again, by the next cell that left them out).
- A cell refused before its model is placed leaves the kernel's record of how the ranks hold the model
  as it was (before, it claimed the refused cell's strategy, and the next cell sent the model again with
  "the last cell used fsdp", dropping the live optimizer's state).
- A cell the fit check refuses sends nothing first: the ranks' namespaces and the kernel's records are
  as before it (before, the body's names, the ``--val-data`` shards and the ``--optimizer`` function
  were sent first and stayed).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.core.errors import PlanError, RankError
from distnb.train import bigmodels

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
QUIET = dict(progress="none", quiet=True)


def data(n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long())


def normed():
    """Linear -> a LayerNorm over the hidden units -> Linear: a tensor plan that splits those units changes what it
    computes."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32, elementwise_affine=False), nn.Linear(32, 3))


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
    ns["rc_tp_plan"] = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    dist_session.train(BODY, model="rc_tp", data="rc_data", epochs=1, batch_size=32, optimizer="sgd", lr=0.1, seed=3,
                       **QUIET)
    carried = {k: v for k, v in records(dist_session).items() if k in ("carried", "lr_of", "trained_steps")}
    with pytest.raises(RankError, match="--tp-plan rc_tp_plan changes what the model computes"):
        dist_session.train(BODY, model="rc_tp", data="rc_data", epochs=1, batch_size=32, optimizer="adam", lr=0.01,
                           seed=3, strategy="tensor", tp_plan="rc_tp_plan", **QUIET)
    assert {k: v for k, v in records(dist_session).items() if k in carried} == carried  # no option, lr, step count
    capsys.readouterr()
    # the next cell leaves the options out: those of the last cell that ran (ddp, sgd), not of the refused one
    result = dist_session.train(BODY, model="rc_tp", data="rc_data", epochs=1, batch_size=32, seed=3,
                                progress="none")
    out = capsys.readouterr().out
    assert "distnb: --optimizer sgd, as in rc_tp's last cell" in out and "--tp-plan" not in out, out
    assert (result.plan.strategy, result.plan.tp_plan, result.plan.optimizer) == ("ddp", None, "sgd")
    dist_session.run("_rc_opt = type(optimizer).__name__")
    assert dist_session.pull("_rc_opt", rank=0) == "SGD"


@pytest.fixture(params=[False, True], ids=["in_kernel", "meta"])
def trained_ddp(request, dist_session, shell):
    """A model trained for an epoch with ddp and adam (held in the kernel, or on the meta device: its weights
    on the ranks only), and the names a refused fsdp cell of it reads; its name."""
    ns, name = shell.user_ns, "rc_fit_meta" if request.param else "rc_fit"
    torch.manual_seed(2)
    with torch.device("meta" if request.param else "cpu"):
        ns[name] = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    ns["rc_data"], ns["rc_val"], ns["F"] = data(), data(64, seed=1), F
    dist_session.train(BODY, model=name, data="rc_data", epochs=1, batch_size=32, optimizer="adam", lr=0.01, seed=3,
                       **QUIET)
    ns["rc_scale"] = 0.5  # read by the refused cell's body, new to the ranks
    ns["rc_opt"] = lambda params: torch.optim.SGD(params, lr=0.05)
    return name


def refused_fsdp_cell(dist_session, monkeypatch, name):
    """An fsdp cell of model ``name`` the fit check refuses (its size taken as 1 TiB; the ranks' room is real)."""
    with monkeypatch.context() as patched:
        patched.setattr(bigmodels, "model_bytes", lambda model: 1 << 40)
        with pytest.raises(PlanError, match=f"--strategy fsdp cannot fit {name} "):
            dist_session.train("x, y = batch\nloss = rc_scale * F.cross_entropy(model(x), y)", model=name,
                               data="rc_data", val_data="rc_val", optimizer="rc_opt", epochs=1, batch_size=32,
                               seed=3, strategy="fsdp", **QUIET)


def carried_on_ranks(session) -> list:
    """Each rank's models whose trained weights the next placement is to carry (:mod:`distnb.engine.train.carry`)."""
    session.run("from distnb.engine.train import carry as _carry\n_wanted = sorted(_carry._WANTED)")
    return session.pull("_wanted")


def test_a_cell_the_fit_check_refuses_sends_nothing(dist_session, trained_ddp, monkeypatch):
    names, before, wanted = rank_names(dist_session), records(dist_session), carried_on_ranks(dist_session)
    refused_fsdp_cell(dist_session, monkeypatch, trained_ddp)
    assert rank_names(dist_session) == names  # no rc_scale, rc_val, rc_opt on the ranks
    assert carried_on_ranks(dist_session) == wanted  # a meta model: not told to carry its weights either
    assert records(dist_session) == before


def test_a_refused_cell_leaves_the_model_held_as_it_was(dist_session, trained_ddp, monkeypatch, capsys):
    name = trained_ddp
    refused_fsdp_cell(dist_session, monkeypatch, name)
    capsys.readouterr()
    # the ranks still hold the model under ddp with its adam state: the next ddp cell goes on with them
    dist_session.train(BODY, model=name, data="rc_data", epochs=1, batch_size=32, seed=3, progress="none")
    out = capsys.readouterr().out
    assert f"sent {name}" not in out and "the last cell used fsdp" not in out and "place them anew" not in out, out
    dist_session.run("_rc_opt = (type(optimizer).__name__, [int(s['step']) for s in optimizer.state.values()])")
    assert dist_session.pull("_rc_opt", rank=0) == ("Adam", [4] * 4)  # 2 steps an epoch: the same Adam, not a new one


def test_a_new_optimizer_takes_the_lr_of_the_last_cell_that_gave_one_without_naming_an_optimizer(dist_session, shell,
                                                                                                 capsys):
    """``--lr 0.1`` with the default optimizer, then a cell that switches strategy (a fresh optimizer) with ``--lr``
    left out: the new optimizer runs at 0.1, as the live one did (found by a fresh user after a refused tensor cell:
    the next cell's fresh SGD ran at its default 0.01, silently)."""
    ns = shell.user_ns
    ns["rc_lr"], ns["rc_data"], ns["F"] = normed(), data(), F
    body = "x, y = batch\nprint('LR', ctx.lr)\nloss = F.cross_entropy(model(x), y)"
    dist_session.train(body, model="rc_lr", data="rc_data", epochs=1, batch_size=32, lr=0.1, seed=3, progress="none")
    capsys.readouterr()
    dist_session.train(body, model="rc_lr", data="rc_data", epochs=1, batch_size=32, strategy="fsdp", seed=3,
                       progress="none")
    out = capsys.readouterr().out
    assert "fresh sgd optimizer" in out and "LR 0.1" in out and "LR 0.01" not in out, out
