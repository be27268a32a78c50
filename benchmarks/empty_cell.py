"""The control plane's cost: an empty ``%%dist`` cell on N ranks, in wall time and in CPU per process (issue 20).

For each size in ``--sizes`` a cluster of N CPU ranks is started (engines forked from the engine
template), ``--cells`` empty cells (``session.run("pass")``, what ``%%dist`` runs) are timed in the
kernel, and the CPU time that each side used meanwhile is read from ``/proc`` (psutil): the kernel
process (its main thread and ipyparallel's client thread), the controller with its child processes
(hub, schedulers, heart monitor) and all engines together. CPU per cell is what a cell costs
whatever the load: on a machine with few cores it bounds the round trip from below, since every
engine's share is serialized with the others'. Wall times are upper bounds on a shared machine:
the 1-minute load average is printed beside each row.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/empty_cell.py [--sizes 2,16,32] [--cells 40] [--json PATH]

To compare two checkouts, run the same command with ``PYTHONPATH`` pointing at each, alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _cpu(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # a process that ended meanwhile
            pass
    return total


def one_size(n: int, cells: int) -> dict:
    """Figures for ``n`` ranks: start seconds, empty-cell wall ms (median, quartiles), CPU ms per cell."""
    import psutil

    import distnb

    t0 = time.perf_counter()
    session = distnb.start(n=n, quiet=True)
    start_s = time.perf_counter() - t0
    try:
        session.run("import torch")
        for _ in range(3):  # warm: the first cells after a start import and allocate
            session.run("pass")
        cluster = session.cluster
        ctrl = psutil.Process(cluster.pids["controller"])
        sides = dict(kernel=[psutil.Process()], controller=[ctrl, *ctrl.children(recursive=True)],
                     engines=[psutil.Process(r["pid"]) for r in cluster.ranks])
        load0 = os.getloadavg()[0]
        before = {k: _cpu(v) for k, v in sides.items()}
        walls = []
        for _ in range(cells):
            t = time.perf_counter()
            session.run("pass")
            walls.append(time.perf_counter() - t)
        after = {k: _cpu(v) for k, v in sides.items()}
        q = statistics.quantiles(walls, n=4)
        out = dict(n=n, start_s=round(start_s, 2), empty_ms=round(1e3 * statistics.median(walls), 1),
                   q1_ms=round(1e3 * q[0], 1), q3_ms=round(1e3 * q[2], 1), cells=cells,
                   load=[round(load0, 1), round(os.getloadavg()[0], 1)])
        out.update({f"{k}_cpu_ms": round(1e3 * (after[k] - before[k]) / cells, 1) for k in sides})
        return out
    finally:
        session.stop(quiet=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="2,16,32")
    p.add_argument("--cells", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from distnb.cluster import zygote

    zygote.warm()
    rows = []
    print(f"distnb from {os.path.dirname(__import__('distnb').__file__)}", file=sys.stderr)
    for n in [int(s) for s in args.sizes.split(",")]:
        row = one_size(n, args.cells)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
