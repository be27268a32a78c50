"""``%dist scale`` and ``--on-failure shrink`` with fsdp+tensor meshes, and names defined on the ranks.

On the real shared cluster (2 ranks before and after each test, as in test_scale.py): a model on
``--mesh 1x2`` grows to 4 ranks as ``2x2`` (the tensor-parallel size kept, DCP resharding it) and
matches one process on each world's global batches to 1e-5; a world its tensor-parallel size does
not divide is refused; a carried mesh that does not fit says where it came from; a shrink goes on
from the newest checkpoint on the smaller mesh; names a ``%%dist`` cell defined reach added ranks.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from IPython.core.error import UsageError

from distnb import session as session_mod
from distnb.elastic import shrinking
from distnb.core.errors import PlanError, RankError
from support.data import parity_data
from support.reference import reference
from support.worlds import back_to_two_ranks

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
TOL = dict(atol=1e-5, rtol=1e-5)


def make_model(seed=1):
    """Linear(12, 16), Tanh, Linear(16, 8), Linear(8, 3): the default plan splits 0/2, leaves 3 whole."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8), nn.Linear(8, 3))


def _drop_mesh_models(shell):
    """Take the notebook's fsdp+tensor models out of its namespace (other tests' too, on the shared session): a
    live one whose tensor-parallel size does not divide a test's new world would refuse its scale."""
    current = session_mod._CURRENT
    if current is not None:
        for name, values in current.holdings.carried.items():
            if values.get("strategy") == "fsdp+tensor":
                shell.user_ns.pop(name, None)


@pytest.fixture(autouse=True)
def two_ranks(shell):
    """The shared cluster at 2 ranks (and --on-failure stop) before and after each test, with no live
    fsdp+tensor model of an earlier test."""
    _drop_mesh_models(shell)
    yield
    _drop_mesh_models(shell)
    back_to_two_ranks()


def train(s, name, data, **kw):
    opts = dict(epochs=1, batch_size=16, seed=4, progress="none", quiet=True)
    return s.train(kw.pop("body", BODY), model=name, data=data, **dict(opts, **kw))


def assert_close(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=lambda m: f"{name}: {m}")


def mesh_column(s, name):
    """Each rank's ``%dist status`` mesh entry for model ``name`` (without the model names)."""
    return [[part.split(" (")[0] for part in row["mesh"].split("; ") if name in part.split("(")[1]]
            for row in s.status().rows]


