"""runtime.drop_captured_group: a torch module imported while a group exists must not keep it alive.

torch has functions whose default argument is ``group=dist.group.WORLD``, evaluated at import;
imported after ``init_process_group`` (distnb's engines import torch._dynamo, which pulls them
in, while the group forms) they would hold the group past ``destroy_process_group``, and a failed
rank's peers would wait for the collective timeout. Runs in a subprocess: a world of 1 (gloo).
"""

import subprocess
import sys

CODE = r'''
import gc, os, socket, sys, types, weakref
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
import torch, torch.distributed as dist
from distnb.engine.process import runtime
dist.init_process_group("gloo", rank=0, world_size=1)
world = dist.group.WORLD
alive = weakref.ref(world)

# what torch.distributed.nn.functional and friends do at import: a default bound to the live group
mod = types.ModuleType("torch._distnb_capture_test")
exec("import torch.distributed as dist\n"
     "def all_reduce(t, group=dist.group.WORLD):\n    return group\n"
     "def kw(t, *, group=dist.group.WORLD):\n    return group\n"
     "class Scaler:\n    def __init__(self, process_group=dist.group.WORLD):\n        self.pg = process_group\n"
     "    @staticmethod\n    def s(group=dist.group.WORLD):\n        return group\n", mod.__dict__)
sys.modules[mod.__name__] = mod
assert mod.all_reduce(None) is world

changed = runtime.drop_captured_group(world)
assert changed == 4, changed
assert mod.all_reduce(None) is None and mod.kw(None) is None and mod.Scaler().pg is None and mod.Scaler.s() is None
del world
dist.destroy_process_group()
gc.collect()
assert alive() is None, "the destroyed group is still referenced"
print("ok")
'''


def test_captured_default_group_is_released():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
