"""The warm ``%%distrain`` cell's overhead (issue 17, target 4: <= 10 ms), beside a bare round trip.

A cluster of ``--ranks`` CPU ranks trains the digits MLP (64-32-10, 1 epoch of 15 steps at batch 64 on
2 ranks) through ``Session.train(..., data=(X, y), progress="none", quiet=True)``: 3 untimed cells, then
``--cells`` timed ones. Each gives ``TrainResult.overhead_seconds`` (the cell's wall time minus the slowest
rank's training time); after each, a bare ``apply_all(calls.info)`` round trip to every rank is timed, the
floor that ipyparallel puts under any cell on this machine at that moment. ``--same`` passes one
``(X, y)`` object to every cell instead of a new tuple per call (as a name in the notebook does);
``--progress text`` shows each cell's text progress (its lines go to stdout) instead of none.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/warm_cell.py [--cells 30] [--same] [--progress none|text] [--json PATH]

To compare two checkouts, run it with ``PYTHONPATH`` pointing at each, alternated (timings on a shared
2-core machine vary by a third between runs; compare medians of runs made in turn).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def figures(xs) -> dict:
    q = statistics.quantiles(xs, n=4)
    return dict(median_ms=round(1e3 * statistics.median(xs), 2), q1_ms=round(1e3 * q[0], 2), q3_ms=round(1e3 * q[2], 2))


def measure(cells: int, same: bool, ranks: int = 2, progress: str = "none") -> dict:
    import torch
    from sklearn.datasets import load_digits

    import distnb

    torch.set_num_threads(1)
    digits = load_digits()
    X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    code = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
    session = distnb.start(n=ranks, quiet=True)
    rows = []
    try:
        import torch.nn.functional as F

        session.ns.update(F=F, net=net)
        one = (X, y)
        for i in range(3 + cells):
            result = session.train(code, model="net", data=one if same else (X, y), epochs=1, batch_size=64,
                                   progress=progress, quiet=True)
            t = time.perf_counter()
            session.cluster.wait_all(session.cluster.apply_all(distnb.core.calls.info), 30, "a bare round trip")
            if i >= 3:
                rows.append((result.overhead_seconds, result.train_seconds, time.perf_counter() - t))
    finally:
        session.stop(quiet=True)
    return dict(ranks=ranks, cells=cells, same=same, progress=progress, load=round(os.getloadavg()[0], 1),
                distnb=os.path.dirname(distnb.__file__), overhead=figures([r[0] for r in rows]),
                train=figures([r[1] for r in rows]), bare_round_trip=figures([r[2] for r in rows]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", type=int, default=30)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--same", action="store_true", help="one (X, y) object for every cell")
    p.add_argument("--progress", default="none", choices=("none", "text"),
                   help="the cells' progress view (default none; text prints each cell's epoch lines)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = measure(args.cells, args.same, args.ranks, args.progress)
    print(json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
