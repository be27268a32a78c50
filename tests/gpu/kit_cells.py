"""The cells of tests/gpu/check_gpu.py's checks (one function per check; see its docstring for the list).

Each function takes the check's ``figures`` dict first and fills it; :func:`kit.expect` fails it.
On one CPU rank (``--cpu``) they run the same cells on gloo, with smaller sizes.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import tempfile
import threading
import time

import kit
from kit import expect

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
OPTS = dict(data="kit_data", batch_size=128, optimizer="adam", lr=1e-3, progress="none", quiet=True)
#: The rank's free GPU memory (0 on a CPU rank) and what torch's allocator reserved.
FREE = ("import torch\n_free = torch.cuda.mem_get_info()[0] if device.type == 'cuda' else 0\n"
        "_reserved = torch.cuda.memory_reserved() if device.type == 'cuda' else 0")
#: Classes the data-path check trains from (defined in the notebook: cloudpickle sends them by value).
DATASETS = '''
import torch
class KitSet(torch.utils.data.Dataset):
    """The same samples as kit_data, through __getitem__ (a Dataset's path: DataLoader, pinned on GPU ranks)."""
    def __init__(self, x, y):
        self.x, self.y = x, y
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

class EmptyStream(torch.utils.data.IterableDataset):
    """A stream with no sample (distnb's error path for a dry stream)."""
    def __iter__(self):
        return iter(())

class KitStream(torch.utils.data.IterableDataset):
    """An endless stream of kit_data's samples, in order."""
    def __init__(self, x, y):
        self.x, self.y = x, y
    def __iter__(self):
        i = 0
        while True:
            yield self.x[i % len(self.x)], self.y[i % len(self.y)]
            i += 1
'''
#: On a rank: count host synchronisations (torch.cuda.set_sync_debug_mode("warn") warns at each, naming its line).
SYNC_COUNT = '''
import collections, warnings, torch
_syncs = collections.Counter()
_shown = warnings.showwarning
def _count_sync(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" in str(message):
        _syncs[f"{filename.split('site-packages/')[-1].split('/distnb/')[-1]}:{lineno}"] += 1
    else:
        _shown(message, category, filename, lineno, file, line)
warnings.showwarning = _count_sync
warnings.filterwarnings("always", message=".*synchroniz.*")
torch.cuda.set_sync_debug_mode("warn")
'''
SYNC_OFF = "torch.cuda.set_sync_debug_mode(0)\nwarnings.showwarning = _shown\n_sync_top = _syncs.most_common(6)"


def namespace(samples: int = 4096) -> dict:
    """The notebook's data (``samples`` of 64 features, 10 classes; the first 512 as a validation set) and models.

    ``--cpu`` mode trains on 1024 (two shared cores, and bf16 emulated on this CPU).
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 64, generator=g)
    y = (x @ torch.randn(64, 10, generator=g)).argmax(1)

    def make(seed: int):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    return dict(torch=torch, nn=nn, F=F, make_net=make, kit_x=x, kit_y=y,
                kit_data=torch.utils.data.TensorDataset(x, y), kit_val=torch.utils.data.TensorDataset(x[:512], y[:512]))


def _rank(s, code: str, name: str):
    s.run(code)
    return s.pull(name)[0]


def start(fig, s, start_s, torch):
    spec = s.cluster.spec
    fig.update(start_seconds=round(start_s, 2), backend=spec.backend, device_type=spec.device_type,
               ranks=spec.num_engines, engine_pids=s.cluster.pids["engines"], kernel_pid=os.getpid())
    fig["rank_env"] = _rank(s, "import os\n_env = {k: v for k, v in os.environ.items() if k.startswith(("
                               "'TORCH_NCCL', 'NCCL_', 'CUDA_VISIBLE', 'LOCAL_', 'TORCHINDUCTOR', 'OMP_NUM'))}\n"
                               "_env['device'] = str(device)", "_env")
    # finding 5 (h39a): LOCAL_RANK names the rank's device, as under torchrun
    fig["local_rank"] = _rank(s, "import os, torch\n_lr = dict(LOCAL_RANK=os.environ.get('LOCAL_RANK'), "
                                 "LOCAL_WORLD_SIZE=os.environ.get('LOCAL_WORLD_SIZE'), device=str(device), "
                                 "current=torch.cuda.current_device() if device.type == 'cuda' else None)", "_lr")
    if spec.device_type == "cuda":
        expect(fig["local_rank"]["current"] == int(fig["local_rank"]["LOCAL_RANK"]),
               "torch.cuda.current_device() is not LOCAL_RANK")
    fig["kernel_cuda_initialized"] = torch.cuda.is_initialized()
    fig["nvidia_smi"] = kit.gpu_memory()
    expect(not fig["kernel_cuda_initialized"], "the kernel made a CUDA context")


def cpu_tensors_on_group(fig, s):
    """What a grow runs (finding 2): rank 0's models broadcast over the group, here right after a ddp cell."""
    from distnb.core import calls

    s.ns["share_net"] = s.ns["make_net"](1)
    s.train(BODY, model="share_net", epochs=1, **OPTS)
    got = s.cluster.wait_all(s.cluster.apply_all(calls.share, [], 1), timeout=60, what="share")
    fig["shared"] = {k: v for k, v in got[0].items() if k != "positions"}
    # the datasets error path (h39a's list): a stream empty on the only rank raises distnb's ValueError
    exec(DATASETS, s.ns)  # (classes made in the notebook travel by value)
    s.ns["empty_stream"] = s.ns["EmptyStream"]()
    try:
        s.train(BODY, model="share_net", epochs=1, **{**OPTS, "data": "empty_stream"})
        fig["empty_stream"] = "trained (no error)"
    except Exception as exc:
        fig["empty_stream"] = f"{type(exc).__name__}: {exc}"[:300]
    expect("No backend type" not in fig["empty_stream"] and fig["empty_stream"] != "trained (no error)",
           "an empty stream did not end with distnb's error")


def failure_cycles(fig, sh, s):
    """Three failing %%dist cells, a %%distrain failing at step 3, then a cell that trains; memory after each."""
    from distnb.core import calls

    s.ns["fc_net"] = s.ns["make_net"](2)

    def generation():  # finding 7 (h39a): a failed %%dist cell keeps a healthy group (the generation stays)
        c = _session().cluster
        return c.wait_all(c.apply_all(calls.info), timeout=30, what="info")[0].get("generation")

    cycles = []
    cells = ["%%dist\n1/0"] * 3 + ["%%distrain --model fc_net --data kit_data --epochs 1 --batch-size 128 "
                                   "--progress none\nx, y = batch\nif ctx.step == 3:\n    raise ValueError('kit: "
                                   "step 3')\nloss = F.cross_entropy(model(x), y)"]
    for source in cells:
        t0 = time.perf_counter()
        error = kit.cell(sh, source, expect_error=True)
        seconds = time.perf_counter() - t0
        s = _session()
        s.run(FREE)
        cycles.append(dict(cell=source.split("\n")[0][:20], seconds=round(seconds, 2), error=str(error)[:160],
                           free_bytes=s.pull("_free")[0], reserved_bytes=s.pull("_reserved")[0],
                           generation=generation()))
        expect(error is not None, f"{source!r} did not fail")
    fig["cycles"] = cycles
    r = s.train(BODY, model="fc_net", epochs=2, **OPTS)
    fig["losses_after"] = r.epoch_losses
    expect(r.epoch_losses[-1] < r.epoch_losses[0], "the cell after the failures did not train")
    frees = [c["free_bytes"] for c in cycles]
    fig["free_fell_bytes"] = frees[0] - min(frees)
    expect(frees[0] - min(frees) < 256 << 20, f"free GPU memory fell by {(frees[0] - min(frees)) >> 20} MiB")


def _session():
    from distnb import session

    return session.current()


def nan_stop(fig, sh, s):
    """--nan stop (the default): a NaN loss at step 3 ends the cell, naming step 3; the notebook's weights stay finite."""
    import torch

    ns = s.ns
    ns["nan_net"] = ns["make_net"](3)
    body = "x, y = batch\nloss = F.cross_entropy(model(x), y) * (float('nan') if ctx.step == 3 else 1.0)"
    try:
        s.train(body, model="nan_net", epochs=1, **OPTS)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    fig["error"] = (error or "")[:400]
    finite = all(bool(torch.isfinite(p).all()) for p in ns["nan_net"].parameters())
    fig["weights_finite"] = finite
    expect(error is not None and "FloatingPointError" in error and "step 3" in error,
           "a NaN loss at step 3 did not stop the cell with a FloatingPointError naming step 3")
    expect(finite, "the notebook's weights are not finite after the NaN stop")


def strategy(fig, sh, s, name, precision):
    """One strategy and precision on the world of one: the loss falls; the weights back are fp32 on the CPU."""
    import torch

    ns = _session().ns
    model = f"st_{name.replace('+', '_')}_{precision}"
    ns[model] = ns["make_net"](4)
    extra = dict(mesh="1x1") if name == "fsdp+tensor" else {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r = _session().train(BODY, model=model, epochs=3, strategy=name, precision=precision,
                             **{**OPTS, "quiet": False}, **extra)
    fig.update(losses=r.epoch_losses, samples_per_s=round(r.samples_per_s), wall_seconds=round(r.wall_seconds, 2),
               notes=[line for line in out.getvalue().splitlines() if "emulat" in line][:3])
    params = list(ns[model].parameters())
    fig["weights_back"] = sorted({f"{p.dtype}/{p.device}" for p in params})
    expect(r.epoch_losses[-1] < r.epoch_losses[0], "the loss did not fall")
    expect(all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params), "weights back not fp32 on CPU")


def peak_per_cell(fig, sh, s):
    """Finding 10: a cell that holds a big tensor at its first step, then a small cell: the second's peak is small."""
    s = _session()
    big = 2 << 30 if s.cluster.spec.device_type == "cuda" else 256 << 20
    s.ns["peak_net"] = s.ns["make_net"](5)
    read = ("from distnb.engine.transport.report import peak_memory\n_peak = peak_memory(device)\n"
            "_res = torch.cuda.max_memory_reserved() if device.type == 'cuda' else 0")
    peaks = []
    for held in (big, 0):
        body = (f"import torch\nx, y = batch\n_big = torch.ones({held // 4}, device=x.device) if ctx.step == 0 "
                "else None\n" if held else "x, y = batch\n") + "loss = F.cross_entropy(model(x), y)"
        s.train(body, model="peak_net", epochs=1, **OPTS)
        s.run("import torch\n_big = None\n" + read)
        peaks.append(dict(held=held, peak=s.pull("_peak")[0], max_reserved=s.pull("_res")[0],
                          nvidia_smi=kit.gpu_memory().get("used_mib")))
    fig["cells"] = peaks
    first, second = peaks[0]["peak"][0], peaks[1]["peak"][0]
    expect(first - second > big * 3 // 4, f"the second cell's peak ({second >> 20} MiB) is not its own "
                                          f"(first cell {first >> 20} MiB)")


def _weights(net):
    import torch

    return torch.cat([p.detach().flatten().clone() for p in net.parameters()])


def checkpoints(fig, sh):
    """--checkpoint-dir, %dist restart, resume == an unbroken run (ddp, fsdp); %dist save then %dist load."""
    for name in ("ddp", "fsdp"):
        ns = _session().ns
        ns[f"ck_ref_{name}"], ns[f"ck_{name}"] = ns["make_net"](6), ns["make_net"](6)
        opts = dict(OPTS, strategy=name, seed=5)
        for _ in range(2):
            _session().train(BODY, model=f"ck_ref_{name}", epochs=1, **opts)
        folder = tempfile.mkdtemp(prefix=f"kit-ck-{name}-")
        _session().train(BODY, model=f"ck_{name}", epochs=1, checkpoint_dir=folder, **opts)
        t0 = time.perf_counter()
        kit.cell(sh, "%dist restart")
        fig[f"{name}_restart_seconds"] = round(time.perf_counter() - t0, 2)
        _session().train(BODY, model=f"ck_{name}", epochs=1, checkpoint_dir=folder, **opts)
        ns = _session().ns
        diff = float((_weights(ns[f"ck_{name}"]) - _weights(ns[f"ck_ref_{name}"])).abs().max())
        fig[f"{name}_resume_max_diff"] = diff
        expect(diff < 1e-5, f"{name}: resumed after a restart differs from the unbroken run by {diff:.2e}")
    ns = _session().ns
    folder = tempfile.mkdtemp(prefix="kit-save-")
    _session().save(folder, model="ck_fsdp", quiet=True)
    saved = _weights(ns["ck_fsdp"])
    with __import__("torch").no_grad():
        for p in ns["ck_fsdp"].parameters():
            p.zero_()
    _session().load(folder, model="ck_fsdp", quiet=True)
    fig["save_load_max_diff"] = float((_weights(ns["ck_fsdp"]) - saved).abs().max())
    expect(fig["save_load_max_diff"] == 0.0, "%dist load did not restore the saved weights")


def data_syncs(fig, sh, cpu):
    """Finding 8: samples/s per data path and option, and host syncs per step (GPU: set_sync_debug_mode)."""
    s = _session()
    ns = s.ns
    exec(DATASETS, ns)
    ns["kit_set"], ns["kit_stream"] = ns["KitSet"](ns["kit_x"], ns["kit_y"]), ns["KitStream"](ns["kit_x"], ns["kit_y"])
    ns["sync_net"] = ns["make_net"](7)
    cases = dict(tensor={}, dataset_workers2=dict(data="kit_set", workers=2), clip=dict(clip_grad_norm=1.0),
                 nan_skip=dict(nan="skip"), stream=dict(data="kit_stream", steps_per_epoch=32),
                 validation=dict(val_data="kit_val"))
    rates = {}
    for case, extra in cases.items():
        r = s.train(BODY, model="sync_net", epochs=2, **{**OPTS, "batch_size": 64, **extra})
        rates[case] = round(r.samples_per_s)
    fig["samples_per_s"] = rates
    if cpu:
        return
    for case, extra in (("tensor", {}), ("clip", dict(clip_grad_norm=1.0)), ("nan_skip", dict(nan="skip")),
                        ("validation", dict(val_data="kit_val"))):
        s.run(SYNC_COUNT)
        r = s.train(BODY, model="sync_net", epochs=1, **{**OPTS, "batch_size": 64, **extra})
        s.run(SYNC_OFF)
        steps = r.rows[0]["steps"]
        total = sum(n for _, n in s.pull("_sync_top")[0])
        fig[f"syncs_{case}"] = dict(steps=steps, per_step=round(sum(s.pull("_syncs")[0].values()) / steps, 2),
                                    top=s.pull("_sync_top")[0], top_total=total)


def where_and_interrupt(fig, sh, cpu):
    """A step in a long CUDA kernel: what %dist where says; an interrupt 2 s in, and when the cell ends.

    On a CPU rank (``--cpu``) the long kernel is a 6 s ``time.sleep`` (which a SIGINT does interrupt).
    """
    s = _session()
    s.ns["wi_net"] = s.ns["make_net"](8)
    if cpu:
        long, sync = "time.sleep(6)", ""
        s.run("import time")
    else:
        rate = _rank(s, "import time, torch\n_t = time.perf_counter()\ntorch.cuda._sleep(100_000_000)\n"
                        "torch.cuda.synchronize()\n_rate = 1e8 / (time.perf_counter() - _t)", "_rate")
        fig["gpu_cycles_per_s"] = round(rate)
        long, sync = "torch.cuda._sleep(int(_rate * 6))", "torch.cuda.synchronize()"
    kit.cell(sh, "%%distrain --model wi_net --data kit_data --epochs 1 --batch-size 128 --background "
                 f"--progress none\nx, y = batch\nif ctx.step == 2:\n    {long}\nloss = F.cross_entropy(model(x), y)")
    time.sleep(3)
    table = _session().where()
    fig["where_background"] = [{k: row.get(k) for k in ("state", "seconds", "code", "at")} for row in table.rows]
    kit.cell(sh, "%dist wait")
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.perf_counter()
    timer.start()
    error = kit.cell(sh, f"%%dist\n{long}\n{sync}", expect_error=True)
    fig["interrupt_cell_seconds"] = round(time.perf_counter() - t0, 2)
    fig["interrupt_error"] = f"{type(error).__name__}: {error}"[:300]
    fig["usable_after"] = _session().run("1 + 1", all_output=True)
    expect(error is not None, "the interrupted cell did not fail")


def no_cuda_outside(fig, sh, cpu):
    """Only the engine holds a CUDA context; then whether a CUDA tensor pulled into the kernel makes one there."""
    import torch

    s = _session()
    engines = set(s.cluster.pids["engines"])
    smi = kit.gpu_memory()
    fig.update(engine_pids=sorted(engines), kernel_pid=os.getpid(), nvidia_smi=smi,
               kernel_cuda_before_pull=torch.cuda.is_initialized())
    pids = smi.get("compute_pids")
    if isinstance(pids, list):
        expect(set(pids) <= engines, f"CUDA processes {pids} are not the engines {sorted(engines)}")
    expect(not torch.cuda.is_initialized(), "the kernel holds a CUDA context")
    s.run("import torch\n_on_gpu = torch.ones(3, device=device)")
    back = s.pull("_on_gpu")[0]
    fig.update(pulled=f"{type(back).__name__} on {getattr(back, 'device', '?')}",
               kernel_cuda_after_pull=torch.cuda.is_initialized())


def nothing_left(fig, pids):
    import psutil

    time.sleep(1)
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    fig["left"] = left
    expect(not left, f"engines left running: {left}")


def offload(fig, sh, gib: float = 2.0):
    """Issue 34: with the GPU capped below the model (set_per_process_memory_fraction), fsdp --offload cpu trains it.

    ``gib`` GiB of fp32 ``Linear(8192, 8192)`` layers (256 MiB each, one FSDP unit each); the rank's GPU is capped
    at 60 % of the model, so the model cannot be on the GPU whole at any moment: the shards are materialised in
    host memory (``Strategy.param_device``: FSDP2's ``CPUOffloadPolicy`` requires them there) and each unit is
    gathered onto the GPU for its forward and backward only (two or three units at once with FSDP2's prefetch,
    about 0.8 GiB). The cell must train (finite losses) and the rank's ``max_memory_allocated`` stay
    under the cap. Skipped, saying so, where TrainPlan has no ``offload`` option.
    """
    import dataclasses
    import math

    import torch.nn as nn

    from distnb.core.plan import TrainPlan

    if "offload" not in {f.name for f in dataclasses.fields(TrainPlan)}:
        fig.update(ok=None, skipped="--offload is missing (issue 34 adds --offload cpu): not checked")
        return
    s = _session()
    width = 8192  # 8 layers of 8192 x 8192 fp32: 2 GiB of parameters
    layers = [nn.Linear(64, width)] + [m for _ in range(int(gib * 4)) for m in (nn.ReLU(), nn.Linear(width, width))]
    s.ns["big_net"] = nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, 10))
    params = sum(p.numel() * 4 for p in s.ns["big_net"].parameters())
    total = _rank(s, "import torch\n_total = torch.cuda.get_device_properties(device).total_memory", "_total")
    cap = int(params * 0.6)  # below the model's size: it cannot be placed on the GPU whole
    fig.update(param_bytes=params, cap_bytes=cap, gpu_bytes=total)
    s.run(f"import torch\ntorch.cuda.set_per_process_memory_fraction({cap / total!r})\n"
          "torch.cuda.reset_peak_memory_stats()")
    try:
        r = s.train(BODY, model="big_net", epochs=2, strategy="fsdp", offload="cpu",  # 2 x 2 steps of 256 samples
                    **{**OPTS, "data": "kit_val", "optimizer": "sgd", "lr": 1e-3, "batch_size": 256})
        fig.update(losses=r.epoch_losses, wall_seconds=round(r.wall_seconds, 2))
        expect(all(math.isfinite(x) for x in r.epoch_losses), "a loss is not finite")
        s.run("import torch\n_peak = torch.cuda.max_memory_allocated()")
        fig["rank_peak_bytes"] = s.pull("_peak")[0]
        expect(fig["rank_peak_bytes"] <= cap, "the rank's peak exceeded the cap")
        expect(fig["rank_peak_bytes"] < params, "the rank held the whole model on its GPU")
    finally:
        _session().run("import torch\ntorch.cuda.set_per_process_memory_fraction(1.0)\nbig_net = None")
        s.ns.pop("big_net", None)
