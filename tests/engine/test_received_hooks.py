"""A module received by a rank keeps its hooks when the rank registers hooks of its own (FSDP2's, DDP's, distnb's).

torch keys a module's hooks by a counter of the process that registered them
(``torch.utils.hooks.RemovableHandle.next_id``); a fresh engine's counter starts at 0, so the first
hook it registered on a received module took the key of the module's own first hook and replaced it:
a ``torch.nn.utils.weight_norm`` layer under ``--strategy fsdp`` silently never trained ``weight_g`` and
``weight_v``. ``wire.loads`` now moves the counter past every key the module came with. Runs in a
subprocess, as a fresh engine: a world of 1 (gloo).
"""

import subprocess
import sys

CODE = r'''
import os, socket, warnings
warnings.simplefilter("ignore", FutureWarning)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.hooks import RemovableHandle
from distnb.engine.transport import wire

torch.manual_seed(0)
net = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 3)), nn.Linear(3, 2))
net[1].register_forward_hook(lambda m, args, y: y * 0.5)
assert sorted(net[0]._forward_pre_hooks) == [0] and sorted(net[1]._forward_hooks) == [1]
payload, descs, buffers = wire.pack(net)
RemovableHandle.next_id = 0  # a fresh engine
got = wire.loads(payload, descs, buffers)
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
fully_shard(got[0], mesh=mesh); fully_shard(got[1], mesh=mesh); fully_shard(got, mesh=mesh)
kinds = [type(h).__name__ for h in got[0]._forward_pre_hooks.values()]
assert "WeightNorm" in kinds, kinds
x = torch.randn(5, 4)
got(x).sum().backward()
assert got[0].weight_g.grad is not None and got[0].weight_v.grad is not None
torch.testing.assert_close(got(x).full_tensor() if hasattr(got(x), "full_tensor") else got(x), net(x))
dist.destroy_process_group()
print("ok")
'''


def test_a_received_modules_hooks_survive_the_ranks_own():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
