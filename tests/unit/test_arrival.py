"""The store agreement before a training body's collective (distnb/engine/process/arrival.py), with an in-memory store."""

import time
import types

import pytest

from distnb.engine.process import abort, arrival


class Store:
    """The calls arrival makes of a torch.distributed Store (set, check, multi_get, delete_key), in memory."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        return [self.data[k] for k in keys]

    def delete_key(self, key):
        return self.data.pop(key, None) is not None


def _dist(rank):
    def name(group):
        raise RuntimeError("no c10d here")  # arrival names the group by its ranks then

    return types.SimpleNamespace(get_rank=lambda: rank, get_world_size=lambda: 2, group=types.SimpleNamespace(WORLD=None),
                                 distributed_c10d=types.SimpleNamespace(_get_process_group_name=name),
                                 get_process_group_ranks=lambda group: [0, 1])


@pytest.fixture
def store(monkeypatch):
    s = Store()
    monkeypatch.setattr(abort.ARMED, "store", s)
    return s


def test_every_ranks_call_comes_back_in_rank_order_and_old_keys_go(store):
    store.set("distnb_call/ranks-0-1/1/1", "5,6")
    assert arrival.arrive(_dist(0), None, [0, 1], [5, 7], "all_reduce") == [[5, 7], [5, 6]]
    store.set("distnb_call/ranks-0-1/2/1", "1")
    assert arrival.arrive(_dist(0), None, [0, 1], [1], "barrier") == [[1], [1]]
    assert "distnb_call/ranks-0-1/1/0" not in store.data  # read by every rank once all wrote the next call's
    assert arrival.WAITING == {}


def test_a_rank_that_never_comes_ends_the_wait_at_the_timeout_naming_it(store):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0 waited 0.3 s \(--timeout\) at its dist.all_reduce for rank\(s\) 1 "):
        arrival.arrive(_dist(0), None, [0, 1], [1, 2], "all_reduce", timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert arrival.WAITING == {}  # no longer said to wait there
