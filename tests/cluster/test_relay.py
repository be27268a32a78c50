"""Progress through a host's relay (engine/report.py ``HostRelay``) on the real 2-rank cluster.

Above ``relay_above`` ranks, a host's local rank 0 relays its ranks' progress: the kernel gets
every rank's messages from rank 0 alone (keys ``distnb@R``), including each rank's final status,
and nothing of the relay is left behind on the ranks. Below it, each rank reports for itself.
"""

import glob
import os
import tempfile

import pytest
import torch.nn.functional as F

from distnb.execute import execute
from distnb.core.errors import RankError
from support.data import blobs, mlp

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


class _Seen(list):
    """(rank whose AsyncResult carried it, rank it is about, status) of every message taken from IOPub,
    and ``state``, the progress state they went to."""

    state = None


@pytest.fixture
def seen(monkeypatch):
    """The messages the kernel takes from IOPub (a :class:`_Seen`)."""
    out = _Seen()
    take = execute.take_progress

    def recording(state, rank, data, progress, *raw):
        new = take(state, rank, data, progress, *raw)
        out.extend((rank, r, msg["status"]) for r, msg in new)
        out.state = state
        return new

    monkeypatch.setattr(execute, "take_progress", recording)
    return out


@pytest.mark.parametrize("relay_above, relayed", [(1, True), (16, False)])
def test_progress_through_the_hosts_relay(dist_session, shell, seen, relay_above, relayed):
    ns = shell.user_ns
    ns["relay_net"], ns["relay_data"], ns["F"] = mlp(12, 16, 3, seed=1), blobs(200, seed=2, num_summed=1), F
    dist_session.train(BODY, model="relay_net", data="relay_data", epochs=2, batch_size=8, progress="text",
                       quiet=True, relay_above=relay_above, reset=True)
    carriers = {(carrier, about) for carrier, about, _ in seen}
    if relayed:
        assert carriers == {(0, 0), (0, 1)}  # rank 1's messages came through rank 0, the host's leader
    else:
        assert carriers == {(0, 0), (1, 1)}
    last = {about: status for _, about, status in seen}
    if relayed:
        assert last == {0: "done", 1: "done"}  # every rank's last word reached the kernel through the relay
    else:  # each rank's reply carried its last word (Reporter.final_message): none was published
        assert "done" not in last.values()
    assert [row["status"] for row in seen.state.rows] == ["done", "done"]
    leftovers = glob.glob(os.path.join(tempfile.gettempdir(), f"distnb-relay-{os.getuid()}-*"))
    assert leftovers == []


FAIL_BODY = ("x, y = batch\nif rank == 1 and ctx.step == 3:\n    raise ValueError('a bad batch on rank 1')\n"
             "loss = F.cross_entropy(model(x), y)")


def test_a_failing_rank_is_named_through_the_relay(dist_session, shell, seen):
    """Rank 1 (a member of the host's relay) raises: the cell ends naming it, rank 0 (the leader, in
    the step's all-reduce) stopped as a consequence, not by the group's --timeout (30 s here), and
    the next cell works."""
    ns = shell.user_ns
    ns["relay_net"], ns["relay_data"], ns["F"] = mlp(12, 16, 3, seed=1), blobs(200, seed=2, num_summed=1), F
    with pytest.raises(RankError) as err:
        dist_session.train(FAIL_BODY, model="relay_net", data="relay_data", epochs=2, batch_size=8,
                           progress="text", quiet=True, relay_above=1, reset=True)
    assert err.value.rank == 1 and "a bad batch on rank 1" in str(err.value)
    by_rank = {f["rank"]: f for f in err.value.failures}
    assert by_rank[0]["ename"] == "PeerFailed", by_rank[0]  # ended at once, not a gloo timeout
    assert "rank 1 failed" in by_rank[0]["evalue"]
    assert {(about, status) for carrier, about, status in seen if carrier == 0} >= {(1, "failed")}
    assert glob.glob(os.path.join(tempfile.gettempdir(), f"distnb-relay-{os.getuid()}-*")) == []
    seen.clear()
    dist_session.train(BODY, model="relay_net", data="relay_data", epochs=1, batch_size=8, progress="text",
                       quiet=True, relay_above=1)
    assert {about: status for _, about, status in seen} == {0: "done", 1: "done"}
