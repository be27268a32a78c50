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

from distnb import execute
from support.data import blobs, mlp

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


@pytest.fixture
def seen(monkeypatch):
    """(rank whose AsyncResult carried it, rank it is about, status) of every message the kernel takes."""
    out = []
    take = execute.take_progress

    def recording(state, rank, data, progress):
        new = take(state, rank, data, progress)
        out.extend((rank, r, msg["status"]) for r, msg in new)
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
    assert last == {0: "done", 1: "done"}  # every rank's last word reached the kernel
    leftovers = glob.glob(os.path.join(tempfile.gettempdir(), f"distnb-relay-{os.getuid()}-*"))
    assert leftovers == []
