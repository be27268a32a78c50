"""Every ``--strategy`` on the same model in one run: samples/s and parameter bytes per rank
against ddp, and the pipeline's bubble fraction against GPipe's prediction.

Model: an MLP of ``--blocks`` Linear(width, width)+ReLU blocks and a Linear head (an
``nn.Sequential``, so the pipeline cuts it into 2 balanced stages and tensor parallelism
pairs the Linears column-/row-wise), on generated data. Each strategy trains
``--epochs`` epochs per round after one untimed warm-up cell; rounds alternate the
strategies' order, and the figure is the median over ``--rounds``.

Bubble fraction (GPipe, Huang et al. 2019): with S balanced stages and M microbatches a
stage idles for (S-1)/(M+S-1) of a step. Measured here per stage as ``1 - busy / step``:
``step`` is the rank's training seconds per step, ``busy`` the CPU seconds its training
thread used per step (``time.thread_time``; a rank waiting for the other stage's activations
or gradients uses none). Sending activations and the schedule's own Python work count as
busy, so a small model shows how much of a step is overhead rather than bubble.

Usage::

    .venv/bin/python benchmarks/strategies.py [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
STRATEGIES = {"ddp": {}, "fsdp": {}, "tensor": {}, "pipeline": {"microbatches": 4}, "ps": {}}


def make_model(width, blocks, classes=10, seed=0):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def make_data(n, width, classes=10, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import copy

    import torch
    import torch.nn.functional as F

    from benchmarks.run import isolate_dirs
    import distnb

    isolate_dirs()
    torch.set_num_threads(1)
    base = make_model(args.width, args.blocks)
    total = sum(p.numel() * p.element_size() for p in base.parameters())
    ns = {"F": F, "data": make_data(args.samples, args.width)}
    s = distnb.start(n=2, ns=ns, quiet=True)
    rows = {k: {"samples_per_s": [], "param_bytes": None, "seconds_per_step": []} for k in STRATEGIES}
    try:
        for name, extra in STRATEGIES.items():  # warm-up: send model and data, build the strategy
            ns[f"m_{name}"] = copy.deepcopy(base)
            s.train(BODY, model=f"m_{name}", data="data", epochs=1, batch_size=args.batch_size, strategy=name,
                    optimizer="sgd", lr=0.01, progress="none", quiet=True, **extra)
        for rnd in range(args.rounds):
            order = list(STRATEGIES) if rnd % 2 == 0 else list(reversed(STRATEGIES))
            for name in order:
                r = s.train(BODY, model=f"m_{name}", data="data", epochs=args.epochs, batch_size=args.batch_size,
                            strategy=name, progress="none", quiet=True, **STRATEGIES[name])
                rows[name]["samples_per_s"].append(r.samples_per_s)
                rows[name]["seconds_per_step"].append(max(row["seconds"] / row["steps"] for row in r.rows))
                rows[name]["param_bytes"] = [row["param_bytes"] for row in r.rows]
        # the bubble: the pipeline at several microbatch counts
        bubbles = []
        for m in (1, 2, 4, 8):
            ns["m_bubble"] = copy.deepcopy(base)
            opts = dict(model="m_bubble", data="data", batch_size=args.batch_size, strategy="pipeline",
                        microbatches=m, progress="none", quiet=True, optimizer="sgd", lr=0.01)
            s.train(BODY, epochs=1, **opts)
            per_round = []
            for _ in range(args.rounds):
                s.run("import time\n_cpu0 = time.thread_time()")  # the engine thread that trains
                r = s.train(BODY, epochs=1, **opts)
                s.run("_busy = time.thread_time() - _cpu0")
                busy = s.pull("_busy")
                # per stage: the share of its step time it was not computing (waiting for the other stage)
                per_round.append([1 - (b / row["steps"]) / (row["seconds"] / row["steps"])
                                  for b, row in zip(busy, r.rows)])
            measured = statistics.median(statistics.mean(x) for x in per_round)
            bubbles.append(dict(microbatches=m, measured=max(0.0, measured), gpipe=(2 - 1) / (m + 2 - 1),
                                per_stage=[statistics.median(x[i] for x in per_round) for i in range(2)]))
    finally:
        s.stop(quiet=True)

    ddp = statistics.median(rows["ddp"]["samples_per_s"])
    print(f"model: {args.blocks} x Linear({args.width}, {args.width}) + head, {total:,} parameter bytes; "
          f"2 ranks, batch {args.batch_size}, median of {args.rounds} rounds")
    print(f"{'strategy':9} {'samples/s':>10} {'vs ddp':>7} {'param bytes rank 0':>19} {'rank 1':>10} {'share':>11}")
    table = []
    for name, row in rows.items():
        sps = statistics.median(row["samples_per_s"])
        pb = row["param_bytes"]
        share = " ".join(f"{b / total:.2f}" for b in pb)
        print(f"{name:9} {sps:10.0f} {sps / ddp:7.2f} {pb[0]:19,} {pb[1]:10,} {share:>11}")
        table.append(dict(strategy=name, samples_per_s=sps, ratio_vs_ddp=sps / ddp, param_bytes=pb,
                          share=[b / total for b in pb]))
    print("\npipeline bubble (2 stages): measured 1 - busy/step per stage vs GPipe's (S-1)/(M+S-1)")
    print(f"{'M':>3} {'stage 0':>8} {'stage 1':>8} {'mean':>6} {'GPipe':>6}")
    for b in bubbles:
        print(f"{b['microbatches']:3d} {b['per_stage'][0]:8.2f} {b['per_stage'][1]:8.2f} {b['measured']:6.2f} "
              f"{b['gpipe']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(strategies=table, bubble=bubbles, total_param_bytes=total), f, indent=1)


if __name__ == "__main__":
    main()
