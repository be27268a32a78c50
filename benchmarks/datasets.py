"""A map-style Dataset loaded on the ranks: distnb against the same DataLoader under torchrun.

The Dataset has a cheap ``__getitem__`` (index a tensor, then a random horizontal flip of the
8x8 image), sent to the ranks by value (``--data flips``). The reference is this file run
under ``torchrun --nproc-per-node 2``: the same Dataset, the same model (a 64-128-64-10 MLP),
Adam, DDP, one thread per rank, and the same DataLoader settings (a batch sampler over the
same index lists: distnb's shard arithmetic, ``num_workers``, ``persistent_workers``,
``prefetch_factor`` 2), with the per-epoch loss all-reduce distnb does. Both sides are timed
from the first step of a cell (a torchrun run) to the end of its last epoch, after a warm-up;
samples/s is summed over the ranks. Rounds alternate the side that goes first, and the ratio
is the median of distnb's samples/s over the median of torchrun's, for 0 and 2 workers::

    .venv/bin/python benchmarks/datasets.py --rounds 5 --epochs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

HERE = os.path.dirname(os.path.abspath(__file__))
BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


class Flips(Dataset):
    """``num_samples`` random 8x8 images and labels; each sample is flipped left-right with p = 0.5."""

    def __init__(self, num_samples=8192, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(num_samples, 8, 8, generator=g)
        self.y = torch.randint(0, 10, (num_samples,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x.reshape(64), self.y[i]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


# the reference: this file under torchrun ----------------------------------------------------

def _reference(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from distnb.engine.transport import shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Flips(args.samples)
    torch.manual_seed(0)
    model = DistributedDataParallel(MLP())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    part = shard.assign(len(data), world, 0)[rank]

    class Keys:
        def __init__(self):
            self.epoch = 0

        def __iter__(self):
            order = shard.epoch_order(len(data), world, rank, 0, self.epoch, False)
            return iter(part[idx].tolist() for idx in shard.batches(order, args.batch_size, False))

    keys = Keys()
    extra = dict(persistent_workers=True, prefetch_factor=2) if args.workers else {}

    def new_loader():  # one per run, as distnb makes one per cell (its workers start inside the timed span)
        return DataLoader(data, batch_sampler=keys, num_workers=args.workers, **extra)

    loader = new_loader()

    def epoch(e):
        keys.epoch = e
        total, count, samples = 0.0, 0, 0
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total, count, samples = total + loss.item(), count + 1, samples + len(x)
        mean = torch.tensor([total, count], dtype=torch.float64)
        dist.all_reduce(mean)
        return samples

    for e in range(args.warmup_epochs):
        epoch(e)
    runs = []
    for k in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        del loader
        loader = new_loader()
        samples = sum(epoch(args.warmup_epochs + k * args.epochs + e) for e in range(args.epochs))
        rate = torch.tensor([samples / (time.perf_counter() - t0)])
        dist.all_reduce(rate)
        runs.append(float(rate))
    if rank == 0:
        print(json.dumps(dict(samples_per_s=runs)), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # gloo processes sometimes abort at interpreter exit (FIELD-NOTES pitfall 1)


def run_torchrun(args, workers) -> list:
    """samples/s of ``args.repeats`` runs of the reference under torchrun (after its own warm-up)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", os.path.abspath(__file__), "--reference", "--workers",
           str(workers), "--epochs", str(args.epochs), "--repeats", str(args.repeats), "--samples", str(args.samples),
           "--batch-size", str(args.batch_size), "--warmup-epochs", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"the torchrun reference failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]


# distnb ---------------------------------------------------------------------------------------

def run_distnb(session, ns, args, workers, model) -> list:
    """samples/s summed over the ranks of ``args.repeats`` warm cells."""
    rates = []
    for _ in range(args.repeats):
        r = session.train(BODY, model=model, data="flips", epochs=args.epochs, batch_size=args.batch_size,
                          workers=workers, progress="none", quiet=True)
        rates.append(sum(row["samples"] / row["seconds"] for row in r.rows))
    return rates


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="timed cells (torchrun: runs) per side per round")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=None, help="with --reference: the DataLoader's workers")
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--reference", action="store_true", help="(under torchrun) run the reference side")
    p.add_argument("--wait-quiet", type=float, default=10.0, help="seconds to wait for an idle machine before a side")
    args = p.parse_args(argv)
    if args.reference:
        return _reference(args)
    import distnb

    sys.path.insert(0, HERE)
    import run as suite_run  # ForeignCpu, wait_quiet

    ns = {"F": F, "torch": torch, "Flips": Flips, "MLP": MLP}
    ns["flips"] = Flips(args.samples)
    session = distnb.start(n=2, ns=ns, quiet=True)
    rows = []
    try:
        for workers in (0, 2):
            model = f"net{workers}"
            torch.manual_seed(0)
            ns[model] = MLP()
            session.train(BODY, model=model, data="flips", epochs=1, batch_size=args.batch_size, workers=workers,
                          optimizer="adam", progress="none", quiet=True)  # warm: model sent, DDP built
            mine, ref, foreign = [], [], []
            for k in range(args.rounds):
                sides = ("distnb", "torchrun") if k % 2 == 0 else ("torchrun", "distnb")
                for side in sides:
                    suite_run.wait_quiet(args.wait_quiet)
                    with suite_run.ForeignCpu() as other:
                        if side == "distnb":
                            mine += run_distnb(session, ns, args, workers, model)
                        else:
                            ref += run_torchrun(args, workers)
                    foreign.append(other.cores)
            a, b = statistics.median(mine), statistics.median(ref)
            rows.append((workers, a, b, a / b, max(foreign)))
            print(f"workers {workers}: distnb {a:.0f} samples/s, torchrun {b:.0f} samples/s, ratio {a / b:.3f} "
                  f"(distnb {', '.join(f'{x:.0f}' for x in mine)}; torchrun {', '.join(f'{x:.0f}' for x in ref)}; "
                  f"others' CPU up to {max(foreign):.2f} cores)", flush=True)
    finally:
        session.stop(quiet=True)
    print("\n| --workers | distnb, samples/s | torchrun, samples/s | ratio | target | others' CPU, cores |\n"
          "|---|---|---|---|---|---|")
    for workers, a, b, ratio, other in rows:
        print(f"| {workers} | {a:.0f} | {b:.0f} | {ratio:.3f} | >= 0.95: {'PASS' if ratio >= 0.95 else 'FAIL'} | "
              f"{other:.2f} |")
    load = os.getloadavg()
    print(f"\n{os.cpu_count()} cores; torch {torch.__version__}; load average at the end {load[0]:.2f} {load[1]:.2f}")


if __name__ == "__main__":
    main()
