"""engine/strategies/moved.py: the tensor-plan check's moved weights, one module at a time and in place.

A subprocess with a world of 2 (gloo): a block with a replicated LayerNorm, a column-/row-wise pair (the
row-wise bias replicated) and a replicated head. Within :class:`MovedPerModule` the whole model (a meta
skeleton run one module at a time) and the split one must give the same output at the moved weights,
and different from the unmoved one; afterwards every parameter of the split model is bit for bit what it
was, and none was copied whole (the noise is made per block of rows; a rank makes only its rows).
:class:`MovedInPlace` must move the held whole model and the shards alike, and put the shards back.
"""

import torch

from distnb.engine.strategies import moved

from support.spawned import run_ranks

CODE = r'''
import os
import torch, torch.nn as nn, torch.distributed as dist
from distnb.engine.strategies import layered, moved, tensor_check


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2, self.head = nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(x + self.fc2(torch.relu(self.fc1(self.norm(x)))))


def main(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    moved.BLOCK_BYTES = 256  # a few rows per block: the shards' rows cross blocks
    torch.manual_seed(0)
    split = Block()
    whole = tensor_check.skeleton(split)
    parallelize_module(split, init_device_mesh("cpu", (2,)), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    before = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in split.named_parameters()}
    x = torch.randn(4, 16)
    with torch.no_grad():
        with layered.LayerByLayer(whole, split) as layers:
            with layered.no_placeholders():
                at_weights = whole(x)
            with moved.MovedPerModule(split, torch.device("cpu"), layers):
                with layered.no_placeholders():
                    a = whole(x)
                b = split(x)
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
        assert not torch.allclose(a, at_weights, atol=1e-3)  # the weights did move
        for n, p in split.named_parameters():
            assert torch.equal((p.to_local() if hasattr(p, "to_local") else p), before[n]), n
        # in place, with the whole model held: the same moved output, the shards back bit for bit
        held = Block()
        held.load_state_dict({k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in
                              split.state_dict().items()})
        with moved.MovedInPlace(held, split, torch.device("cpu")):
            c, d = held(x), split(x)
        assert torch.allclose(c, d, atol=1e-6) and torch.allclose(c, a, atol=1e-6)
        for n, p in split.named_parameters():
            assert torch.equal((p.to_local() if hasattr(p, "to_local") else p), before[n]), n
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort a process at exit after a group (FIELD-NOTES pitfall 1): mp.spawn read it as a failure

'''


def test_moved_per_module_and_in_place_agree_and_put_every_weight_back(tmp_path):
    run_ranks(tmp_path, CODE, nprocs=2)


def test_any_rows_of_the_noise_are_those_of_the_whole_tensor():
    """A shard's rows, made alone, equal the same rows of the whole tensor's noise; each parameter has its own."""
    shape = (37, 11)
    whole = moved.noise_rows(3, shape, 0, 37)
    assert whole.shape == shape and whole.dtype == torch.float32
    for start, stop in ((0, 1), (5, 23), (36, 37), (12, 12)):
        assert torch.equal(moved.noise_rows(3, shape, start, stop), whole[start:stop])
    assert not torch.equal(moved.noise_rows(4, shape, 0, 37), whole)
    dst = torch.zeros(10, 4)
    moved.add_noise(dst, 3, shape, (20, 7), 2.0)  # a (10, 4) shard at rows 20-29, columns 7-10
    assert torch.equal(dst, whole[20:30, 7:11] * 2.0)
    scalar = torch.zeros(())
    moved.add_noise(scalar, 5, (), (), 1.0)
    assert float(scalar) == float(moved.noise_rows(5, (), 0, 1)[0])