def test_fsdp_tensor_1x2_grows_to_2x2_and_matches_one_process(shell, dist_session, capsys):
    """2 ranks as 1x2 (one data shard), scale 4: 2x2 (two), resharded through DCP; Adam state carried."""
    s, ns = dist_session, shell.user_ns
    ns.update(mt_net=make_model(), mt_data=parity_data(), F=F)
    ref = make_model()
    train(s, "mt_net", "mt_data", strategy="fsdp+tensor", mesh="1x2", optimizer="adam", lr=0.01)
    base = reference(ref, ns["mt_data"], num_shards=1, batch_size=16, epochs=1, seed=4, optimizer=torch.optim.Adam,
                     lr=0.01)
    assert_close(ns["mt_net"], ref)
    capsys.readouterr()
    out = s.scale(4)
    said = capsys.readouterr().out
    assert "mt_net" in out["resharded"] and out["meshes"]["mt_net"] == "2x2", out
    assert "mt_net: --mesh 2x2 from its next cell on (the tensor-parallel size kept" in said, said
    assert "global batch changes from 16 to 32" in said and "%dist scale 4 --keep-global-batch would have kept 16" in said
    assert mesh_column(s, "mt_net") == [["dp=0 tp=0 of 2x2"], ["dp=0 tp=1 of 2x2"], ["dp=1 tp=0 of 2x2"],
                                        ["dp=1 tp=1 of 2x2"]]
    result = train(s, "mt_net", "mt_data", quiet=False)  # --strategy and --mesh carried, the resharded copy goes on
    said = capsys.readouterr().out
    assert "--strategy fsdp+tensor, --mesh 2x2, as in mt_net's last cell" in said and "fresh" not in said, said
    assert result.epochs == [1] and [row["mesh"] for row in result.rows] == [
        "dp=0,tp=0", "dp=0,tp=1", "dp=1,tp=0", "dp=1,tp=1"]
    reference(ref, ns["mt_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=base.optimizer,
              first_epoch=1)
    assert_close(ns["mt_net"], ref)

    # TP = 2 does not divide 3: refused before anything changes, naming N, TP and the sizes that work
    with pytest.raises(PlanError) as info:
        s.scale(3)
    said = str(info.value)
    assert "mt_net (--strategy fsdp+tensor, --mesh 2x2) keeps its tensor-parallel size 2" in said, said
    assert "2 does not divide N = 3" in said and "multiples of 2 (2, 4" in said and "nothing changed" in said
    assert s.world_size == 4
    err = shell.run_cell("%dist scale 3").error_in_exec
    assert isinstance(err, UsageError) and "N = 3" in str(err)

    assert s.scale(2, quiet=True)["meshes"].get("mt_net") == "1x2"  # and back: 1x2 again
    result = train(s, "mt_net", "mt_data")
    assert result.epochs == [2]
    reference(ref, ns["mt_data"], num_shards=1, batch_size=16, epochs=1, seed=4, optimizer=base.optimizer,
              first_epoch=2)
    assert_close(ns["mt_net"], ref)
    del ns["mt_net"]  # live on 1x2, it would refuse the other tests' scales to 3 (as the message above says)


def test_a_carried_mesh_that_does_not_fit_says_it_came_from_the_earlier_cell(shell, dist_session):
    s, ns = dist_session, shell.user_ns
    ns.update(mc_net=make_model(), mc_data=parity_data(), F=F)
    train(s, "mc_net", "mc_data", strategy="fsdp+tensor", mesh="1x2", optimizer="sgd", lr=0.1)
    s = s.restart(n=3, quiet=True)  # the ranks hold nothing (no refusal), the same object keeps its options
    err = shell.run_cell(f"%%distrain --model mc_net --data mc_data --progress none\n{BODY}").error_in_exec
    assert isinstance(err, UsageError)
    assert str(err) == ("--mesh 1x2 came from mc_net's last cell, on a world of 2 ranks, not from this one, and does "
                        "not fit this world of 3 ranks: give this cell --mesh DPxTP with DP * TP = 3 (--mesh 3x1 or "
                        "1x3), or %dist scale 2 to go back to it")
    assert train(s, "mc_net", "mc_data", mesh="3x1").rows[0]["mesh"] == "dp=0,tp=0"  # as it says


KILL_RANK_1 = """import os, signal
x, y = batch
if rank == 1 and world_size == 3 and ctx.step == ms_kill_at:  # once: the cell goes on on 2 ranks
    os.kill(os.getpid(), signal.SIGKILL)
loss = F.cross_entropy(model(x), y)"""


@pytest.mark.parametrize("batch,every,kill,head,skip", [(8, 11, 13, 2, 3), (16, 5, 7, 0, 0)])
def test_on_failure_shrink_goes_on_from_the_checkpoint_on_the_smaller_mesh(shell, dist_session, tmp_path, capsys,
                                                                          batch, every, kill, head, skip):
    """3 ranks on --mesh 3x1, rank 1 killed: from the newest checkpoint on 2x1; parity with one process.

    203 samples in 3 shards of 68. Batch 8 (9 steps an epoch): the step-11 checkpoint holds epoch 0
    and 2 steps of epoch 1 (16 samples per rank, 48 in all: 24 per rank, 3 batches, on 2 shards).
    Batch 16 (5 steps an epoch): the step-5 checkpoint is epoch 0's last step, so epoch 1 is trained
    whole on 2 ranks and no more. ``head``: steps of epoch 1 in the checkpoint (3-rank batches),
    ``skip``: the 2-rank batches they make up. Either way the ``kill`` steps done (``ctx.step`` counts those) minus the
    checkpoint's are lost with the dead rank's shards and trained again.
    """
    from distnb.engine.transport import shard

    s, ns = dist_session, shell.user_ns
    name = f"ms_net{batch}"  # its own name: the kernel remembers how far a name's weights were trained
    ns.update(**{name: make_model()}, ms_data=parity_data(), F=F, ms_dir=str(tmp_path / "ck"), ms_kill_at=kill)
    s.on_failure = "shrink"
    s.scale(3, quiet=True)
    capsys.readouterr()
    res = shell.run_cell(f"%%distrain --model {name} --data ms_data --strategy fsdp+tensor --mesh 3x1 --epochs 2 "
                         f"--batch-size {batch} --seed 4 --optimizer sgd --lr 0.1 --checkpoint-dir {{ms_dir}} "
                         f"--checkpoint-every {every} --progress none\n" + KILL_RANK_1)
    said = capsys.readouterr().out
    assert res.error_in_exec is None, res.error_in_exec
    assert f"{name} goes on on --mesh 2x1 (the tensor-parallel size kept)" in said, said
    lost = res.result.lost
    assert lost["world_size"] == (3, 2) and lost["resumed_from"].endswith(f"step_{every:08d}") and s.world_size == 2
    assert lost["steps_lost"] == kill - every and res.result.epochs == [1], (lost, res.result.epochs)
    assert [row["mesh"] for row in res.result.rows] == ["dp=0,tp=0", "dp=1,tp=0"]
    assert mesh_column(s, name) == [["dp=0 tp=0 of 2x1"], ["dp=1 tp=0 of 2x1"]]
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = ns["ms_data"].tensors
    steps = list(shard.global_batches(len(x), 3, 4, 0, batch, False)) + \
        list(shard.global_batches(len(x), 3, 4, 1, batch, False))[:head] + \
        list(shard.global_batches(len(x), 2, 4, 1, batch, False))[skip:]
    for idx in steps:
        opt.zero_grad()
        F.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()
    assert_close(ns[name], ref)


def test_a_shrink_that_the_tensor_parallel_size_does_not_divide_says_why_it_cannot_go_on(dist_session):
    """4 ranks on 2x2 losing one leave 3: the cell fails saying why and what to do (the world is usable)."""
    from distnb.core.plan import TrainPlan

    plan = TrainPlan(model="net", data="d", strategy="fsdp+tensor", mesh="2x2", checkpoint_dir="/ck")
    failure = RankError([dict(rank=1, ename="RuntimeError", evalue="rank 1 died; run %dist restart")],
                        context="training")
    with pytest.raises(RankError) as info:
        shrinking._mesh_for(dist_session, plan, 4, 3, failure, {1: "killed by SIGKILL"})
    said = str(info.value)
    assert "the world is now 3 ranks and usable, but --on-failure shrink: net (--strategy fsdp+tensor, --mesh " \
           "2x2) keeps its tensor-parallel size 2" in said, said
    assert "2 does not divide N = 3" in said and "%dist scale to one of them, then run the cell again" in said
    assert "/ck" in said


DEFINE = """import collections, threading
import torch
def dn_helper(v):
    return v * dn_scale
dn_scale = 3
dn_table = collections.OrderedDict(a=torch.arange(4.0))
dn_lock = threading.Lock()
"""


def test_names_defined_on_the_ranks_reach_the_added_rank(shell, dist_session, capsys):
    """What %%dist cells bound, not what a %%distrain body left (``x, y = batch``), nor distnb's names."""
    s, ns = dist_session, shell.user_ns
    ns.update(dn_net=make_model(), dn_data=parity_data(n=64), F=F)
    train(s, "dn_net", "dn_data", optimizer="sgd")
    assert shell.run_cell("%%dist\n" + DEFINE).error_in_exec is None
    assert s.run("'x' in globals() and 'y' in globals()", all_output=True) == ["True", "True"]
    capsys.readouterr()
    out = s.scale(3)
    said = capsys.readouterr().out
    assert {"dn_helper", "dn_scale", "dn_table", "collections", "threading"} <= set(out["defined"])
    assert "torch" in set(out["defined"]) | set(out["names"])  # pushed, if an earlier file's body read it
    assert "dn_lock" not in out["defined"] and "cannot pickle" in out["unpicklable"]["dn_lock"]
    assert "defined on the ranks (" in said and "dn_helper" in said
    assert "not on the added ranks, as they cannot be pickled: dn_lock (TypeError: cannot pickle" in said, said
    assert s.run("dn_helper(2), dn_table['a'].sum().item(), 'dn_lock' in globals()", all_output=True) == \
        ["(6, 6.0, True)", "(6, 6.0, True)", "(6, 6.0, False)"]
    assert not set(out["defined"]) & {"rank", "world_size", "model", "optimizer", "F", "x", "y", "dn_net"}
    assert s.run("'x' in globals()", all_output=True) == ["True", "True", "False"]


def test_dist_load_lays_a_mesh_checkpoint_out_on_another_world(shell, dist_session, tmp_path, capsys):
    """``%dist load`` of an fsdp+tensor checkpoint after ``%dist restart -n N``: its tensor-parallel size kept
    (``1x2`` saved, ``2x2`` on 4 ranks, as ``%dist scale`` does), or refused in the kernel when it does not divide
    N. Before, the saved ``--mesh 1x2`` went to the ranks as it was and every rank failed (a RankError)."""
    s, ns = dist_session, shell.user_ns
    ns.update(ml_net=make_model(), ml_data=parity_data(), F=F)
    train(s, "ml_net", "ml_data", strategy="fsdp+tensor", mesh="1x2", optimizer="adam", lr=0.01)
    s.save(str(tmp_path), model="ml_net", quiet=True)
    saved = {k: v.clone() for k, v in ns["ml_net"].state_dict().items()}
    s = s.restart(n=3, quiet=True)
    ns["ml_back"] = make_model(seed=5)
    with pytest.raises(PlanError, match=r"ml_back \(--strategy fsdp\+tensor, --mesh 1x2\) keeps its tensor-parallel "
                                        r"size 2 .* 2 does not divide N = 3"):
        s.load(str(tmp_path), model="ml_back", quiet=True)
    s = s.restart(n=4, quiet=True)
    capsys.readouterr()
    s.load(str(tmp_path), model="ml_back")
    assert "--mesh 2x2, saved on 1x2" in capsys.readouterr().out
    for k, v in ns["ml_back"].state_dict().items():
        torch.testing.assert_close(v, saved[k], msg=k)
    result = train(s, "ml_back", "ml_data")
    assert result.epochs == [1] and [row["mesh"] for row in result.rows][-1] == "dp=1,tp=1"
    del ns["ml_back"], ns["ml_net"]
