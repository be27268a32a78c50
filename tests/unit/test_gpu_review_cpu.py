"""The GPU review's findings 4, 6, 8, 10 and 14, checked on the CPU (tests/gpu/REVIEW-ANSWERS.md).

Nothing here stands in for a GPU: the checks are of logic that must not depend on the device
(the NaN stop), of what the CPU side does itself (the host's per-cell peak, /dev/shm headroom,
compile workers), and of host reads counted with a ``TorchFunctionMode`` (every ``.item()``,
``float()``, ``.tolist()``, ``bool()`` of a tensor: on a GPU each is a synchronisation).
What needs a GPU is in tests/gpu/check_gpu.py.
"""

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from distnb.engine.transport import lazyread, peaks, segments
from distnb.engine.train import stepping
from distnb.engine.process.precision_check import precision_note
from distnb.engine.strategies import check_loss
from distnb.cluster.gpuhost import kernel_cuda_note
from distnb.core.plan import TrainPlan

REPO = Path(__file__).resolve().parents[2]
#: Tensor methods that read a value into Python: on a CUDA tensor each waits for the GPU.
READS = {"item", "__float__", "__int__", "__bool__", "tolist", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Counts the host reads of tensors made while it is active (by method name)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class Elsewhere(torch.Tensor):
    """A loss whose device reads as another than the CPU: the NaN check may not depend on where the loss is."""

    @property
    def device(self):
        return torch.device("meta")


def _ctx(nan="stop"):
    return types.SimpleNamespace(plan=TrainPlan(model="m", data="d", nan=nan), rank=1, epoch=2, step=3)


def _loss(value):
    w = torch.ones(3, requires_grad=True)
    return (w * value).sum().as_subclass(Elsewhere)


def test_nan_stop_holds_for_a_loss_that_is_not_on_the_cpu():
    loss = _loss(float("nan"))
    assert loss.device.type != "cpu" and loss.requires_grad
    with pytest.raises(FloatingPointError, match="rank 1, epoch 2, step 3"):
        check_loss(loss, _ctx())
    assert check_loss(_loss(float("inf")), _ctx("skip")) == math.inf  # skip: the loop drops the step
    with HostReads() as mode:
        assert check_loss(_loss(2.0), _ctx()) == 6.0
    assert mode.reads == ["item"]  # one read per step, the value then serves the report


def test_the_host_peak_is_per_cell():
    peaks.start_cell(None)
    big = torch.ones(64 << 20)  # 256 MiB, touched
    first, kind = peaks.peak_memory(None)
    del big
    peaks.start_cell(None)
    second, kind2 = peaks.peak_memory(None)
    assert (kind, kind2) == ("rss", "rss")  # Linux: VmHWM reset through /proc/self/clear_refs
    assert first - second > 200 << 20, (first, second)


def test_compile_workers_are_the_rank_s_share_of_cores():
    code = ("import os\nfrom distnb.engine.process import compile_workers\nimport torch._inductor.config as c\n"
            "print(compile_workers.limit(), c.compile_threads, os.environ['TORCHINDUCTOR_COMPILE_THREADS'])")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "3"}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["3", "3", "3"], out.stderr
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "5"  # the user's choice stays
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["5", "5", "5"], out.stderr


def test_clipping_reads_nothing_and_matches_torch():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    ref.load_state_dict(net.state_dict())
    x = torch.randn(3, 5)
    (net(x).sum() * 50).backward()
    (ref(x).sum() * 50).backward()
    with HostReads() as mode:
        norm = stepping.total_norm(list(net.parameters()), False, torch.device("cpu"))
        stepping.clip_(list(net.parameters()), 0.5, norm)
    assert mode.reads == []
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert float(norm) == pytest.approx(float(want), rel=1e-6)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    before = [p.grad.clone() for p in net.parameters()]
    stepping.clip_(list(net.parameters()), 1e9, norm)  # a coefficient of 1: gradients exactly as they were
    stepping.clip_(list(net.parameters()), 0.5, torch.tensor(math.nan, dtype=torch.float64))  # non-finite: left
    assert all(torch.equal(a, p.grad) for a, p in zip(before, net.parameters()))


def test_a_reading_of_a_cpu_scalar_is_exact():
    r = lazyread.Latest()
    assert r.offer(torch.tensor(2.5)) == 2.5 and r.offer(1.25) == 1.25 and r.now(torch.tensor(3.0)) == 3.0


def test_the_shm_pool_leaves_headroom(monkeypatch):
    room = segments.shm_room()
    if room is None:
        pytest.skip(f"{segments.SHM_DIR} cannot be read")
    pool = segments.Pool(os.getpid(), "headroom-test")
    try:
        monkeypatch.setattr(segments, "HEADROOM", room - (2 << 20))  # 2 MiB left to distnb
        with pytest.raises(OSError, match="DISTNB_SHM_HEADROOM"):
            pool.acquire(4 << 20)
        monkeypatch.setattr(segments, "HEADROOM", 0)
        seg = pool.acquire(4 << 20)
        pool.release(seg)
        assert pool.free == [seg]  # kept for the next transfer while there is room
        monkeypatch.setattr(segments, "HEADROOM", segments.shm_room() + seg.size - (1 << 20))
        pool.trim()
        assert pool.free == [] and not os.path.exists(seg.path)  # an idle segment never eats the headroom
    finally:
        pool.close()


def test_gpu_notes_say_nothing_on_the_cpu():
    assert precision_note("bf16", torch.device("cpu")) == ""
    assert kernel_cuda_note("cuda") == ""  # this process never made a CUDA context
    assert not torch.cuda.is_initialized()
