"""Reference for the distnb benchmark: the digits model trained by a plain DDP script.

Run under torchrun (gloo, CPU)::

    .venv/bin/torchrun --nproc-per-node 2 benchmarks/torchrun_digits.py --model cnn --epochs 15

It trains the same model (:class:`DigitsCNN` or :class:`DigitsMLP`, whose source
``benchmarks/run.py`` also runs as a notebook cell for ``%%distrain``) on the same
shards in the same order (``distnb.engine.transport.shard``: ``assign``, ``epoch_order``,
``batches``), with the same per-rank batch size, Adam, DDP, one torch thread per rank,
and the same per-epoch work distnb does besides the step (the mean loss over all ranks,
one all-reduce per epoch). After ``--warmup-epochs`` untimed epochs (distnb's engines are
warm from a first cell) it times ``--repeats`` training runs of ``--epochs`` each, every
one from its first step to the end of its last epoch (the span distnb's per-rank
``seconds`` covers), and rank 0 prints one JSON line with, per run, the per-rank samples,
seconds, samples/s, CPU seconds, their sums, and the CPU other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


class DigitsMLP(nn.Module):
    """64-128-64-10 MLP on flattened 8x8 digits (the model of ``python -m distnb.tools.demo``)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class DigitsCNN(nn.Module):
    """Small CNN on 8x8 digits: two 3x3 convs (16, 32 channels), 2x2 max-pool, 2 linear layers."""

    def __init__(self, channels=(16, 32), hidden=64):
        super().__init__()
        c1, c2 = channels
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.fc1 = nn.Linear(c2 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class DigitsMLP5M(nn.Module):
    """A 4.9M-parameter MLP on flattened digits (64-2048-2048-256-10): the all-reduce is about half a step."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                                 nn.Linear(2048, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


class DigitsWideCNN(DigitsCNN):
    """A compute-bound CNN on digits (convs of 64 and 128 channels, 0.6M parameters, ~5M MACs per sample)."""

    def __init__(self):
        super().__init__(channels=(64, 128), hidden=256)


MODELS = {"mlp": DigitsMLP, "cnn": DigitsCNN, "mlp5m": DigitsMLP5M, "widecnn": DigitsWideCNN}


def load_data():
    """scikit-learn's 1797 digits: X float32 in [0, 1] (N, 64), y int64 (N,)."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y)


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy (all processes), from /proc/stat; nan elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest is inside user


def main(argv=None):
    from distnb.engine.transport import shard as sharding

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="cnn")
    p.add_argument("--epochs", type=int, default=15, help="epochs per timed run")
    p.add_argument("--first-epoch", type=int, default=0, help="epoch number of the first timed epoch (shuffles)")
    p.add_argument("--warmup-epochs", type=int, default=2, help="untimed epochs before the timed ones")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of --epochs each, reported one by one")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="shard and shuffle seed")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket_cap_mb (default: DDP's, 25)")
    p.add_argument("--static-graph", action="store_true", help="DDP static_graph=True")
    p.add_argument("--cpu-bind", choices=("none", "cores"), default="none",
                   help="none (torchrun's default) or cores: each worker on its own share of the cores, "
                        "as distnb's %%dist start --cpu-bind cores does (distnb.engine.process.binding)")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    if args.cpu_bind == "cores":
        from distnb.engine.process import binding

        binding.bind(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    X, Y = load_data()
    n = len(X)
    mine = sharding.assign(n, world, args.seed)[rank]  # same shards distnb's scatter deals
    Xs, Ys = X[mine], Y[mine]

    torch.manual_seed(0)
    ddp_options = dict(gradient_as_bucket_view=True, static_graph=args.static_graph)
    if args.bucket_cap_mb is not None:
        ddp_options["bucket_cap_mb"] = args.bucket_cap_mb
    model = DistributedDataParallel(MODELS[args.model](), **ddp_options)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model.train()

    def run_epochs(first, count):
        samples, steps, losses = 0, 0, []
        for epoch in range(first, first + count):
            order = sharding.epoch_order(n, world, rank, args.seed, epoch, False)
            loss_sum, num = 0.0, 0
            for idx in sharding.batches(order, args.batch_size, False):
                x, y = Xs[idx], Ys[idx]
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                loss_sum += loss.item()
                num += 1
                samples += len(idx)
                steps += 1
            t = torch.tensor([loss_sum, num], dtype=torch.float64)
            dist.all_reduce(t)  # mean loss over all ranks, as distnb reports per epoch
            losses.append(float(t[0] / t[1]))
        return samples, steps, losses

    if args.warmup_epochs:
        run_epochs(args.first_epoch - args.warmup_epochs, args.warmup_epochs)
    runs = []
    for rep in range(args.repeats):  # each repeat like one more %%distrain cell: epochs continue
        dist.barrier()
        busy0 = busy_cpu_seconds()
        c0 = time.process_time()
        t0 = time.perf_counter()
        samples, steps, losses = run_epochs(args.first_epoch + rep * args.epochs, args.epochs)
        seconds = time.perf_counter() - t0
        cpu_seconds = time.process_time() - c0  # all threads of this process, for the utilisation figure
        busy = busy_cpu_seconds() - busy0

        mine_figs = torch.tensor([samples, seconds, cpu_seconds], dtype=torch.float64)
        figs = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(figs, mine_figs)
        rows = [dict(rank=r, samples=int(f[0]), seconds=float(f[1]), samples_per_s=float(f[0] / f[1]),
                     cpu_seconds=float(f[2])) for r, f in enumerate(figs)]
        # machine CPU used by others while we trained (torchrun's agent counts as other: it is small)
        foreign = max(0.0, busy - sum(r["cpu_seconds"] for r in rows))
        runs.append(dict(samples_per_s=sum(r["samples_per_s"] for r in rows),
                         train_seconds=max(r["seconds"] for r in rows), steps=steps, final_loss=losses[-1],
                         cpu_utilisation=sum(r["cpu_seconds"] for r in rows) / sum(r["seconds"] for r in rows),
                         foreign_cores=foreign / seconds, rows=rows))
    if rank == 0:
        print(json.dumps(dict(model=args.model, world_size=world, epochs=args.epochs, batch_size=args.batch_size,
                              threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                              cpu_bind=args.cpu_bind,
                              runs=runs)), flush=True)
    dist.destroy_process_group()
    # gloo DDP processes sometimes abort at interpreter exit (FIELD-NOTES pitfall 1), which
    # torchrun reports as a failed run; leave at once instead (nothing is timed here).
    os._exit(0)


if __name__ == "__main__":
    main()
