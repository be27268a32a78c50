"""Same-host transfers through /dev/shm on the real 2-rank cluster, and the ipyparallel fallback.

Models, pushed values and data shards arrive bit-exactly either way, the weights come back
into the kernel's own tensors, each rank holds only its shard, segments are reused from one
transfer to the next, and no file is left that a pool does not keep (after success or failure).
"""

import os

import pytest
import torch
import torch.nn.functional as F

from distnb.core import calls
from distnb.transfer import transfer
from distnb.engine.transport import shard
from distnb.core.errors import RankError
from support import shm
from support.data import blobs, mlp

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


@pytest.fixture
def no_shm(dist_session):
    """The ipyparallel path: the kernel sends bytes in messages and the ranks send them back so."""
    cluster = dist_session.cluster
    cluster._distnb_shm_ranks = frozenset()
    cluster.wait_all(cluster.apply_all(calls.probe_shm, "/nonexistent", "x", os.getpid()),
                     timeout=30, what="turning shared memory off")
    yield
    del cluster._distnb_shm_ranks  # probed again (and turned on again on the ranks) by the next transfer


def model():
    return mlp(12, 32, 3, seed=3)


def data():
    return blobs(101, seed=5, num_summed=1)


def ranks_flat(dist_session, name):
    dist_session.run(f"import torch\n_flat = torch.cat([p.detach().flatten() for p in {name}.parameters()])")
    return dist_session.pull("_flat")


@pytest.mark.parametrize("path", ["shm", "ipyparallel"])
def test_model_push_and_training_round_trip(dist_session, shell, request, path):
    if path == "ipyparallel":
        request.getfixturevalue("no_shm")
    else:
        assert transfer.shm_ranks(dist_session.cluster) == {0, 1}  # both ranks share this host's /dev/shm
    ns = shell.user_ns
    name = f"shm_net_{path}"
    ns[name], ns["shm_data"], ns["F"] = model(), data(), F
    ns["shm_blob"] = torch.arange(1000.0)
    dist_session.push("shm_blob")
    assert all(torch.equal(b, ns["shm_blob"]) for b in dist_session.pull("shm_blob"))

    kernel_params = [p for p in ns[name].parameters()]
    ptrs = [p.data_ptr() for p in kernel_params]
    dist_session.train(BODY, model=name, data="shm_data", epochs=2, batch_size=8, optimizer="adam", lr=0.01,
                       progress="none", quiet=True)
    # the weights came back into the kernel's own parameters (the same objects), equal to every rank's:
    # in the shared-memory path they now lie in memory of the kernel's pool (distnb.transfer.resident), else in place
    assert [p for p in ns[name].parameters()] == kernel_params
    if path == "shm":
        assert all(transfer._pool().ours(p.data_ptr(), p.numel() * 4) for p in kernel_params)
    else:
        assert [p.data_ptr() for p in ns[name].parameters()] == ptrs
    flats = ranks_flat(dist_session, name)
    kernel_flat = torch.cat([p.detach().flatten() for p in ns[name].parameters()])
    assert torch.equal(flats[0], kernel_flat) and torch.equal(flats[1], kernel_flat)
    # and a second cell continues from them
    r = dist_session.train(BODY, model=name, data="shm_data", epochs=1, batch_size=8, progress="none", quiet=True)
    assert r.epochs == [2]
    assert shm.strays() == []


def test_scatter_maps_only_its_shard(dist_session, shell):
    assert transfer.shm_ranks(dist_session.cluster) == {0, 1}
    x = torch.randn(1001, 6)
    y = torch.arange(1001)
    sizes = dist_session.scatter("shm_xy", (x, y))
    assert sizes == [501, 500]
    mine = shard.assign(1001, 2, 0)
    values = dist_session.pull("shm_xy")
    for r in (0, 1):
        assert torch.equal(values[r][0], x[mine[r]]) and torch.equal(values[r][1], y[mine[r]])
    # each rank's shard lives in one mapping the size of its shard (not of the whole set), and is writable
    dist_session.run("_nbytes = shm_xy[0].untyped_storage().nbytes()\nshm_xy[0].mul_(1)")
    for r, nbytes in enumerate(dist_session.pull("_nbytes")):
        assert sizes[r] * 6 * 4 <= nbytes < 1001 * 6 * 4
    back = dist_session.gather("shm_xy")
    assert torch.equal(back[0], x) and torch.equal(back[1], y)
    assert dist_session.scatter("shm_xy", (x, y)) == sizes  # scattered again
    values = dist_session.pull("shm_xy")
    assert all(torch.equal(values[r][0], x[mine[r]]) for r in (0, 1))
    # a tensor that shares its memory with numpy stays where it is
    arr = x.numpy().copy()
    from_numpy = torch.from_numpy(arr)
    dist_session.scatter("shm_np", from_numpy)
    assert from_numpy.data_ptr() == arr.ctypes.data
    assert torch.equal(dist_session.gather("shm_np"), x)
    assert shm.strays() == []


