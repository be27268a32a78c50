"""Notebook tensors that move into the kernel's shared memory (distnb/transfer/resident.py), in one process.

A tensor moves only when nothing can notice: the same object, values, version counter and
``requires_grad``; a tensor sharing memory with another tensor or with numpy stays where it is.
A moved tensor is sent again from where it lies (no copy), its segment is never handed out while
it lives, and it is free again once the tensors on it are gone, also after the pool was closed.
"""

import gc
import io
import os

import numpy as np
import torch
import torch.nn as nn

from distnb.transfer import resident, transfer
from distnb.engine.transport import stateout, wire
from support.shm import rank_shm, shm_dir  # noqa: F401  (fixtures)


class FakeCluster:
    """What outgoing and Offer need of a cluster: world_size and the probed ranks."""

    world_size = 2
    _distnb_shm_ranks = frozenset({0, 1})


def _send(model):
    """What ensure_model does: decide what may move, pack, send through the kernel's pool."""
    keep = resident.movable(model.state_dict(keep_vars=True).values(), transfer._pool())
    _, _, buffers = wire.pack(model)
    with transfer.outgoing(FakeCluster(), buffers, keep=keep) as sent:
        ref = sent[0]
        got = wire.read_shm(ref, [wire.describe(t) for t in model.state_dict().values()])  # a rank's copy
    return ref, got


def _ours(model) -> bool:
    pool = transfer._pool()
    return all(pool.ours(t.data_ptr(), t.numel() * t.element_size()) for t in model.state_dict().values())


def test_a_sent_model_moves_into_its_segment_unchanged_and_is_sent_again_in_place(shm_dir):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 30), nn.BatchNorm1d(30))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = list(net.parameters())
    versions = [p._version for p in params]
    ref, got = _send(net)
    assert _ours(net) and ref.path in transfer._pool().resident
    assert list(net.parameters()) == params and [p._version for p in params] == versions
    assert all(p.requires_grad for p in params)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(got, before.values()))
    again = resident.in_place(transfer._pool(), wire.pack(net)[2])  # found where it lies: nothing to copy
    assert again is not None and again.path == ref.path
    net(torch.randn(4, 20)).sum().backward()  # autograd and in-place buffer updates work on it
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    ref2, got2 = _send(net)
    assert ref2.path == ref.path and torch.equal(got2[0], net[0].weight.detach())
    # each moved tensor has a storage of exactly its bytes: saving one layer writes that layer, and the float
    # weights and BatchNorm's int64 counter save together (torch refuses tensors of two dtypes on one storage)
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in net.state_dict().values())
    buf = io.BytesIO()
    torch.save(net.state_dict(), buf)
    buf.seek(0)
    assert all(torch.equal(a, b) for a, b in zip(torch.load(buf).values(), net.state_dict().values()))
    one = io.BytesIO()
    torch.save(net[0].bias, one)
    assert len(one.getvalue()) < 4 * net[0].weight.nbytes


def test_what_shares_memory_with_something_else_stays_put(shm_dir):
    net = nn.Linear(8, 8)
    alias = net.weight.detach()
    arr = np.zeros((3, 3), dtype=np.float32)
    from_numpy = torch.from_numpy(arr)
    exported = torch.ones(5)
    exported.numpy()
    view_of = torch.arange(10.0)
    part = view_of[2:5]
    moving = resident.movable([net.weight, net.bias, from_numpy, exported, part, torch.zeros(0)], transfer._pool())
    assert [id(t) for t in moving] == [id(net.bias)]
    del alias
    assert [id(t) for t in resident.movable([net.weight], transfer._pool())] == [id(net.weight)]


def test_a_resident_segment_is_not_handed_out_and_is_given_back_once_its_tensors_go(shm_dir):
    pool = transfer._pool()
    net = nn.Linear(100, 100)
    ref, _ = _send(net)
    assert all(s.path != ref.path for s in pool.free)
    other = pool.acquire(100 * 100 * 4)
    assert other.path != ref.path
    pool.release(other)
    del net
    gc.collect()  # a deleted model's memory leaves with it: not kept idle in the pool (the kernel stays flat)
    assert ref.path not in pool.resident and all(s.path != ref.path for s in pool.free)
    assert not os.path.exists(ref.path)


def test_weights_back_are_read_into_the_kernels_own_memory_in_place(shm_dir, rank_shm):
    torch.manual_seed(1)
    kernel, rank = nn.Linear(50, 40), nn.Linear(50, 40)
    _send(kernel)
    first = set(transfer._pool().resident)
    ptrs = {k: v.data_ptr() for k, v in kernel.state_dict().items()}
    outboxes = set()
    for step in range(3):
        with torch.no_grad():
            rank.weight.add_(1.0)
        keys, descs, sizes, ref = stateout.flatten_state(rank.state_dict())  # into the rank's own outbox
        outboxes.add(ref.path)
        transfer.load_state_into(kernel, keys, descs, sizes, ref)
        assert all(torch.equal(kernel.state_dict()[k], v) for k, v in rank.state_dict().items())
        assert {k: v.data_ptr() for k, v in kernel.state_dict().items()} == ptrs  # no new memory in the kernel
        assert _ours(kernel) and set(transfer._pool().resident) == first and not transfer._pool().free
    assert len(outboxes) == 1  # the rank writes every state into its one outbox


def test_after_the_pool_closes_moved_tensors_stay_valid_and_move_again(shm_dir):
    net = nn.Linear(30, 30)
    _send(net)
    weight = net.weight.detach().clone()
    transfer.sweep_shm()  # %dist stop: files unlinked, mappings live on under the tensors
    assert torch.equal(net.weight.detach(), weight) and _ours(net)
    ref, got = _send(net)  # the next cluster: written once more, then in place again
    assert ref.path in transfer._pool().resident and torch.equal(got[0], weight)
