"""``%dist scale`` after a rank was lost under a sharded strategy: resume from the newest checkpoint, saying the
lost shards existed only there, or refuse with that reason; a shrink says what it kept of each live model.

Every test leaves the shared cluster at 2 ranks, whole.
"""

import re
import time

import pytest
import torch.nn.functional as F

from distnb.core.errors import ClusterError, RankError
from support.data import mlp, parity_data, parity_model
from support.worlds import back_to_two_ranks

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
#: Rank 2's engine dies (SIGKILL) before its micro-step LS_KILL.
KILL_RANK_2 = """import os, signal
x, y = batch
if rank == 2 and ctx.step == LS_KILL:
    os.kill(os.getpid(), signal.SIGKILL)
loss = F.cross_entropy(model(x), y)"""


@pytest.fixture(autouse=True)
def two_ranks(shell, dist_session):
    yield
    if dist_session.running and dist_session.cluster.dead_ranks():
        dist_session.restart(n=2, quiet=True)
    back_to_two_ranks()


def _lose_rank_2(shell, sess, cell):
    sess.scale(3, quiet=True)
    res = shell.run_cell(cell, silent=False)
    assert isinstance(res.error_in_exec, RankError), res.error_in_exec
    deadline = time.monotonic() + 10
    while 2 not in sess.cluster.dead_ranks():
        assert time.monotonic() < deadline, "rank 2 not seen dead"
        time.sleep(0.05)


def test_a_lost_fsdp_rank_resumes_from_the_newest_checkpoint_and_a_shrink_says_what_it_kept(
        shell, dist_session, tmp_path, capsys):
    ns = shell.user_ns
    ns.update(ls_ddp=parity_model(), ls_net=parity_model(seed=3), ls_data=parity_data(), F=F, LS_KILL=5,
              ls_dir=str(tmp_path / "ck"))
    dist_session.scale(3, quiet=True)
    dist_session.train(BODY, model="ls_ddp", data="ls_data", epochs=1, batch_size=16, optimizer="adam",
                       progress="none", quiet=True)
    _lose_rank_2(shell, dist_session, "%%distrain --model ls_net --data ls_data --strategy fsdp --epochs 2 "
                 "--batch-size 16 --optimizer adam --checkpoint-dir {ls_dir} --checkpoint-every 3 --progress none\n"
                 + KILL_RANK_2)
    capsys.readouterr()
    out = dist_session.scale(2)
    said = capsys.readouterr().out
    assert out["world_size"] == (3, 2) and out["resumed"].get("ls_net", "").endswith("step_00000003"), said
    assert ("ls_net (fsdp): the lost rank's shards existed only in the checkpoint " + out["resumed"]["ls_net"]) in \
        said, said
    assert "resumed from it onto 2 ranks (model, optimizer, lr schedule, epoch 0 and sampler position" in said
    # the shared cluster may hold other tests' ddp models too: each is kept
    assert re.search(r"ranks 0-1 kept [^(]*\bls_ddp\b[^(]* \((each its )?model, optimizer, lr schedule, epoch and "
                     r"sampler position", said), said
    assert "resharded onto 2 ranks through a torch.distributed.checkpoint (DCP) written by the old world" not in said
    result = dist_session.train(BODY, model="ls_net", data="ls_data", epochs=1, batch_size=16, progress="none",
                                quiet=True)
    assert result.epochs == [0] and dist_session.world_size == 2  # epoch 0 goes on from the checkpoint's step 3


def test_a_lost_fsdp_rank_without_a_checkpoint_is_refused_with_the_reason_and_nothing_changes(
        shell, dist_session):
    ns = shell.user_ns
    ns.update(lr_net=parity_model(), lr_data=parity_data(), F=F, LS_KILL=2)
    _lose_rank_2(shell, dist_session, "%%distrain --model lr_net --data lr_data --strategy fsdp --epochs 1 "
                 "--batch-size 16 --progress none\n" + KILL_RANK_2)
    ids = list(dist_session.cluster.engine_ids)
    with pytest.raises(ClusterError) as err:
        dist_session.scale(2)
    said = str(err.value)
    assert "rank 2 died, and lr_net (--strategy fsdp; its last cell had no --checkpoint-dir) was sharded over the " \
        "ranks when its last cell failed" in said, said
    assert "shards (weights and optimizer state) were lost with its engine and exist in no checkpoint" in said
    assert "nothing changed" in said and "%dist restart -n 2" in said and "--checkpoint-dir" in said
    assert dist_session.world_size == 3 and dist_session.cluster.engine_ids == ids


@pytest.mark.parametrize("strategy", ["tensor", "pipeline"])
def test_other_sharded_strategies_are_refused_the_same_way_without_a_checkpoint(shell, dist_session, strategy):
    ns = shell.user_ns
    name = f"lt_{strategy}"
    model = mlp(12, 24, 3, seed=1) if strategy == "tensor" else mlp(12, 24, 24, 3, seed=1)  # 24 splits over 3; 3 stages
    ns.update({name: model, "lt_data": parity_data(), "F": F, "LS_KILL": 1})
    _lose_rank_2(shell, dist_session, f"%%distrain --model {name} --data lt_data --strategy {strategy} --epochs 1 "
                 "--batch-size 15 --progress none\n" + KILL_RANK_2)
    with pytest.raises(ClusterError) as err:
        dist_session.scale(2)
    assert f"{name} (--strategy {strategy}; its last cell had no --checkpoint-dir) was sharded over the ranks" in \
        str(err.value), err.value
    assert dist_session.world_size == 3
