#!/usr/bin/env python3
"""Issue 37, item 4: the warm-cell overhead and ``%dist start`` before and after the move, in one run.

    .venv/bin/python benchmarks/two_checkouts.py BEFORE AFTER [--rounds 4] [--cells 20] [--json out.json]

BEFORE and AFTER are two checkouts of distnb (main before the move, and the same commit after
relayout.py). Each round runs, for each checkout in turn (the order alternates round by round, so
that a machine getting busier does not favour one side), in a fresh interpreter with that checkout
first on ``PYTHONPATH``:

* ``benchmarks/warm_cell.py --cells N``: the warm ``%%distrain`` cell's overhead
  (``TrainResult.overhead_seconds``, median over N cells) beside a bare ``apply_all`` round trip;
* ``benchmarks/cold_start.py``'s ``measure_start`` for one round: ``%dist start -n 2`` until ready
  (after ``%load_ext distnb``, as suite.py does), beside the plain-ipyparallel reference started in
  the same process.

It prints one line per run and, at the end, the medians of each side with their ratio
(after / before: 1.0 is unchanged; on this shared 2-core machine a third either way is noise,
compare with the reference columns measured alongside).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

START = r'''
import json, sys
sys.path.insert(0, "benchmarks")
import run as harness, suite, cold_start
nb = harness.Notebook()
suite.prepare_notebook(nb)
out = cold_start.measure_start(nb, 1, log=lambda *a: None)
print(json.dumps(dict(start=out["distnb"], reference=out["reference"])))
'''


def _run(tree: str, args: list, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise SystemExit(f"{tree}: {' '.join(args[:2])} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def one(tree: str, cells: int) -> dict:
    warm = _run(tree, ["benchmarks/warm_cell.py", "--cells", str(cells)], 900)
    start = _run(tree, ["-c", START], 600)
    return dict(overhead_ms=warm["overhead"]["median_ms"], round_trip_ms=warm["bare_round_trip"]["median_ms"],
                start_s=start["start"], start_reference_s=start["reference"], load=warm["load"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="checkout before the move")
    p.add_argument("after", help="checkout after relayout.py")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cells", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sides = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    runs = {"before": [], "after": []}
    for k in range(args.rounds):
        for side in (("before", "after") if k % 2 == 0 else ("after", "before")):
            r = one(sides[side], args.cells)
            runs[side].append(r)
            print(f"round {k + 1} {side:6}: warm cell overhead {r['overhead_ms']:.1f} ms (bare round trip "
                  f"{r['round_trip_ms']:.1f} ms); %dist start {r['start_s']:.2f} s (ipyparallel reference "
                  f"{r['start_reference_s']:.2f} s); load {r['load']}", flush=True)
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    for key in ("overhead_ms", "round_trip_ms", "start_s", "start_reference_s"):
        b, a = med["before"][key], med["after"][key]
        print(f"{key:18} before {b:8.3f}  after {a:8.3f}  after/before {a / b:5.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(medians=med, runs=runs, sides=sides), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
