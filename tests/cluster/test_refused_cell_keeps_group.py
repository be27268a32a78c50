"""A training cell refused on every rank before any step keeps the process group, and the model loses nothing.

A model built on the meta device in the notebook has its trained weights on the ranks only. A cell that
switched it to ``--strategy tensor`` carried those weights into the new placement, then the tensor plan's
check refused the model (its forward is not elementwise between the split layers) before any step. The
failed cell used to re-form the process group like any failure: the placement went with it, and the next
cell said the model "initialises it afresh" (its training lost). On the shared real 2-rank cluster: the
refusal keeps the group (its generation, kernel and ranks, unchanged), says so, and the next cell (fsdp, lr 0)
and a pull give the trained weights bit for bit; the refusal stays for a later tensor cell of the same
placement (never a silent wrong training); a notebook-held model is left bit for bit as it was; a body's
typo on its first line keeps the group too; a failure on one rank alone still re-forms the group.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.core import calls
from distnb.core.errors import RankError
from support.data import parity_data
from support.held import assert_bit_exact, ranks_weights

pytestmark = pytest.mark.timeout(300)

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
REFUSED = r"StrategyError: tensor plan changes what the model computes.*Nothing was trained"
KEPT = ("Nothing was lost: every rank stopped before any step, with no collective half-done, so their process group "
        "was kept, ")
# a cell that had placed the model anew (another strategy) keeps its weights, not its optimizer state or epoch count
KEPT_WEIGHTS = ("No weight was lost: every rank stopped before any step, with no collective half-done, so their "
                "process group was kept, and ")
NOT_KEPT = "Its optimizer state and epoch count were not kept: this cell had placed {name} anew"


def centred():
    """fc1 -> minus the mean over the hidden units -> fc2 (made here, so that it travels to the ranks by value)."""

    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(12, 16)
            self.fc2 = nn.Linear(16, 3)

        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(torch.tanh(h - h.mean(-1, keepdim=True)))

    return Centred


def train(session, name, strategy, lr=0.1, body=BODY, mesh=None):
    return session.train(body, model=name, data="kg_data", epochs=1, batch_size=16, optimizer="sgd", lr=lr, seed=4,
                         strategy=strategy, mesh=mesh, progress="none", quiet=True)


def generations(session) -> tuple:
    """(the kernel's count of re-forms, each rank's process group generation)."""
    cluster = session.cluster
    ranks = [i["generation"] for i in cluster.wait_all(cluster.apply_all(calls.info), timeout=30, what="info")]
    return session.holdings.generation, ranks


def refused(session, name, strategy="tensor", mesh=None) -> str:
    before = generations(session)
    with pytest.raises(RankError, match=REFUSED) as info:
        train(session, name, strategy, mesh=mesh)
    assert generations(session) == before, "the process group was re-formed over the refused cell"
    assert getattr(info.value, "group_kept", False)
    return str(info.value)


@pytest.fixture
def meta_trained(dist_session, shell):
    """A meta model trained one fsdp cell; its name and the weights the ranks hold then."""
    ns = shell.user_ns
    ns["kg_data"], ns["F"] = parity_data(n=64), F
    name = "kg_meta"
    torch.manual_seed(3)
    with torch.device("meta"):
        ns[name] = centred()()
    train(dist_session, name, "fsdp")
    assert all(p.is_meta for p in ns[name].parameters())  # its weights are on the ranks only
    yield name, ranks_weights(dist_session, name)
    dist_session.holdings.carried.pop(name, None)


def test_a_refused_tensor_cell_keeps_a_meta_model_s_trained_weights(dist_session, shell, capsys, meta_trained):
    name, trained = meta_trained
    before = generations(dist_session)
    capsys.readouterr()
    text = refused(dist_session, name)
    assert KEPT_WEIGHTS + f"the ranks hold {name} with the weights it started this cell with (it is on the meta device" in text
    assert NOT_KEPT.format(name=name) in text
    assert generations(dist_session) == before, "the process group was re-formed over the refused cell"
    assert_bit_exact(ranks_weights(dist_session, name), trained, "pulled after the refused cell")
    assert_bit_exact({k: dist_session.pull(f"{name}.{k}") for k in trained}, trained, "%dist pull NAME.key")
    # the same placement, kept (not sent again), is refused again at its first forward (never trained unchecked)
    capsys.readouterr()
    refused(dist_session, name)
    assert "keep the weights they trained" not in capsys.readouterr().out
    assert generations(dist_session) == before
    train(dist_session, name, "fsdp", lr=0.0)
    out = capsys.readouterr().out
    assert "initialises it afresh" not in out
    assert_bit_exact(ranks_weights(dist_session, name), trained, "the fsdp cell (lr 0) after the refused one")
    assert generations(dist_session) == before


@pytest.mark.parametrize("strategy,mesh", [("tensor", None), ("fsdp+tensor", "1x2")])
def test_a_refused_tensor_cell_leaves_a_notebook_model_as_it_was(dist_session, shell, strategy, mesh):
    ns = shell.user_ns
    ns["kg_data"], ns["F"] = parity_data(n=64), F
    name = f"kg_held_{strategy.replace('+', '_')}"
    torch.manual_seed(3)
    ns[name] = centred()()
    try:
        train(dist_session, name, "ddp")
        trained = {k: v.clone() for k, v in ns[name].state_dict().items()}
        before = generations(dist_session)
        text = refused(dist_session, name, strategy, mesh)
        assert KEPT_WEIGHTS + f"{name}'s weights are as they were before this cell, in the notebook and on the ranks" in text
        assert NOT_KEPT.format(name=name) in text
        assert generations(dist_session) == before
        assert_bit_exact(ns[name].state_dict(), trained, "the notebook's model after the refused cell")
        assert_bit_exact(ranks_weights(dist_session, name), trained, "the ranks' model after the refused cell")
        train(dist_session, name, "ddp", lr=0.0)
        assert_bit_exact(ns[name].state_dict(), trained, "the ddp cell (lr 0) after the refused one")
        assert generations(dist_session) == before
    finally:
        dist_session.holdings.carried.pop(name, None)


def test_a_typo_on_the_body_s_first_line_keeps_the_group(dist_session, shell, capsys, meta_trained):
    name, trained = meta_trained
    before = generations(dist_session)
    with pytest.raises(RankError, match=r"NameError: name 'no_such_name' is not defined") as info:
        train(dist_session, name, "fsdp", body="no_such_name\n" + BODY)
    assert generations(dist_session) == before
    assert getattr(info.value, "group_kept", False) and KEPT in str(info.value)
    assert "and so are its optimizer state and epoch count" in str(info.value)
    capsys.readouterr()
    # the same placement goes on: no fresh optimizer, no epoch 0 (a cell that places the model anew says both)
    dist_session.train(BODY, model=name, data="kg_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.0, seed=4,
                       strategy="fsdp", progress="none")
    out = capsys.readouterr().out
    assert "afresh" not in out and "fresh sgd optimizer" not in out and "lr set to 0" in out, out
    assert_bit_exact(ranks_weights(dist_session, name), trained, "pulled after the typo")


def test_a_failure_on_one_rank_alone_still_re_forms_the_group(dist_session, shell, capsys, meta_trained):
    """Rank 0 raises before its model's forward while rank 1 runs its step: the ranks end the cell apart."""
    name, _ = meta_trained
    kernel, ranks = generations(dist_session)
    with pytest.raises(RankError, match=r"ValueError: rank 0 alone") as info:
        train(dist_session, name, "fsdp", body="if ctx.rank == 0:\n    raise ValueError('rank 0 alone')\n" + BODY)
    assert not getattr(info.value, "group_kept", False) and "Nothing was lost" not in str(info.value)
    assert generations(dist_session) == (kernel + 1, [g + 1 for g in ranks])
    capsys.readouterr()
    train(dist_session, name, "fsdp")  # the cluster is usable; the model's sharded weights went with the group
    assert "initialises it afresh" in capsys.readouterr().out
