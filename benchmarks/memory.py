"""Memory of a model bigger than one rank (issue 34): each rank's and the kernel's peak against torchrun.

Model: ``L`` bias-free ``nn.Linear(4096, 4096)`` in an ``nn.ModuleList`` (64 MiB each in fp32):
``--sizes 4,16,64`` gives 0.25, 1 and 4 GiB. Each strategy (ddp, fsdp, tensor, pipeline) trains two SGD
steps (batch 1 per rank, 2 ranks, gloo) in the same run:

- **distnb**: a kernel of its own (a subprocess, so its figures are its own) starts a 2-rank cluster,
  builds the model (``full``: on the CPU; ``meta``: under ``torch.device("meta")``) and trains it with
  ``%%distrain`` (``Session.train``). Kernel: idle RSS after the start; peak (``VmHWM`` reset through
  ``/proc/self/clear_refs`` before the model is built) and RSS after the cell, above idle; the cell's own
  ``TrainResult.kernel_peak_memory``. Ranks: RSS before the cell, and the peak (``ru_maxrss``, the
  TrainResult rows' ``peak_memory``) above it.
- **torchrun**: ``torchrun --nproc-per-node 2`` of the same model, strategy and steps written by hand
  (``DDP``; ``fully_shard`` per layer and on the root; ``parallelize_module`` with column-/row-wise pairs;
  ``PipelineStage`` + ``ScheduleGPipe`` on two halves). ``full``: built on every rank then distributed;
  ``meta``: built on meta, distributed, then ``to_empty`` + ``reset_parameters`` (torchtitan's order).
  Each rank: the peak (``ru_maxrss``) above its RSS after ``init_process_group``.

The figure of merit is distnb's rank peak above idle / torchrun's (target 1.2, issue 34 item 1) and the
kernel's peak above idle / the model's size (target <= 1.1 + 64 MiB, item 2). A distnb path refused
today (a meta model before meta init lands) is reported as such, with its error.

Usage::

    .venv/bin/python benchmarks/memory.py [--sizes 4,16] [--strategies ddp,fsdp,tensor,pipeline]
                                          [--inits full,meta] [--levers BATCH [--lever-width W] [--only-levers]]
                                          [--mmap-threshold BYTES] [--json PATH]

``--levers BATCH`` adds fsdp with each memory lever (``--activation-checkpointing``, ``--offload cpu``,
``--param-dtype bf16``) and without, at BATCH samples per rank (activations need a batch to matter), on a
model of SIZE transformer MLP blocks (``Block``, ``W -> 4W -> GELU -> W``) whose saved activations outweigh
each block's input (a stack of bare ``Linear`` layers saves only each layer's input: checkpointing has
nothing to drop there). torchrun runs each lever too, applied as distnb applies it (``checkpoint`` on each
block before ``fully_shard``, FSDP2's ``CPUOffloadPolicy`` and ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` on each block and the root). Besides the run's peak, each side reports the first step's
own peak: ``VmHWM`` reset (``/proc/self/clear_refs``) just before step 1's forward and read just before
step 2's (distnb: by the step body itself; torchrun: around its steps), above the idle RSS.

``--mmap-threshold BYTES`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` for both systems' processes. By default
glibc serves a block from ``mmap`` only above a threshold that rises, as such blocks are freed, up to 32 MiB;
below it, freed blocks stay in the heap and in the resident set, so the peak depends on the sizes of the
tensors and the order they are freed in, not on the bytes alive. With a fixed threshold of 1 MiB every
tensor above it is mapped and unmapped, and the resident set follows the live tensors (benchmarks/README.md,
"The levers").

Rank figures (the main table) are each engine's ``ru_maxrss`` read after the cell (the weights coming back to
the kernel after the cell's reply included) above its idle RSS. It is not the engine's lifetime peak: the
training call resets ``VmHWM`` when it starts (``engine/transport/peaks.py``), which lowers ``ru_maxrss`` too,
so a peak of the model's install call before it counts only as far as its memory is still resident.
``cell_ranks`` in the JSON are the TrainResult rows' own peaks (the cell alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 2 ** 20

COMMON = textwrap.dedent('''
    import json, os, resource, sys
    import torch, torch.nn as nn

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    class Stack(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4096, 4096, bias=False) for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    class Block(nn.Module):
        """A transformer MLP block (W -> 4W -> GELU -> W, residual; W = 1024: 32 MiB of fp32 weights): per
        sample 36 W bytes of activations saved for backward (36 KiB at W = 1024) against 4 W for its input alone."""

        def __init__(self, width=1024):
            super().__init__()
            self.up, self.down = nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(x)))

    class Blocks(nn.Module):
        def __init__(self, blocks, width=1024):
            super().__init__()
            self.layers = nn.ModuleList(Block(width) for _ in range(blocks))

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return x
''')

DISTNB = COMMON + textwrap.dedent('''
    import distnb
    layers, strategy, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    levers, batch, kind, width = json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6], int(sys.argv[7])
    Stack.__module__ = Block.__module__ = Blocks.__module__ = "__main__"
    Model = (lambda n: Blocks(n, width)) if kind == "blocks" else Stack
    ns = {}
    # memory on a shared machine: a rank descheduled for tens of seconds in a 1 GiB step is slow, not hung
    # (--hang-after's 10 s ended a ddp cell at 1 GiB under load 10; the first step has no step time to go by)
    s = distnb.start(n=2, ns=ns, quiet=True, timeout=600, hang_after=300)
    out = dict(system="distnb")
    try:
        s.run("import resource\\n_rss = int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024")
        rank_idle = s.pull("_rss")
        ns["data"] = torch.randn(4 * batch, width)
        kernel_idle = rss()
        open("/proc/self/clear_refs", "w").write("5")
        torch.manual_seed(0)
        if init == "meta":
            with torch.device("meta"):
                ns["net"] = Model(layers)
        else:
            ns["net"] = Model(layers)
        extra = dict(microbatches=1) if strategy == "pipeline" else {}
        extra.update(levers)
        body = "loss = model(batch).pow(2).mean()"
        s.run("_hwm = []")
        if kind == "blocks":  # the levers' runs: the peak so far before each step, then a new window (torchrun's too)
            body = ("_hwm.append(int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024)\\n"
                    "open('/proc/self/clear_refs', 'w').write('5')\\n" + body)
        try:
            r = s.train(body, "net", "data", strategy=strategy, epochs=1,
                        batch_size=batch, lr=1e-4, quiet=True, progress="none", **extra)
        except Exception as exc:  # a path distnb refuses today: say so
            out.update(refused=f"{type(exc).__name__}: {str(exc)[:300]}")
        else:
            # each engine's lifetime peak after the cell, weights back included (they come after the reply, so the
            # TrainResult rows' peak_memory, taken at the cell's end, does not see them)
            s.run("_max = max(_hwm + [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024])")
            out.update(kernel_peak=status("VmHWM") - kernel_idle, kernel_after=rss() - kernel_idle,
                       kernel_cell_peak=(getattr(r, "kernel_peak_memory", None) or 0) - kernel_idle,
                       ranks=[peak - idle for peak, idle in zip(s.pull("_max"), rank_idle)],
                       step=[h[1] - idle if len(h) > 1 else None for h, idle in zip(s.pull("_hwm"), rank_idle)],
                       cell_ranks=[row["peak_memory"] - idle for row, idle in zip(r.rows, rank_idle)]
                       if "peak_memory" in r.rows[0] else None)  # an older distnb (a before/after run)
    finally:
        s.stop(quiet=True)
    print("RESULT " + json.dumps(out))
''')

TORCHRUN = COMMON + textwrap.dedent('''
    import torch.distributed as dist
    layers, strategy, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    levers, batch, kind, width = json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6], int(sys.argv[7])
    Model = (lambda n: Blocks(n, width)) if kind == "blocks" else Stack
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    idle = rss()
    torch.manual_seed(0)
    with torch.device("meta" if init == "meta" else "cpu"):
        net = Model(layers)

    def materialise(module):
        if init == "meta":
            module.to_empty(device="cpu")
            for m in module.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        return module

    x = torch.randn(batch, width)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(materialise(net), gradient_as_bucket_view=True)  # as distnb builds it (engine/strategies/ddp.py)
    elif strategy == "fsdp":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        kw = {}  # the levers, as distnb's engine/strategies/levers.py applies them
        if levers.get("param_dtype") == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if levers.get("offload") == "cpu":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        if levers.get("activation_checkpointing"):
            from torch.distributed._composable import checkpoint
            for layer in net.layers:
                checkpoint(layer)
        for layer in net.layers:
            fully_shard(layer, mesh=mesh, **kw)
        model = materialise(fully_shard(net, mesh=mesh, **kw))
    elif strategy == "tensor":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        plan = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(layers)}
        model = materialise(parallelize_module(net, mesh, plan))
    else:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        half = layers // 2
        mine = nn.Sequential(*list(net.layers)[half * rank:half * (rank + 1)])
        del net
        model = materialise(mine)
        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, 1, loss_fn=lambda out, target: out.pow(2).mean())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    hwm = []  # the peak of the build, then of step 1: each reset before the next (as the distnb side's body)
    for _ in range(2):
        hwm.append(status("VmHWM"))
        open("/proc/self/clear_refs", "w").write("5")
        opt.zero_grad()
        if strategy == "pipeline":
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=torch.zeros(1, 4096))
        else:
            model(x).pow(2).mean().backward()
        opt.step()
    peak = max(hwm + [status("VmHWM")])  # the run's peak (a reset lowers ru_maxrss too)
    figures = [None] * world
    dist.all_gather_object(figures, (peak - idle, hwm[1] - idle))
    if rank == 0:
        print("RESULT " + json.dumps(dict(system="torchrun", ranks=[f[0] for f in figures],
                                          step=[f[1] for f in figures])))
    dist.destroy_process_group()
''')


def _run(cmd, timeout):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return dict(error=(proc.stdout[-800:] + proc.stderr[-1500:]).strip())
    return json.loads(lines[-1][len("RESULT "):])


def measure(layers, strategy, init, folder, timeout, levers=None, batch=1, kind="stack", width=4096):
    """``{"distnb": ..., "torchrun": ...}`` for one model size, strategy and initialisation (bytes).

    ``levers`` (``s.train`` keywords, e.g. ``{"offload": "cpu"}``): distnb alone, with them, at ``batch``
    samples per rank (the levers' effect; torchrun is not run). ``kind``: ``stack`` (the Linear stack) or
    ``blocks`` (``layers`` MLP blocks of 32 MiB, whose activations outweigh their input: the levers' model)."""
    paths = {}
    for name, text in (("distnb", DISTNB), ("torchrun", TORCHRUN)):
        paths[name] = os.path.join(folder, f"memory_{name}.py")  # not distnb.py: that would shadow the package
        with open(paths[name], "w") as f:
            f.write(text)
    args = [str(layers), strategy, init]
    args += [json.dumps(levers or {}), str(batch), kind, str(width)]
    distnb = _run([sys.executable, paths["distnb"], *args], timeout)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                paths["torchrun"], *args]
    return dict(torchrun=_run(torchrun, timeout), distnb=distnb)


def _mib(x):
    return "-" if x is None else f"{x / MIB:,.0f}"


def report(rows) -> str:
    """A markdown table: per case, each rank's peak above idle (distnb / torchrun, ratio), the kernel's."""
    out = ["| model | strategy | init | torchrun ranks (MiB) | distnb ranks (MiB) | worst ratio | kernel peak "
           "(MiB) | kernel peak / model | kernel after (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        model = row["layers"] * (32 if row.get("kind") == "blocks" else 64) * MIB
        t, d = row["torchrun"], row["distnb"]
        tr = t.get("ranks") or []
        dr = d.get("ranks") or []
        if "kernel_peak" in d and not dr:
            dr = [None] * len(tr)
        ratio = max((a / b for a, b in zip(dr, tr) if a is not None and b), default=None)
        if "refused" in d or "error" in d:
            why = d.get("refused") or (d.get("error", "").strip().splitlines() or ["?"])[-1]
            distnb_cells = [f"not run: {why[:200]}", "-", "-", "-", "-"]
        else:
            distnb_cells = [" / ".join(_mib(x) for x in dr), f"{ratio:.2f}" if ratio else "-",
                            _mib(d["kernel_peak"]), f"{d['kernel_peak'] / model:.2f}", _mib(d["kernel_after"])]
        torchrun_cell = " / ".join(_mib(x) for x in tr) if tr else f"error: {t.get('error', '')[-120:]}"
        out.append(f"| {model / 2**30:g} GiB | {row['strategy']} | {row['init']} | {torchrun_cell} | "
                   + " | ".join(distnb_cells) + " |")
    return "\n".join(out)


def _pair(figures):
    return " / ".join(_mib(x) for x in figures) if figures else "-"


def lever_report(rows) -> str:
    """A markdown table of the levers' rows: per lever, each rank's peak above idle of the whole run and of
    the first step alone, torchrun's and distnb's (MiB), and the change against no lever."""
    out = ["| lever | torchrun run peak | distnb run peak | torchrun step 1 | distnb step 1 | step 1 against none "
           "(torchrun; distnb) |", "|---|---|---|---|---|---|"]
    base = {}
    for row in rows:
        t, d = row["torchrun"], row["distnb"]
        label = " ".join(f"--{k.replace('_', '-')} {v}".replace(" True", "") for k, v in row["levers"].items())
        if not row["levers"]:
            base = dict(t=t.get("step") or [], d=d.get("step") or [])
        delta = [" / ".join(f"{(x - y) / MIB:+,.0f}" for x, y in zip(now, base[k]) if x is not None and y is not None)
                 for k, now in (("t", t.get("step") or []), ("d", d.get("step") or []))] if row["levers"] else ["", ""]
        why = (d.get("refused") or d.get("error") or "")[-160:]
        out.append(f"| {label or 'none'} | {_pair(t.get('ranks'))} | {_pair(d.get('ranks')) if not why else why} | "
                   f"{_pair(t.get('step'))} | {_pair(d.get('step'))} | {'; '.join(delta) if row['levers'] else ''} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4,16", help="layers per model: 4, 16, 64 = 0.25, 1, 4 GiB (default 4,16)")
    ap.add_argument("--strategies", default="ddp,fsdp,tensor,pipeline")
    ap.add_argument("--inits", default="full,meta")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    ap.add_argument("--levers", type=int, default=0, metavar="BATCH",
                    help="also fsdp with each memory lever at BATCH samples per rank, distnb alone, on SIZE MLP blocks "
                         "(1024 -> 4096 -> 1024, 32 MiB each) whose activations outweigh the weights (default: not)")
    ap.add_argument("--lever-width", type=int, default=1024, metavar="W",
                    help="the levers' blocks are W -> 4W -> W (default 1024: 32 MiB each; bf16 matrix products run "
                         "30-60x slower than fp32 on a CPU without AVX-512, so a narrower block keeps bf16 affordable)")
    ap.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                    help="glibc's MALLOC_MMAP_THRESHOLD_ for both systems' processes: each allocation of BYTES or more "
                         "gets pages of its own, returned when freed, so the resident set follows the live tensors "
                         "(default: glibc's own, whose threshold rises to 32 MiB as large blocks are freed)")
    ap.add_argument("--only-levers", action="store_true", help="with --levers: the levers' runs alone")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args(argv)
    if args.mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # inherited by both systems' processes
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for layers in (int(x) for x in args.sizes.split(",")):
            for strategy in ([] if args.only_levers else args.strategies.split(",")):
                for init in args.inits.split(","):
                    got = measure(layers, strategy, init, folder, args.timeout)
                    rows.append(dict(layers=layers, strategy=strategy, init=init, **got))
                    print(json.dumps(rows[-1]), flush=True)
            for levers in ([{}, {"activation_checkpointing": True}, {"offload": "cpu"}, {"param_dtype": "bf16"}]
                           if args.levers else []):
                got = measure(layers, "fsdp", "full", folder, args.timeout, levers, args.levers, kind="blocks",
                              width=args.lever_width)
                rows.append(dict(layers=layers, strategy="fsdp", init="full", levers=levers, batch=args.levers,
                                 kind="blocks", width=args.lever_width, **got))
                print(json.dumps(rows[-1]), flush=True)
    if not args.only_levers:
        print(report([row for row in rows if row.get("levers") is None]))
    if args.levers:
        print(lever_report([row for row in rows if row.get("levers") is not None]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
