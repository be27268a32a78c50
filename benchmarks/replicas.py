"""The cost of ``--check-replicas`` (issue 38, item 4): the same ddp training with the check at its default
(``epoch``: at the cell's start and each epoch's end) and ``off``, alternated in one run, and the check's
own time on the ranks.

The model is an MLP of about ``--params`` million parameters (the digest pass reads every parameter once,
so its cost grows with the model; the all-reduces are two int64 per tensor), trained with DDP on 2 CPU
ranks on synthetic data for ``--epochs`` epochs per cell. Each round trains one cell with each setting,
in alternating order, and reports the cell's training seconds (the ranks' own clocks, the TrainResult's
``train_seconds``); the verdict is the median of the per-round ratios. The check's own time is also
timed directly on the ranks (``replicas.check`` called ``--direct`` times in a ``%%dist`` cell), and
related to one epoch's time.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/replicas.py [--params 5] [--epochs 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

BODY = "x, y = batch\nloss = F.mse_loss(model(x), y)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=5.0, help="millions of parameters (default 5)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--direct", type=int, default=20, help="direct calls of the check timed on the ranks")
    args = ap.parse_args(argv)

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import distnb

    width = int((args.params * 1e6 / 3) ** 0.5)  # 3 layers of width x width
    torch.manual_seed(0)
    x = torch.randn(4096, width)
    y = torch.randn(4096, width)
    session = distnb.start(n=2, quiet=True)
    try:
        session.ns.update(F=F, data=(x, y))
        times = {"epoch": [], "off": []}
        for r in range(args.rounds):
            order = ("epoch", "off") if r % 2 == 0 else ("off", "epoch")
            for mode in order:
                session.ns["net"] = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                                                  nn.ReLU(), nn.Linear(width, width))
                res = session.train(BODY, model="net", data="data", epochs=args.epochs, batch_size=64, lr=1e-3,
                                    check_replicas=mode, progress="none", quiet=True)
                times[mode].append(res.train_seconds)
        ratios = [on / off for on, off in zip(times["epoch"], times["off"])]
        params = sum(p.numel() for p in session.ns["net"].parameters())
        direct = session.run(
            "import time\nfrom distnb.engine.train import loop, replicas\n_s = loop.RUNS['net'].strategy\n"
            f"_t = time.perf_counter()\nfor _ in range({args.direct}): replicas.check(_s, 'bench')\n"
            f"(time.perf_counter() - _t) / {args.direct}")
        check_s = max(float(v) for v in direct)
        epoch_s = statistics.median(times["off"]) / args.epochs
        print(f"model: {params / 1e6:.2f}M parameters ({params * 4 / 2**20:.0f} MiB fp32), ddp, 2 CPU ranks, "
              f"{args.epochs} epochs of {4096 // 2 // 64} steps per rank")
        print(f"cell training seconds, check epoch: {', '.join(f'{t:.3f}' for t in times['epoch'])}")
        print(f"cell training seconds, check off:   {', '.join(f'{t:.3f}' for t in times['off'])}")
        print(f"ratio epoch/off per round: {', '.join(f'{q:.3f}' for q in ratios)}; median {statistics.median(ratios):.3f}")
        print(f"one check on the ranks: {check_s * 1000:.2f} ms (slowest rank, mean of {args.direct}); one epoch "
              f"{epoch_s:.3f} s: the default's cost per epoch is {100 * check_s / epoch_s:.2f} % "
              f"(plus one check at each cell's start)")
    finally:
        session.stop(quiet=True)


if __name__ == "__main__":
    main()
