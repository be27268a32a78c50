"""The shared-memory path of the wire format (engine/wire.py, engine/segments.py, transfer.py), in one process.

Segments are kept and reused between transfers (their pages stay touched); a model received
lands in memory a dropped model used; none of it aliases what is still alive. Every file is
gone once the pools are closed (as when the cluster stops), whether transfers succeeded or not.
"""

import contextlib
import glob
import os

import numpy as np
import pytest
import torch
import torch.nn as nn

from distnb.transfer import transfer
from distnb.engine.transport import segments, stateout, wire
from support.shm import rank_shm, shm_dir  # noqa: F401  (fixtures)


def _sent(buffers):
    """``buffers`` written into a segment of a pool of this test's own: (pool, ShmRef)."""
    pool = segments.Pool(os.getpid(), "t")
    seg = pool.acquire(wire.layout([len(b) for b in buffers])[1])
    return pool, wire.write_into(seg, buffers)


class FakeCluster:
    """What transfer.outgoing needs of a cluster: world_size and the probed ranks."""

    def __init__(self, world_size=2, shm=(0, 1)):
        self.world_size = world_size
        self._distnb_shm_ranks = frozenset(shm)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("steps", torch.tensor(7))
        self.register_buffer("empty", torch.zeros(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_write_read_round_trip(shm_dir, dtype):
    tensors = [(torch.arange(12) % 3).to(dtype).reshape(3, 4), torch.zeros(0, dtype=dtype),
               torch.arange(7).to(dtype)]
    pool, ref = _sent([wire.to_buffer(t) for t in tensors])
    assert all(off % 64 == 0 for off in ref.offsets)
    descs = [wire.describe(t) for t in tensors]
    for mapped in (False, True):
        back = wire.read_shm(ref, descs, mapped=mapped)
        for a, b in zip(back, tensors):
            assert a.dtype == dtype and torch.equal(a, b)
    pool.close()


def test_mapped_read_is_copy_on_write_and_held_until_dropped(shm_dir):
    t = torch.arange(1000, dtype=torch.float32)
    pool, ref = _sent([wire.to_buffer(t)])
    (m,) = wire.read_shm(ref, [wire.describe(t)], mapped=True)
    assert segments.held_segments(os.getpid()) == [ref.path]
    m.mul_(2)  # a rank writing to its shard changes only its own copy
    (again,) = wire.read_shm(ref, [wire.describe(t)])
    assert torch.equal(again, t) and torch.equal(m, t * 2)
    view = m[10:20]
    del m
    assert segments.held_segments(os.getpid()) == [ref.path]  # a view still maps it
    del view
    assert segments.held_segments(os.getpid()) == []
    pool.close()


def test_pool_reuses_segments_and_gives_back_beyond_the_idle_budget(shm_dir, monkeypatch):
    pool = segments.Pool(os.getpid(), "t")
    a = pool.acquire(3 << 20)
    assert a.size == 3 << 20 and pool.acquire(1).path != a.path  # busy: not handed out twice
    pool.release(a)
    assert pool.acquire(2 << 20).path == a.path  # the smallest free one that fits: its pages touched
    pool.release(a)
    small = pool.acquire(1 << 10)
    assert small.path != a.path and small.size == 1 << 20  # not one of more than twice the size
    pool.release(small)
    assert pool.acquire(3 << 20).path == a.path
    monkeypatch.setattr(segments, "IDLE_BYTES", 1 << 20)
    pool.release(a)  # beyond the budget: unlinked
    assert not os.path.exists(a.path) and pool.free == [small]
    b = pool.acquire(10)
    assert b is small
    pool.release(b, lent=True)  # a reader maps it copy-on-write
    other = pool.acquire(10)
    assert other.path != b.path
    pool.release(other)
    pool.returned({b.path})  # still held
    assert b.path in pool.lent
    pool.returned(set())  # dropped: free again (and the budget keeps one of the two)
    assert len(pool.free) == 1 and not pool.lent
    pool.close()
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("mapped", [False, True])
def test_received_tensors_are_not_views_of_each_other(shm_dir, mapped):
    # views share autograd's version counter: BatchNorm's in-place running-stats update in the forward
    # would then fail the backward of a conv weight received beside it ("modified by an inplace operation")
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    payload, descs, buffers = wire.pack(model)
    pool, ref = _sent(buffers)
    tensors = wire.read_shm(ref, descs, mapped=mapped)
    versions = [t._version for t in tensors]
    with torch.no_grad():
        tensors[0].add_(1)
    assert [t._version for t in tensors][1:] == versions[1:]
    if not mapped:
        got = wire.loads(payload, descs, [ref])
        got(torch.randn(5, 1, 8, 8)).sum().backward()  # the forward updates BatchNorm's buffers in place
        assert got[0].weight.grad is not None
    pool.close()


def test_models_received_again_land_in_the_memory_of_a_dropped_one(shm_dir):
    t = torch.randn(300_000)
    pool, ref = _sent([wire.to_buffer(t)])
    (first,) = wire.read_shm(ref, [wire.describe(t)])
    (second,) = wire.read_shm(ref, [wire.describe(t)])
    assert first.data_ptr() != second.data_ptr()  # the first is alive: its memory is not reused
    second.add_(1)
    assert torch.equal(first, t) and torch.equal(second, t + 1)
    ptr = first.data_ptr()
    del first
    (third,) = wire.read_shm(ref, [wire.describe(t)])
    assert third.data_ptr() == ptr and torch.equal(third, t)  # touched pages, the right bytes
    pool.close()


def test_loads_from_shared_memory_keeps_params_ties_and_buffers(shm_dir):
    m = Tied()
    payload, descs, buffers = wire.pack(m)
    with transfer.outgoing(FakeCluster(), buffers) as sent:
        assert len(sent) == 1 and isinstance(sent[0], wire.ShmRef)
        m2 = wire.loads(payload, descs, sent)
    assert m2.out.weight is m2.emb.weight and isinstance(m2.emb.weight, nn.Parameter)
    assert m2.emb.weight.requires_grad and m2.steps.item() == 7 and m2.empty.shape == (0,)
    assert torch.equal(m2.emb.weight, m.emb.weight)
    m2.emb.weight.data.add_(1)  # writable, independent of the kernel's model
    assert not torch.equal(m2.emb.weight, m.emb.weight)


def test_outgoing_gives_its_segment_back_on_failure_and_falls_back(shm_dir, monkeypatch):
    buffers = [wire.to_buffer(torch.ones(10))]
    with pytest.raises(RuntimeError):
        with transfer.outgoing(FakeCluster(), buffers) as sent:
            assert isinstance(sent[0], wire.ShmRef) and os.path.exists(sent[0].path)
            raise RuntimeError("a rank failed")
    assert [s.path for s in transfer._pool().free] == [sent[0].path] and not transfer._pool().busy
    with transfer.outgoing(FakeCluster(), buffers) as again:  # the next transfer reuses it
        assert again[0].path == sent[0].path
    # a rank that cannot see the kernel's /dev/shm: the bytes go in the messages
    with transfer.outgoing(FakeCluster(shm=(0,)), buffers) as sent:
        assert sent == buffers
    # /dev/shm full: the same
    transfer.sweep_shm()
    monkeypatch.setattr(segments, "Segment", lambda path, size, sparse=False: (_ for _ in ()).throw(OSError(28, "No space left")))
    with transfer.outgoing(FakeCluster(), buffers) as sent:
        assert sent == buffers


def test_rows_written_in_place_equal_fancy_indexing(shm_dir):
    x = torch.randn(101, 3, 4)
    y = torch.arange(101)
    flags = torch.arange(101) % 2 == 0
    idx = torch.randperm(101)[:60]
    with transfer.outgoing_rows(FakeCluster(), [x, y, flags], idx, ranks=[0]) as (descs, sent):
        assert isinstance(sent[0], wire.ShmRef)
        cols = wire.receive(descs, sent, mapped=True)
    assert list(transfer._pool().lent) == [sent[0].path]  # the rank maps it: not reused yet
    for got, full in zip(cols, (x, y, flags)):
        assert torch.equal(got, full[idx]) and got.dtype == full.dtype
    # ipyparallel fallback gives the same
    with transfer.outgoing_rows(FakeCluster(shm=()), [x, y, flags], idx, ranks=[0]) as (descs2, sent2):
        cols2 = wire.receive(descs2, sent2)
    assert descs2 == descs and all(torch.equal(a, b) for a, b in zip(cols, cols2))


def test_state_back_is_read_into_the_models_own_tensors(shm_dir, rank_shm):
    src, dst = Tied(), Tied()
    with torch.no_grad():
        src.emb.weight.mul_(3)
        src.steps.fill_(11)
    ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    versions = {k: v._version for k, v in dst.state_dict(keep_vars=True).items()}
    keys, descs, sizes, ref = stateout.flatten_state(src.state_dict())
    assert isinstance(ref, wire.ShmRef)
    transfer.load_state_into(dst, keys, descs, sizes, ref)
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k]) and v.data_ptr() == ptrs[k]  # in place, no new tensors
    # the version counters moved, so the kernel notices the model changed (fingerprint)
    assert all(v._version > versions[k] for k, v in dst.state_dict(keep_vars=True).items() if v.numel())


