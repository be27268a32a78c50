"""A failed rank keeps its frames for ``%dist debug`` and its broken gloo group still closes at once.

Two real processes form a gloo group with a DDP model. Rank 0 then waits in an all_reduce that
rank 1 never joins: rank 1 raises in a function holding the DDP wrapper, a tensor and a finished
collective's handle (``async_op=True``; it holds gloo's connections too), and does
what a failing ``%%dist`` cell does (distnb.engine.process.runtime.run_cell's except path: keep the
traceback, tear the group down). Rank 0 must fail within seconds, not the 30 s timeout, while
rank 1's kept frames still show the wrapper and the tensor through pdb; a fresh group then forms
while the frames are kept, and dropping them later leaves that group working.
"""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 30

CODE = r'''
import datetime, os, sys, time
rank, first, second = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(first), GLOO_SOCKET_IFNAME="lo")
import torch, torch.nn as nn, torch.distributed as dist
from distnb.engine.process import postmortem, runtime
torch.set_num_threads(1)
runtime.STATE.rank = rank
timeout = datetime.timedelta(seconds=TIMEOUT)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
torch.manual_seed(0)
ns = {"rank": rank, "model": nn.parallel.DistributedDataParallel(nn.Linear(4, 2))}
ns["model"](torch.randn(3, 4)).sum().backward()
dist.barrier()
if rank == 0:
    dist.broadcast(torch.ones(1), 0)
    time.sleep(0.5)  # rank 1 is failing meanwhile
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        print("RESULT returned")
    except RuntimeError as exc:
        print(f"RESULT failed {time.monotonic() - t0:.2f}", type(exc).__name__)
    dist.destroy_process_group()
else:
    def step(m, x):
        with torch.no_grad():  # a DDP forward without grad: no bucket rebuild, no collective
            y = m(x)
        work = dist.broadcast(torch.ones(1), 0, async_op=True)  # a handle holds gloo's connections too
        work.wait()
        raise ValueError("boom on rank 1")
    try:
        step(ns["model"], torch.arange(12.).reshape(3, 4))
    except ValueError as exc:  # as run_cell does
        postmortem.keep(exc, ns, "%%dist cell")
        runtime.mark_broken(ns)
    postmortem.debug_begin(ns)
    for c in ("p work", "p x.shape", "p type(m).__name__", "p m.module.weight.shape", "p y.sum().item() == y.sum().item()"):
        print("PDB", c, "=", postmortem.debug_command(ns, c)["text"].strip())
os.environ["MASTER_PORT"] = str(second)  # the kernel's re-form, frames still kept
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
print("REFORMED", t.item(), postmortem.debug_kept() is not None)
postmortem.drop(ns)
t = torch.ones(1)
dist.all_reduce(t)
print("AFTER DROP", t.item(), postmortem.debug_kept())
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
'''.replace("TIMEOUT", str(TIMEOUT))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_kept_frames_do_not_keep_the_broken_group_open():
    ports = [str(_port()), str(_port())]
    procs = [subprocess.Popen([sys.executable, "-c", CODE, str(r), *ports], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    result = next(line for line in outs[0].splitlines() if line.startswith("RESULT"))
    assert result.startswith("RESULT failed"), outs[0]
    seconds = float(result.split()[2])
    assert seconds < 10, f"rank 0 waited {seconds} s for the rank that failed (timeout {TIMEOUT} s)"
    pdb = dict(line[4:].split(" = ", 1) for line in outs[1].splitlines() if line.startswith("PDB "))
    assert pdb["p x.shape"] == "torch.Size([3, 4])"
    assert pdb["p work"] == "None"  # the collective's handle was taken out of the frame
    assert pdb["p type(m).__name__"] == "'DistributedDataParallel'"
    assert pdb["p m.module.weight.shape"] == "torch.Size([2, 4])"
    assert pdb["p y.sum().item() == y.sum().item()"] == "True"
    assert "REFORMED 3.0 False" in outs[0] and "REFORMED 3.0 True" in outs[1]  # rank 1 still keeps its frames
    assert "AFTER DROP 2.0 None" in outs[1]
