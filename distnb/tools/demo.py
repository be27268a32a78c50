"""The main job: train a digits classifier data-parallel on an embedded cluster.

``python -m distnb.tools.demo`` starts the default cluster (one CPU engine per core, or one
per GPU), scatters scikit-learn's digits training split as shards, trains an MLP with
DDP through the same API the ``%%distrain`` magic uses, prints per-rank figures, and
evaluates the weights that came back on the held-out split in this process.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time

import distnb


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=None, help="ranks (default: one per core or GPU)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args(argv)
    if "IPYTHONDIR" not in os.environ:  # a profile of its own, removed at exit (after the engine template stops)
        os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix="distnb-ipython-")
        atexit.register(shutil.rmtree, os.environ["IPYTHONDIR"], True)
    from distnb.cluster import zygote  # loads psutil: at first use, not when this module is imported

    zygote.warm()  # as %load_ext does: the engine template imports while this process loads torch and the data

    import torch
    import torch.nn as nn
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split


    X, y = load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)
    train = torch.utils.data.TensorDataset(torch.tensor(X_tr, dtype=torch.float32) / 16, torch.tensor(y_tr))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    ns = {"net": net, "train": train, "F": torch.nn.functional}

    t0 = time.perf_counter()
    session = distnb.start(n=args.n, ns=ns)
    try:
        print(session.status())
        result = session.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", model="net", data="train",
                               epochs=args.epochs, batch_size=args.batch_size, optimizer="adam", lr=args.lr,
                               progress="text")
        print()
        print(result)
        with torch.no_grad():
            pred = net(torch.tensor(X_te, dtype=torch.float32) / 16).argmax(1)
        accuracy = (pred == torch.tensor(y_te)).float().mean().item()
        print(f"\ntest accuracy on {len(y_te)} held-out digits (weights back in this process): {accuracy:.4f}")
        print(f"total {time.perf_counter() - t0:.1f} s (cluster start {session.cluster.start_seconds:.1f} s, "
              f"training cell {result.wall_seconds:.2f} s)")
    finally:
        session.stop()
    return accuracy


if __name__ == "__main__":
    acc = main()
    raise SystemExit(0 if acc >= 0.95 else 1)