def test_scatter_fallback_gives_the_same_shards(dist_session, no_shm):
    x = torch.randn(301, 4)
    dist_session.scatter("shm_x_ipp", x)
    assert torch.equal(dist_session.gather("shm_x_ipp"), x)


def test_failed_transfer_leaves_no_file_and_the_cluster_works(dist_session, shell):
    shell.run_cell("import torch\n"
                   "def _shm_explode():\n    raise ValueError('cannot be rebuilt here')\n"
                   "class ShmUnpicklable:\n    def __reduce__(self):\n        return (_shm_explode, ())\n"
                   "shm_bad = {'big': torch.ones(1 << 16), 'bad': ShmUnpicklable()}")
    with pytest.raises(RankError, match="cannot be rebuilt here"):
        dist_session.push("shm_bad")
    assert shm.strays() == []  # its segment went back to the pool
    assert dist_session.run("1 + 1") == ["2", "2"]


def test_a_model_sent_again_reuses_the_kernels_segment_and_the_ranks_memory(dist_session, shell):
    ns = shell.user_ns
    torch.manual_seed(0)
    ns["shm_again"] = torch.nn.Sequential(torch.nn.Linear(1000, 1500))  # 6 MB: an arena of a size of its own
    dist_session.push("shm_again")
    first = {s.path for s in transfer._pool().free}
    dist_session.run("_ptr = shm_again.state_dict()['0.weight'].data_ptr()")
    ptrs = dist_session.pull("_ptr")
    dist_session.run("del shm_again")  # the ranks drop it: its memory is theirs to reuse
    with torch.no_grad():
        ns["shm_again"][0].weight.add_(1)
    dist_session.push("shm_again")
    assert {s.path for s in transfer._pool().free} == first  # written again, not made anew
    dist_session.run("_ptr = shm_again.state_dict()['0.weight'].data_ptr()")
    assert dist_session.pull("_ptr") == ptrs  # landed where the dropped copy was
    for m in dist_session.pull("shm_again"):  # and holds the new weights
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ns["shm_again"].state_dict().values()))


def test_scatter_again_reuses_the_segments_the_ranks_let_go(dist_session):
    x = torch.randn(40_000, 160)  # shards of 12.8 MB: bigger than any other segment of this session
    pool = transfer._pool()

    def big():
        return {s.path for s in [*pool.free, *pool.lent.values()] if s.size >= 12 << 20}

    for i in range(4):  # each new shard arrives while the old one is still bound, then replaces it
        dist_session.scatter("shm_sc", x + i)
        assert torch.equal(dist_session.gather("shm_sc"), x + i)  # a reused segment never shows another's data
    assert len(big()) <= 4  # made anew each time, it would be 8
    assert shm.strays() == []


def _resident(net) -> bool:
    return all(transfer._pool().ours(t.data_ptr(), t.numel() * t.element_size())
               for t in net.state_dict().values() if t.numel())


def test_a_trained_model_is_sent_again_with_no_copy_in_the_kernel(dist_session, shell):
    from distnb.transfer import resident
    from distnb.engine.transport import wire

    ns = shell.user_ns
    ns["res_net"], ns["res_data"], ns["F"] = model(), data(), F
    net, pool = ns["res_net"], transfer._pool()
    dist_session.train(BODY, model="res_net", data="res_data", epochs=1, batch_size=8, progress="none", quiet=True)
    assert _resident(net)
    ref = resident.in_place(pool, wire.pack(net)[2])  # what the next send sends: where the bytes lie
    assert ref is not None and ref.path in pool.resident
    before = (len(pool.free), set(pool.resident))
    dist_session.train(BODY, model="res_net", data="res_data", epochs=1, batch_size=8, progress="none",
                       quiet=True, reset=True)  # sent again (reset: in place, no copy) and trained: weights back in place
    assert _resident(net) and set(pool.resident) == before[1]  # the model stays in its one segment
    dist_session.train(BODY, model="res_net", data="res_data", epochs=1, batch_size=8, progress="none", quiet=True)
    assert set(pool.resident) == before[1] and len(pool.free) <= before[0]  # no second model-sized segment
    assert shm.strays() == []


def test_a_tensor_something_else_shares_stays_where_it_is(dist_session, shell):
    ns = shell.user_ns
    ns["alias_net"], ns["alias_data"], ns["F"] = model(), data(), F
    net = ns["alias_net"]
    alias = net[0].weight.detach()  # shares net[0].weight's memory, as in plain PyTorch
    shown = net[2].weight.detach().numpy()  # handed to numpy: it may still be read or written there
    dist_session.train(BODY, model="alias_net", data="alias_data", epochs=1, batch_size=8, optimizer="adam",
                       lr=0.05, progress="none", quiet=True)
    assert alias.data_ptr() == net[0].weight.data_ptr() and torch.equal(alias, net[0].weight)  # trained, still shared
    assert torch.equal(torch.from_numpy(shown), net[2].weight.detach())
    assert transfer._pool().ours(net[0].bias.data_ptr(), 4)  # what nothing else shares moved
    assert not transfer._pool().ours(net[0].weight.data_ptr(), 4)