def test_state_back_converts_other_dtypes_and_reports_wrong_keys(shm_dir, rank_shm):
    src = nn.Linear(3, 2)
    dst = nn.Linear(3, 2).double()  # the kernel's model is float64: load_state_dict converts
    transfer.load_state_into(dst, *stateout.flatten_state(src.state_dict()))
    assert torch.equal(dst.weight, src.weight.double())
    packed = stateout.flatten_state({"other": torch.ones(2)})
    with pytest.raises(RuntimeError, match="Missing key"):
        transfer.load_state_into(dst, *packed)


def test_a_rank_writes_each_state_into_its_one_outbox(shm_dir, rank_shm):
    # the kernel reads a state into its model before the rank writes the next (distnb.transfer.weights_back)
    refs = [stateout.flatten_state({"a": torch.full((3,), float(i))})[3] for i in range(4)]
    assert len({r.path for r in refs}) == 1
    got = wire.unflatten_state(["a"], [wire.describe(torch.ones(3))], [12], refs[3])
    assert torch.equal(got["a"], torch.full((3,), 3.0))
    wire.drop_outstanding()  # leaving the group: the outbox is unlinked
    assert os.listdir(shm_dir) == []


def test_a_swept_segment_is_not_handed_out_again(shm_dir, rank_shm):
    # stopping another cluster of this kernel sweeps every distnb-<pid>-* file, a live rank's outbox too
    first = stateout.flatten_state({"a": torch.ones(3)})[3]
    second = stateout.flatten_state({"a": torch.ones(3)})[3]
    assert second.path == first.path and wire.sweep_shm(os.getpid()) == 1
    for _ in range(2):  # the outbox makes new files, which the kernel can read
        ref = stateout.flatten_state({"a": torch.full((3,), 5.0)})[3]
        assert ref.path not in (first.path, second.path) and os.path.exists(ref.path)
        got = wire.unflatten_state(["a"], [wire.describe(torch.ones(3))], [12], ref)
        assert torch.equal(got["a"], torch.full((3,), 5.0))


