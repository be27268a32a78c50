"""The shared-memory path of the wire format (engine/wire.py, transfer.py), in one process.

Every file a transfer creates is gone afterwards, whether it succeeded or failed.
"""

import contextlib
import glob
import os

import numpy as np
import pytest
import torch
import torch.nn as nn

from distnb import transfer
from distnb.engine import wire


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A private folder standing in for /dev/shm (same code path; files checked afterwards)."""
    monkeypatch.setattr(wire, "SHM_DIR", str(tmp_path))
    yield tmp_path
    assert os.listdir(tmp_path) == [], "a transfer left files behind"


@pytest.fixture
def rank_shm(monkeypatch):
    """This process plays a rank whose probe succeeded (flatten_state writes shared memory)."""
    monkeypatch.setitem(wire._SHM, "ok", True)
    monkeypatch.setitem(wire._SHM, "owner", os.getpid())
    monkeypatch.setitem(wire._SHM, "outstanding", [])


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
    ref = wire.write_shm([wire.to_buffer(t) for t in tensors], os.getpid(), "t")
    assert all(off % 64 == 0 for off in ref.offsets)
    descs = [wire.describe(t) for t in tensors]
    for mapped in (False, True):
        back = wire.read_shm(ref, descs, mapped=mapped)
        for a, b in zip(back, tensors):
            assert a.dtype == dtype and torch.equal(a, b)
    ref.unlink()


def test_big_transfer_uses_chunks_and_threads(shm_dir, monkeypatch):
    monkeypatch.setattr(wire, "_CHUNK", 4096)  # many pieces, spread over threads
    t = torch.randn(100_003)  # not a multiple of the chunk
    ref = wire.write_shm([wire.to_buffer(t), wire.to_buffer(t[:5].clone())], os.getpid(), "t")
    (a, b) = wire.read_shm(ref, [wire.describe(t), wire.describe(t[:5])])
    assert torch.equal(a, t) and torch.equal(b, t[:5])
    ref.unlink()


def test_mapped_read_is_copy_on_write(shm_dir):
    t = torch.arange(1000, dtype=torch.float32)
    ref = wire.write_shm([wire.to_buffer(t)], os.getpid(), "t")
    (m,) = wire.read_shm(ref, [wire.describe(t)], mapped=True)
    m.mul_(2)  # a rank writing to its shard changes only its own copy
    (again,) = wire.read_shm(ref, [wire.describe(t)])
    assert torch.equal(again, t) and torch.equal(m, t * 2)
    ref.unlink()  # the mapping outlives the name
    assert torch.equal(m, t * 2)


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


def test_outgoing_unlinks_on_failure_and_falls_back(shm_dir, monkeypatch):
    buffers = [wire.to_buffer(torch.ones(10))]
    with pytest.raises(RuntimeError):
        with transfer.outgoing(FakeCluster(), buffers) as sent:
            assert isinstance(sent[0], wire.ShmRef) and os.path.exists(sent[0].path)
            raise RuntimeError("a rank failed")
    # a rank that cannot see the kernel's /dev/shm: the bytes go in the messages
    with transfer.outgoing(FakeCluster(shm=(0,)), buffers) as sent:
        assert sent == buffers
    # /dev/shm full: the same
    monkeypatch.setattr(wire, "_create", lambda path, total: (_ for _ in ()).throw(OSError(28, "No space left")))
    with transfer.outgoing(FakeCluster(), buffers) as sent:
        assert sent == buffers


def test_rows_written_in_place_equal_fancy_indexing(shm_dir, monkeypatch):
    monkeypatch.setattr(wire, "_CHUNK", 256)  # several gather chunks per column
    x = torch.randn(101, 3, 4)
    y = torch.arange(101)
    flags = torch.arange(101) % 2 == 0
    idx = torch.randperm(101)[:60]
    with transfer.outgoing_rows(FakeCluster(), [x, y, flags], idx, ranks=[0]) as (descs, sent):
        assert isinstance(sent[0], wire.ShmRef)
        cols = wire.receive(descs, sent, mapped=True)
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
    keys, descs, sizes, ref = wire.flatten_state(src.state_dict())
    assert isinstance(ref, wire.ShmRef) and wire._SHM["outstanding"] == [ref.path]
    transfer.load_state_into(dst, keys, descs, sizes, ref)
    assert not os.path.exists(ref.path)
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k]) and v.data_ptr() == ptrs[k]  # in place, no new tensors
    # the version counters moved, so the kernel notices the model changed (fingerprint)
    assert all(v._version > versions[k] for k, v in dst.state_dict(keep_vars=True).items() if v.numel())
    wire.drop_outstanding()  # already collected: nothing to do, no error


def test_state_back_converts_other_dtypes_and_reports_wrong_keys(shm_dir, rank_shm):
    src = nn.Linear(3, 2)
    dst = nn.Linear(3, 2).double()  # the kernel's model is float64: load_state_dict converts
    transfer.load_state_into(dst, *wire.flatten_state(src.state_dict()))
    assert torch.equal(dst.weight, src.weight.double())
    packed = wire.flatten_state({"other": torch.ones(2)})
    with pytest.raises(RuntimeError, match="Missing key"):
        transfer.load_state_into(dst, *packed)
    assert not os.path.exists(packed[3].path)  # unlinked even though loading failed


def test_uncollected_state_is_dropped_by_the_next_one(shm_dir, rank_shm):
    first = wire.flatten_state({"a": torch.ones(3)})[3]
    second = wire.flatten_state({"a": torch.zeros(3)})[3]  # the kernel never read `first`
    assert not os.path.exists(first.path) and os.path.exists(second.path)
    wire.drop_outstanding()
    assert not os.path.exists(second.path)


def test_sweep_removes_only_the_owners_files(shm_dir):
    mine = wire.write_shm([np.zeros(8, np.uint8)], 4242, "k")
    other = wire.write_shm([np.zeros(8, np.uint8)], 4243, "k")
    assert wire.sweep_shm(4242) == 1
    assert not os.path.exists(mine.path) and os.path.exists(other.path)
    other.unlink()


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
    """Against the real /dev/shm (when there is one): a full round trip leaves nothing."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    before = set(glob.glob(f"/dev/shm/distnb-{os.getpid()}-*"))
    t = torch.randn(1000)
    with contextlib.ExitStack() as stack:
        sent = stack.enter_context(transfer.outgoing(FakeCluster(), [wire.to_buffer(t)]))
        (back,) = wire.receive([wire.describe(t)], sent)
    assert torch.equal(back, t)
    assert set(glob.glob(f"/dev/shm/distnb-{os.getpid()}-*")) == before
