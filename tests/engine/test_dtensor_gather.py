"""engine/transport/gather.py: a DTensor placed whole on rank 0 from every rank's shard, equal to ``full_tensor()``.

Runs in a subprocess with a world of 4 (gloo, four processes, a 1-D and a 2x2 mesh): even and uneven
shards on either dimension, more ranks than rows (empty shards), replicated tensors and 0-d ones, each
sent in messages of a few bytes so that every piece takes several. Rank 0's result must equal the
tensor the DTensor was cut from, bit for bit, and the ranks must not all-gather it.
"""

from support.spawned import run_ranks

CODE = r'''
import os
import torch, torch.distributed as dist
from distnb.engine.transport import gather


def cases(mesh1, mesh2):
    from torch.distributed.tensor import Replicate, Shard
    yield "rows even", (8, 5), mesh1, [Shard(0)]
    yield "rows uneven", (7, 3), mesh1, [Shard(0)]
    yield "columns uneven", (5, 10), mesh1, [Shard(1)]
    yield "more ranks than rows", (2, 3), mesh1, [Shard(0)]
    yield "replicated", (3, 4), mesh1, [Replicate()]
    yield "0-d", (), mesh1, [Replicate()]
    yield "1-d uneven", (9,), mesh1, [Shard(0)]
    yield "3-d middle", (2, 7, 3), mesh1, [Shard(1)]
    yield "2-D mesh, both dims", (6, 9), mesh2, [Shard(0), Shard(1)]
    yield "2-D mesh, replicated outer", (5, 4), mesh2, [Replicate(), Shard(0)]
    yield "2-D mesh, same dim twice", (11, 2), mesh2, [Shard(0), Shard(0)]


def main(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=4)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    gather.CHUNK_BYTES = 16  # a few elements per message: every piece takes several
    mesh1, mesh2 = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    calls = []
    real = dist.all_gather_into_tensor
    dist.all_gather_into_tensor = lambda *a, **k: calls.append(1) or real(*a, **k)
    for i, (what, shape, mesh, placements) in enumerate(cases(mesh1, mesh2)):
        torch.manual_seed(i)
        full = torch.randn(shape)
        t = distribute_tensor(full, mesh, placements, src_data_rank=None)  # cut locally, nothing sent
        assert gather.supported(t), what
        dst = torch.full(shape, float("nan")) if rank == 0 else None
        gather.gather_into(t, dst)
        if rank == 0:
            assert torch.equal(dst, full), what
    assert not calls, "gather_into all-gathered"
    assert not gather.supported(torch.zeros(3))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort a process at exit after a group (FIELD-NOTES pitfall 1): mp.spawn read it as a failure

'''


def test_every_shard_placed_on_rank_0_equals_the_whole_tensor(tmp_path):
    run_ranks(tmp_path, CODE, nprocs=4)