def test_sweep_removes_only_the_owners_files(shm_dir):
    mine, other = segments.Pool(4242, "k"), segments.Pool(4243, "k")
    a, b = mine.acquire(8), other.acquire(8)
    assert wire.sweep_shm(4242) == 1
    assert not os.path.exists(a.path) and os.path.exists(b.path)
    other.close()


def test_probe(shm_dir):
    path = os.path.join(str(shm_dir), "probe")
    with open(path, "w") as f:
        f.write("token")
    saved = dict(wire._SHM)
    try:
        assert wire.probe_shm(path, "token", 1) is True and wire._SHM["owner"] == 1
        assert wire.probe_shm(path, "wrong", 1) is False
        assert wire.probe_shm(path + "-missing", "token", 1) is False
    finally:
        wire._SHM.update(saved)
        os.unlink(path)


def test_real_dev_shm_left_clean():
    """Against the real /dev/shm (when there is one): the pool's segment stays for the next transfer
    and is gone when the cluster stops (``sweep_shm``)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    before = set(glob.glob(f"/dev/shm/distnb-{os.getpid()}-*"))
    t = torch.randn(1000)
    with contextlib.ExitStack() as stack:
        sent = stack.enter_context(transfer.outgoing(FakeCluster(), [wire.to_buffer(t)]))
        (back,) = wire.receive([wire.describe(t)], sent)
    assert torch.equal(back, t)
    assert set(glob.glob(f"/dev/shm/distnb-{os.getpid()}-*")) == before | {sent[0].path}
    transfer.sweep_shm()
    assert set(glob.glob(f"/dev/shm/distnb-{os.getpid()}-*")) == before
