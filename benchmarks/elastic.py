"""``%dist scale 3`` against ``%dist restart -n 3`` on a 2-rank world that has trained a model.

Each round, on the same cluster, the two sides alternate (the side going first flips):

- **scale**: ``s.scale(3)``, then one training cell: the model, Adam's state and the epoch carry on.
- **restart**: ``s.restart(n=3)``, then the same cell: the model is sent again from the
  notebook's weights with a fresh optimizer at epoch 0 (what resizing cost before ``%dist scale``).

Timed: the resize call, and the resize plus the next cell until it returns. Between sides the
world goes back to 2 ranks (untimed) and the model trains one cell there. Reported as medians.

Usage: ``python benchmarks/elastic.py [--rounds 5]`` (prints a table; exit status 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="distnb-bench-ipython-"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    import distnb

    x, y = load_digits(return_X_y=True)
    train = torch.utils.data.TensorDataset(torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ns = dict(net=net, train=train, F=F)
    body = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
    cell = dict(model="net", data="train", epochs=1, batch_size=64, progress="none", quiet=True)
    s = distnb.start(n=2, ns=ns, quiet=True)
    times = {"scale": [], "restart": []}
    try:
        s.train(body, optimizer="adam", lr=1e-3, **cell)
        for r in range(args.rounds):
            for side in (("scale", "restart") if r % 2 == 0 else ("restart", "scale")):
                t0 = time.perf_counter()
                if side == "scale":
                    s.scale(3, quiet=True)
                else:
                    s = s.restart(n=3, quiet=True)
                t1 = time.perf_counter()
                result = s.train(body, **cell)
                t2 = time.perf_counter()
                times[side].append((t1 - t0, t2 - t0, result.epochs[0]))
                s.scale(2, quiet=True)  # untimed: back to 2 ranks, one cell there
                s.train(body, **cell)
    finally:
        s.stop(quiet=True)
    load = os.getloadavg()
    print(f"rounds: {args.rounds}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} cores")
    print("side      resize (s)   resize + next cell (s)   next cell's first epoch")
    for side, rows in times.items():
        resize = statistics.median(t[0] for t in rows)
        total = statistics.median(t[1] for t in rows)
        print(f"{side:8}  {resize:10.2f}   {total:22.2f}   {sorted({t[2] for t in rows})}")
    ratio = statistics.median(t[1] for t in times["restart"]) / statistics.median(t[1] for t in times["scale"])
    print(f"restart / scale, resize + next cell: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
