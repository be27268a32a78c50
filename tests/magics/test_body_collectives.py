"""A training body's own collectives (issue 36, item 6), on the real 2-rank gloo cluster.

A collective some ranks skip in a ``%%distrain`` step (a metric all-reduced on rank 0 only) met the other ranks'
DDP gradient all-reduce in gloo, which aborted the engine (SIGABRT) and every rank had to restart. Now each such
call waits in the store for every rank first (distnb/engine/process/arrival.py): a HangError naming the ranks within
--hang-after, the model and optimizer kept, the next cell working; a collective every rank calls works as before.
"""

import time

import pytest
import torch

from distnb import session as session_mod
from support.cells import hang_after
from distnb.core.errors import HangError, RankError

HANG = 3.0
SETUP = """import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
torch.manual_seed(0)
bc_X = torch.randn(128, 6)
bc_train = torch.utils.data.TensorDataset(bc_X, (bc_X.sum(1) > 0).long())
bc_net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))"""
TRAIN = "%%distrain --model bc_net --data bc_train --epochs 1 --batch-size 16 --optimizer adam --progress none\n"
STEP = "x, y = batch\nloss = F.cross_entropy(model(x), y)\n"


def run(shell, code):
    return shell.run_cell(code, silent=False)


def _optimizer_steps(shell):
    """Adam's step count on each rank (the live optimizer's state)."""
    assert run(shell, "%%dist\n_bc_steps = int(optimizer.state_dict()['state'][0]['step'])").error_in_exec is None
    return run(shell, "%dist pull _bc_steps").result


def _trained(shell):
    run(shell, SETUP)
    assert run(shell, TRAIN + STEP).error_in_exec is None
    return _optimizer_steps(shell)


ONE_RANK = {
    "all_reduce on rank 0": ("if rank == 0:\n    m = loss.detach().clone()\n    dist.all_reduce(m)\n", 0, "all_reduce"),
    "broadcast on rank 1": ("if rank == 1:\n    dist.broadcast(loss.detach().clone(), src=1)\n", 1, "broadcast"),
    "all_gather on rank 0": ("if rank == 0:\n    got = [torch.zeros(1), torch.zeros(1)]\n"
                             "    dist.all_gather(got, loss.detach().reshape(1))\n", 0, "all_gather"),
    "barrier on rank 1": ("if rank == 1:\n    dist.barrier()\n", 1, "barrier"),
}


@pytest.mark.parametrize("case", list(ONE_RANK))
def test_a_collective_one_rank_calls_in_a_step_is_a_hang_error_and_the_state_is_kept(shell, case):
    body, caller, op = ONE_RANK[case]
    before = _trained(shell)
    assert before == [4, 4]
    with hang_after(HANG):
        t0 = time.monotonic()
        res = run(shell, TRAIN + STEP + body)
        took = time.monotonic() - t0
    err = res.error_in_exec
    assert isinstance(err, HangError), err  # before: the engine died (SIGABRT) and the cluster needed a restart
    assert took < HANG + 15, took
    text = str(err)
    other = 1 - caller
    assert f"rank {other} waited" in text and "DDP gradient all-reduce" in text, text
    assert f"rank {caller} never arrived: it is waiting at its dist.{op} for the other ranks" in text, text
    assert "EngineDied" not in text and "SIGABRT" not in text
    assert session_mod.current().cluster.dead_ranks() == {}
    assert _optimizer_steps(shell) == before  # the step the hang stopped was applied on no rank
    assert run(shell, TRAIN + STEP).error_in_exec is None  # the next cell trains on, from that state
    assert _optimizer_steps(shell) == [8, 8]


def test_a_metric_every_rank_all_reduces_in_a_step_keeps_ddp_parity(shell):
    """The arrival check changes nothing for calls every rank makes: same result, same weights as without them."""
    weights = []
    for metric in ("", "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nassert t.item() == 3, t\n"
                       "dist.barrier()\nparts = [torch.zeros(2), torch.zeros(2)]\n"
                       "dist.all_gather(parts, torch.full((2,), float(rank)))\nassert parts[1].sum() == 2\n"
                       "m = loss.detach().clone()\ndist.all_reduce(m)\nm /= world_size\n"):
        run(shell, SETUP)
        res = run(shell, "%%distrain --model bc_net --data bc_train --epochs 2 --batch-size 16 --optimizer sgd "
                         "--lr 0.1 --progress none\n" + STEP + metric)
        assert res.error_in_exec is None, res.error_in_exec
        weights.append({k: v.clone() for k, v in shell.user_ns["bc_net"].state_dict().items()})
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k


def test_ranks_that_call_different_collectives_in_a_step_fail_together_with_the_state_kept(shell):
    before = _trained(shell)
    body = ("if rank == 0:\n    dist.all_reduce(torch.ones(3))\nelse:\n    dist.all_reduce(torch.ones(2))\n")
    res = run(shell, TRAIN + STEP + body)
    err = res.error_in_exec
    assert isinstance(err, RankError) and not isinstance(err, HangError), err
    assert "dist.all_reduce got different tensors on different ranks" in str(err), str(err)
    assert "rank 0: all_reduce of float32 [3]; rank 1: all_reduce of float32 [2]" in str(err), str(err)
    assert _optimizer_steps(shell) == before
    assert run(shell, TRAIN + STEP).error_in_exec is None
