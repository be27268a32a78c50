"""Reference for the transformer benchmark: a character-level GPT trained by plain torch.distributed scripts.

Run under torchrun (gloo, CPU)::

    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/torchrun_transformer.py \\
        --size small --strategy ddp --epochs 3

or on GPUs (nccl, rank r on ``cuda:LOCAL_RANK``); ``--ranks N`` outside torchrun re-runs the script
under ``torchrun --standalone --nproc-per-node N`` (default: 2 on cpu, the visible GPUs on cuda)::

    python3 benchmarks/torchrun_transformer.py --device cuda --ranks 1 --size large --strategy fsdp

What distnb does for ``%%distrain --strategy S``, written by hand with the same torch APIs:

- ``ddp``: ``DistributedDataParallel(model, gradient_as_bucket_view=True)`` (distnb's ``ddp.py``);
- ``fsdp``: FSDP2 ``fully_shard`` on each direct child of the model that holds parameters
  (``tok``, ``pos``, ``blocks``, ``ln``, ``head``), then on the root, over a 1-D device mesh;
  with bf16 a ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``;
- ``tensor``: ``parallelize_module`` with ``ColwiseParallel`` on each block's ``mlp.0`` and
  ``RowwiseParallel`` on its ``mlp.2`` (the pairs distnb's default plan finds: ``qkv``/``proj``
  are no pair, 3d != d); every rank trains on the same batches;
- ``pipeline``: ``torch.distributed.pipelining.pipeline`` traced with ``SplitPoint.BEGINNING``
  at ``blocks.<layers // 2>`` (distnb's ``--split``), one stage per rank, ``ScheduleGPipe`` with
  2 microbatches and ``scale_grads=False``, each microbatch loss weighted by its share of the
  batch; the batch loss is broadcast from the last stage; the same batches on every rank.

On ``--device cuda`` (nccl): each rank calls ``torch.cuda.set_device(LOCAL_RANK)`` before
``init_process_group("nccl")``; the model is moved to its GPU before the wrapping, DDP gets
``device_ids``, the meshes are ``init_device_mesh("cuda", ...)``, the pipeline stage is built on the
GPU, autocast is ``torch.autocast("cuda", ...)``; the data stays in host memory and each batch is
copied to the GPU (``non_blocking``), as distnb's shards are; ``torch.cuda.synchronize()`` comes
before each time stamp. The CPU path is unchanged.

Data and order are distnb's (``distnb.engine.transport.shard``: ``assign``, ``epoch_order``,
``batches``; one shard for tensor and pipeline; the uneven tail dropped, as ``--drop-last``:
every batch has 32 samples, so a pipeline stage is traced once); AdamW, one torch thread per rank (on cuda: the cores over the ranks, distnb's default), the loss
of every step read with ``.item()`` and one all-reduce of the epoch's mean loss, as
distnb's loop does. ``--precision bf16`` runs forward and loss under
``torch.autocast("cpu", bfloat16)``; ``--compile`` applies ``torch.compile`` after the wrapping.

After ``--warmup-epochs`` untimed epochs it times ``--repeats`` runs of ``--epochs`` epochs,
each from its first step to the end of its last epoch, and rank 0 prints one JSON line:
per run the per-rank seconds and samples, the per-epoch mean losses, the CPU others used.
:func:`train_runs` is also what the harness runs inside a ``%%dist`` cell on distnb's engines.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import string
import textwrap
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

SIZES = {  # d, heads, layers, context (block), text modules
    "small": dict(d=64, heads=4, layers=2, block=32),
    "large": dict(d=256, heads=8, layers=6, block=64),
}
BATCH_SIZE = 32
LR = 3e-3
STRATEGIES = ("ddp", "fsdp", "tensor", "pipeline", "dist-ddp", "dist-fsdp")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (``F.scaled_dot_product_attention``), then a 4x MLP.

    Input and output (batch, context, d) float32.
    """

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, -1, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Character-level GPT (notebooks/06_transformer.ipynb's model): token + position embeddings, blocks, head.

    ``forward(idx)``: idx (batch, context) int64 character ids -> logits (batch, context, vocab) float32.
    The view in :class:`Block` uses ``-1`` for the heads so a tensor-parallel shard keeps working.
    """

    def __init__(self, vocab, d=64, heads=4, layers=2, block=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def load_text(block: int):
    """The source of ``textwrap`` and ``string`` as windows: (x, y) int64 (N, block), vocab size (int)."""
    text = "".join(inspect.getsource(m) for m in (textwrap, string))
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text])
    starts = range(0, len(ids) - block - 1, block)
    x = torch.stack([ids[s:s + block] for s in starts])
    y = torch.stack([ids[s + 1:s + block + 1] for s in starts])
    return x, y, len(chars)


def make_model(size: str, vocab: int) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(vocab, **SIZES[size])


def step_loss(model, x, y):
    """The step body both sides run: next-character cross-entropy over every position."""
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


class Trainer:
    """One strategy, built by hand on an initialised process group; :meth:`epoch` trains one epoch."""

    def __init__(self, strategy, size, precision="fp32", compile=False, seed=0, device=None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device or "cpu")  # a %%dist cell passes distnb's ``device``
        self.strategy = strategy.removeprefix("dist-")  # dist-ddp, dist-fsdp: the same loop in a %%dist cell
        X, Y, vocab = load_text(SIZES[size]["block"])
        self.n = len(X)
        self.shards = self.world if self.strategy in ("ddp", "fsdp") else 1
        self.index = self.rank % self.shards
        from distnb.engine.transport import shard as sharding

        self.sharding, self.seed = sharding, seed
        mine = sharding.assign(self.n, self.shards, seed)[self.index]
        self.X, self.Y = X[mine], Y[mine]
        self.dtype = torch.bfloat16 if precision == "bf16" else None
        module = make_model(size, vocab)
        if self.device.type != "cpu":
            module.to(self.device)
        build = getattr(self, f"_build_{self.strategy}")
        self.model, params = build(module, size)
        if compile:
            self.model = torch.compile(self.model)
        self.optimizer = torch.optim.AdamW(params, lr=LR)

    def _build_ddp(self, module, size):
        from torch.nn.parallel import DistributedDataParallel

        ids = None if self.device.type == "cpu" else [self.device]
        return DistributedDataParallel(module, device_ids=ids, gradient_as_bucket_view=True), module.parameters()

    def _build_fsdp(self, module, size):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        kw = {} if self.dtype is None else dict(mp_policy=MixedPrecisionPolicy(param_dtype=self.dtype,
                                                                               reduce_dtype=torch.float32))
        for name in ("tok", "pos", "blocks", "ln", "head"):
            fully_shard(module.get_submodule(name), mesh=mesh, **kw)
        fully_shard(module, mesh=mesh, **kw)
        return module, module.parameters()

    def _build_tensor(self, module, size):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {}
        for i in range(SIZES[size]["layers"]):
            plan[f"blocks.{i}.mlp.0"], plan[f"blocks.{i}.mlp.2"] = ColwiseParallel(), RowwiseParallel()
        parallelize_module(module, init_device_mesh(self.device.type, (self.world,)), plan)
        return module, module.parameters()

    def _build_pipeline(self, module, size):
        from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

        self.microbatches = 2
        mb = torch.zeros((BATCH_SIZE // self.microbatches, SIZES[size]["block"]), dtype=torch.int64,
                         device=self.device)
        split = f"blocks.{SIZES[size]['layers'] // 2}"
        pipe = pipeline(module, mb_args=(mb,), split_spec={split: SplitPoint.BEGINNING})
        self.stage = pipe.build_stage(self.rank, self.device)
        self._schedules, self._losses = {}, []
        self._make_schedule = lambda m: ScheduleGPipe(self.stage, n_microbatches=m, loss_fn=self._mb_loss,
                                                      scale_grads=False)
        return self.stage.submod, self.stage.submod.parameters()

    def _mb_loss(self, output, target):
        loss = F.cross_entropy(output.flatten(0, 1), target.flatten())
        loss = loss * (len(target) / self._size)  # the microbatch's share of the batch
        self._losses.append(loss.detach().double())
        return loss

    def _pipeline_step(self, x, y):
        size = len(x)  # always BATCH_SIZE: both sides drop the uneven tail (--drop-last)
        if size not in self._schedules:
            self._schedules[size] = self._make_schedule(self.microbatches)
        self._size, self._losses = size, []
        first, last = self.rank == 0, self.rank == self.world - 1
        with self._autocast():
            self._schedules[size].step(*((x,) if first else ()), target=y if last else None, return_outputs=False)
        total = torch.stack(self._losses).sum() if last else torch.zeros((), dtype=torch.float64,
                                                                          device=self.device)
        dist.broadcast(total, src=self.world - 1)
        return total.item()

    def _autocast(self):
        import contextlib

        return contextlib.nullcontext() if self.dtype is None else torch.autocast(self.device.type, dtype=self.dtype)

    def epoch(self, epoch: int):
        """Train one epoch; returns (samples, steps, mean loss over all ranks)."""
        order = self.sharding.epoch_order(self.n, self.shards, self.index, self.seed, epoch, True)
        samples = steps = 0
        loss_sum = 0.0
        for idx in self.sharding.batches(order, BATCH_SIZE, True):
            x, y = self.X[idx], self.Y[idx]
            if self.device.type != "cpu":
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            if self.strategy == "pipeline":
                value = self._pipeline_step(x, y)
            else:
                with self._autocast():
                    loss = step_loss(self.model, x, y)
                loss.backward()
                value = loss.item()
            self.optimizer.step()
            loss_sum += value
            samples += len(idx)
            steps += 1
        t = torch.tensor([loss_sum, steps], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return samples, steps, float(t[0] / t[1])


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy (all processes), from /proc/stat; nan elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _synchronize(device) -> None:
    """Wait for the GPU's queued work before a time stamp (nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_run(trainer, start: int, epochs: int) -> dict:
    """Train epochs ``start`` .. ``start + epochs - 1`` timed; every rank returns the figures (a collective).

    Returns a dict: train_seconds (slowest rank, s), samples_per_s (summed over ranks), epoch_losses,
    first_epoch, cpu_utilisation (CPU s / training s), foreign_cores (CPU others used, cores), rows per rank.
    """
    dist.barrier()
    _synchronize(trainer.device)
    busy0, c0, t0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    done = [trainer.epoch(e) for e in range(start, start + epochs)]
    _synchronize(trainer.device)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    busy = busy_cpu_seconds() - busy0
    samples = sum(d[0] for d in done)
    figs = [torch.zeros(3, dtype=torch.float64, device=trainer.device) for _ in range(trainer.world)]
    dist.all_gather(figs, torch.tensor([samples, seconds, cpu], dtype=torch.float64, device=trainer.device))
    figs = [f.cpu() for f in figs]
    rows = [dict(rank=r, samples=int(f[0]), seconds=float(f[1]), cpu_seconds=float(f[2])) for r, f in enumerate(figs)]
    return dict(train_seconds=max(r["seconds"] for r in rows),
                samples_per_s=sum(r["samples"] / r["seconds"] for r in rows),
                epoch_losses=[d[2] for d in done], first_epoch=start,
                cpu_utilisation=sum(r["cpu_seconds"] for r in rows) / sum(r["seconds"] for r in rows),
                foreign_cores=max(0.0, busy - sum(r["cpu_seconds"] for r in rows)) / seconds, rows=rows)


def train_runs(strategy, size, epochs, repeats, first_epoch, warmup_epochs, precision="fp32", compile=False,
               device="cpu"):
    """One thread per rank (on cuda: distnb's default, the cores over the ranks); build ``strategy``, train
    ``warmup_epochs`` untimed, then :func:`timed_run` ``repeats`` times.

    Returns (on every rank) a dict: warmup_losses (list of float, per epoch), runs (list of
    :func:`timed_run` dicts), threads.
    """
    world = dist.get_world_size()
    torch.set_num_threads(1 if device == "cpu" else max(1, len(os.sched_getaffinity(0)) // world))
    trainer = Trainer(strategy, size, precision, compile, device=device)
    warm = [trainer.epoch(e)[2] for e in range(first_epoch - warmup_epochs, first_epoch)]
    runs = [timed_run(trainer, first_epoch + rep * epochs, epochs) for rep in range(repeats)]
    return dict(strategy=strategy, size=size, warmup_losses=warm, runs=runs, threads=torch.get_num_threads())


def default_ranks(device: str) -> int:
    """2 on cpu; on cuda the GPUs visible (counted without initialising CUDA here), at least 1."""
    if device == "cpu":
        return 2
    from distnb.core.net import visible_gpus

    return max(1, len(visible_gpus()))


def launch(args, argv) -> int:
    """Run this script under ``torchrun --standalone --nproc-per-node N``; returns its exit status."""
    import subprocess
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    ranks = args.ranks if args.ranks is not None else default_ranks(args.device)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           os.path.abspath(__file__), *argv]
    return subprocess.call(cmd)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    p.add_argument("--epochs", type=int, default=3, help="epochs per timed run")
    p.add_argument("--first-epoch", type=int, default=1, help="epoch number of the first timed epoch (shuffles)")
    p.add_argument("--warmup-epochs", type=int, default=1, help="untimed epochs before the timed ones")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of --epochs each")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo (default); cuda: nccl, rank r on cuda:LOCAL_RANK")
    p.add_argument("--ranks", type=int, default=None, help="outside torchrun: re-run under torchrun with this many "
                   "ranks (default 2 on cpu, the visible GPUs on cuda); under torchrun: checked against WORLD_SIZE")
    args = p.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:  # not under torchrun: start it, with this command line
        return launch(args, argv)
    if args.ranks is not None and args.ranks != int(os.environ["WORLD_SIZE"]):
        p.error(f"--ranks {args.ranks} but torchrun started {os.environ['WORLD_SIZE']} ranks")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before the group: nccl binds this GPU
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    out = train_runs(args.strategy, args.size, args.epochs, args.repeats, args.first_epoch, args.warmup_epochs,
                     args.precision, args.compile, args.device)
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # gloo processes sometimes abort at interpreter exit (FIELD-NOTES pitfall 1)


if __name__ == "__main__":
    raise SystemExit(main())
