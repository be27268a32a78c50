"""A ``%%dist`` cell that fails in its own code keeps a healthy process group (GPU review, finding 7).

On the shared real 2-rank gloo cluster: a typo'd cell, then a training cell of an fsdp model trained
before it: the group was not re-formed (its generation is the same on every rank), and the sharded
model went on with its optimizer state (its optimizer-step count goes on; a re-form would have sent
the model again with a fresh optimizer). A failure that may leave a collective half-done (one rank
raises while the other issued an all-reduce) still re-forms the group, and the next cell works.
"""

import pytest
import torch.nn.functional as F

from distnb.core import calls
from distnb.core.errors import RankError
from support.data import parity_data, parity_model

pytestmark = pytest.mark.timeout(240)


def _generations(session) -> list:
    cluster = session.cluster
    return [i["generation"] for i in cluster.wait_all(cluster.apply_all(calls.info), timeout=30, what="info")]


def _optimizer_steps(session, name) -> list:
    return [int(v) for v in session.run(f"from distnb.engine.train import loop as _l\n_l.RUNS[{name!r}].optimizer_steps")]


def test_a_typo_keeps_the_group_and_the_sharded_model_state(dist_session, shell):
    ns = shell.user_ns
    ns["kept_net"], ns["kept_data"], ns["F"] = parity_model(), parity_data(n=64), F
    kwargs = dict(model="kept_net", data="kept_data", epochs=1, batch_size=16, optimizer="adam", lr=0.01,
                  strategy="fsdp", progress="none", quiet=True)
    body = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
    try:
        _typo_then_training(dist_session, body, kwargs)
    finally:  # the shared session's %dist status would list this model's carried options in later tests
        dist_session.holdings.carried.pop("kept_net", None)


def _typo_then_training(dist_session, body, kwargs):
    dist_session.train(body, **kwargs)
    before, steps = _generations(dist_session), _optimizer_steps(dist_session, "kept_net")
    assert steps[0] > 0
    with pytest.raises(RankError, match="NameError"):
        dist_session.run("x = 1\nprint(undefined_name)")
    with pytest.raises(RankError, match="ZeroDivisionError"):  # one rank only: the other finished the cell
        dist_session.run("1 / (rank - 1)")
    assert _generations(dist_session) == before  # not re-formed
    assert _optimizer_steps(dist_session, "kept_net") == steps  # the sharded model and its optimizer still there
    dist_session.train(body, **kwargs)
    assert _generations(dist_session) == before
    assert _optimizer_steps(dist_session, "kept_net") == [2 * s for s in steps]  # went on, not started again
    assert dist_session.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                            "t.item()") == ["2.0", "2.0"]


@pytest.mark.parametrize("code", [
    # rank 0 waits in a collective that rank 1 never joins (the checked call's own all-reduce)
    "import torch, torch.distributed as dist\nif rank == 1:\n    raise ValueError('rank 1 fails')\n"
    "dist.all_reduce(torch.ones(1))",
    # rank 0 issues an all-reduce and finishes; rank 1 never issues it: their collective counts differ
    "import torch, torch.distributed as dist\nif rank == 1:\n    raise ValueError('rank 1 fails')\n"
    "_work = dist.distributed_c10d.all_reduce(torch.ones(1), async_op=True)",
])
def test_a_failure_that_may_leave_a_collective_half_done_re_forms(dist_session, code):
    before = _generations(dist_session)
    with pytest.raises(RankError, match="rank 1 fails"):
        dist_session.run(code)
    assert all(after > was for after, was in zip(_generations(dist_session), before))
    assert dist_session.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                            "t.item()") == ["2.0", "2.0"]
