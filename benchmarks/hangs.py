"""How fast a hang is named and ``%dist where`` answers (issue: see inside every rank).

A real IPython shell with a real 2-rank cluster (``%dist start -n 2 --hang-after H``) runs, in
alternated rounds:

- a ``%%dist`` cell in which rank 0 alone calls ``dist.all_reduce`` (rank 1 finishes the cell);
- a ``%%dist`` cell in which rank 1 sleeps while rank 0 waits in ``all_reduce``;
- a ``%%distrain`` cell in which rank 1 sleeps inside a step while rank 0 waits in DDP's
  gradient all-reduce;

and reports, per case, the median seconds from the cell's start to the HangError minus H (the
target: at most 2 s), plus the median time of ``%dist where`` between cells (target: at most
2 s). Usage::

    .venv/bin/python benchmarks/hangs.py [--rounds 5] [--hang-after 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

CASES = {
    "rank-0-only all_reduce": "%%dist\nt = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(t)\n",
    "rank 1 in its code": "%%dist\nt = torch.ones(4)\nif rank == 1:\n    time.sleep(60)\ndist.all_reduce(t)\n",
    "DDP step, rank 1 asleep": ("%%distrain --model hnet --data hdata --epochs 2 --batch-size 8 --progress none\n"
                                "x, y = batch\nif rank == 1 and ctx.step == 2:\n    time.sleep(60)\n"
                                "loss = F.cross_entropy(model(x), y)\n"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hang-after", type=float, default=3.0)
    args = p.parse_args()
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from distnb import session
    from distnb.cluster import zygote
    from distnb.core.errors import HangError

    config = Config()
    config.HistoryManager.enabled = False
    sh = InteractiveShell.instance(config=config)
    sh.run_line_magic("load_ext", "distnb")
    sh.run_line_magic("dist", f"start -n 2 --timeout 60 --hang-after {args.hang_after}")
    sh.run_cell("import time, torch, torch.nn as nn, torch.nn.functional as F\n"
                "hnet = nn.Linear(4, 2)\nhdata = torch.utils.data.TensorDataset(torch.randn(64, 4), "
                "torch.randint(0, 2, (64,)))")
    sh.run_cell("%%dist\nimport time, torch, torch.distributed as dist")
    late = {name: [] for name in CASES}
    where = []
    try:
        for k in range(args.rounds):
            names = list(CASES) if k % 2 == 0 else list(reversed(CASES))
            for name in names:
                t0 = time.monotonic()
                res = sh.run_cell(CASES[name], silent=True)
                took = time.monotonic() - t0
                assert isinstance(res.error_in_exec, HangError), res.error_in_exec
                late[name].append(took - args.hang_after)
                t0 = time.monotonic()
                sh.run_line_magic("dist", "where")
                where.append(time.monotonic() - t0)
            print(f"round {k + 1}: " + "; ".join(f"{n} +{late[n][-1]:.2f} s" for n in CASES), flush=True)
    finally:
        session.current().stop(quiet=True)
        zygote.stop()
    print()
    print("| figure | median | target |")
    print("|---|---|---|")
    for name, values in late.items():
        med = statistics.median(values)
        print(f"| hang named after --hang-after, {name} | +{med:.2f} s | <= +2 s: {'PASS' if med <= 2 else 'FAIL'} |")
    med = statistics.median(where)
    print(f"| %dist where between cells | {med * 1000:.0f} ms | <= 2 s: {'PASS' if med <= 2 else 'FAIL'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
