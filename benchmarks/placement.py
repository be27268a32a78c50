"""Each rank's peak memory under --strategy fsdp against torchrun's FSDP2, in the same run (issue 34, item 1).

The model: ``--layers`` bias-free ``nn.Linear(--width, --width)`` in an ``nn.ModuleList`` (16 x 4096: 1 GiB
of fp32), two SGD steps with batch 1 per rank on 2 ranks. Each side reports every rank's peak resident
set (``ru_maxrss``) above its idle one (the process before the model existed):

- torchrun: ``torchrun --standalone --nproc-per-node 2`` of this file's worker: the model built on the
  meta device, ``fully_shard`` per layer and on the root, ``to_empty`` + ``reset_parameters``, then the
  same steps (``--torchrun-init full`` builds it whole on every rank first);
- distnb, meta: the notebook builds the model on the meta device; ``%%distrain --strategy fsdp``;
- distnb, kernel-held: the notebook builds the model (1 GiB in the kernel); the same cell.

Run: ``python benchmarks/placement.py [--layers 16] [--width 4096]``. The target: distnb's rank peak at
most 1.2 x torchrun's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn


class Stack(nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(layers: int, width: int, init: str, out: str) -> None:
    """torchrun's side: one rank of FSDP2 on the same model and steps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    idle = _peak()
    torch.manual_seed(0)
    if init == "meta":
        with torch.device("meta"):
            model = Stack(layers, width)
    else:
        model = Stack(layers, width)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if init == "meta":
        model.to_empty(device="cpu")
        for layer in model.layers:
            layer.reset_parameters()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(torch.randn(1, width)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, _peak() - idle)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(peaks, f)
    dist.destroy_process_group()


def torchrun(layers: int, width: int, init: str) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peaks.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        __file__, "--worker", "--layers", str(layers), "--width", str(width), "--torchrun-init", init,
                        "--out", out], check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


RANK_PEAK = "import resource\n_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024"
BODY = "loss = model(batch[0]).pow(2).mean()"


def distnb_side(layers: int, width: int, meta: bool) -> tuple:
    """Each rank's peak above idle, and the kernel's rise, for one fresh 2-rank cluster."""
    import gc

    import distnb

    session = distnb.start(n=2, quiet=True)
    try:
        session.run(RANK_PEAK)
        idle = session.pull("_peak")
        kernel_idle = _peak()
        torch.manual_seed(0)
        if meta:
            with torch.device("meta"):
                net = Stack(layers, width)
        else:
            net = Stack(layers, width)
        data = torch.utils.data.TensorDataset(torch.randn(4, width))
        session.train(BODY, model=net, data=data, strategy="fsdp", epochs=1, batch_size=1, optimizer="sgd",
                      lr=1e-3, progress="none", quiet=True)
        session.run(RANK_PEAK)
        peaks = [p - i for p, i in zip(session.pull("_peak"), idle)]
        kernel = _peak() - kernel_idle
        del net
        gc.collect()
        return peaks, kernel
    finally:
        session.stop(quiet=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--torchrun-init", default="meta", choices=("meta", "full"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--skip-kernel-held", action="store_true", help="only the meta path on distnb's side")
    args = parser.parse_args()
    if args.worker:
        worker(args.layers, args.width, args.torchrun_init, args.out)
        return
    gib = 1 << 30
    size = args.layers * args.width * args.width * 4
    print(f"model: {args.layers} x Linear({args.width}, {args.width}, bias=False) = {size / gib:.2f} GiB fp32; "
          "fsdp, 2 ranks, 2 SGD steps, batch 1 per rank")
    ref = torchrun(args.layers, args.width, args.torchrun_init)
    print(f"torchrun FSDP2 ({args.torchrun_init} init): rank peaks above idle "
          f"{', '.join(f'{p / gib:.2f}' for p in ref)} GiB")
    sides = [("meta", True)] + ([] if args.skip_kernel_held else [("kernel-held", False)])
    for label, meta in sides:
        peaks, kernel = distnb_side(args.layers, args.width, meta)
        ratio = max(peaks) / max(ref)
        print(f"distnb fsdp ({label}): rank peaks above idle {', '.join(f'{p / gib:.2f}' for p in peaks)} GiB "
              f"= {ratio:.2f} x torchrun's (target <= 1.2); the kernel's peak rose {kernel / gib:.2f} GiB")


if __name__ == "__main__":
    main()
