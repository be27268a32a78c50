"""On nccl the group's store is armed too: an announced failure aborts the communicators (GPU review, finding 1).

No GPU here, so no nccl group: a real TCPStore (rank 0's, on loopback) and abort.arm(..., "nccl") as
runtime._init_group calls it for an nccl world. Checked: the store is armed without gloo sockets,
agree_on_steps has its store, and when another rank announces a failure, poll() (the watchdog
thread's look) records it once, ends distnb's pending DDP futures, and calls ncclfail.abort_groups,
the one step that needs a GPU, replaced here by a recorder. Runs in a subprocess.
"""

import subprocess
import sys

CODE = r'''
import datetime
import torch.distributed as dist
from distnb.engine.process import abort, ncclfail

store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30))  # a port of its own: no race
calls = []
ncclfail.abort_groups = lambda: calls.append("abort") or True
abort.arm(store, "distnb-group-0/", abort.socket_fds(), "nccl")
assert abort.ARMED.store is not None and abort.ARMED.sockets == {} and abort.ARMED.backend == "nccl"
assert abort.poll() is False and calls == []  # nothing announced: nothing aborted

peer = dist.PrefixStore("distnb-group-0/", store)
peer.set(abort.KEY, "1")  # rank 1 announced its failure
assert abort.poll() is True and calls == ["abort"] and abort.ARMED.by == 1
assert abort.poll() is False and calls == ["abort"]  # once
named = abort.consequence(RuntimeError("NCCL communicator was aborted on rank 0"), 0)
assert "rank 1 failed" in str(named), named
abort.disarm()
assert abort.ARMED.backend is None
print("ok")
'''


def test_an_announced_failure_aborts_the_nccl_communicators():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
