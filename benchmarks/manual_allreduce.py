"""A hand-written data-parallel loop in a ``%%dist`` cell against the same loop under torchrun (issue 17).

The loop averages its gradients itself, one ``dist.all_reduce`` per parameter (the digits MLP of
``torchrun_digits.py``: 6 tensors, 17k parameters), then steps Adam: what a tutorial writes before
it reaches for DDP. In a cell each of those calls is checked across ranks first (a fingerprint
all-gather, :mod:`distnb.engine.process.collectives`); ``%%dist --unchecked`` calls torch's directly. The
reference is the same source run by ``torchrun --nproc-per-node 2`` (gloo, one torch thread a rank,
each worker bound to its own core like distnb's ``--cpu-bind cores`` engines, or unbound with
``--torchrun-cpu-bind none``). Rounds alternate torchrun, checked and unchecked; each ratio is torchrun's
time per step / the cell's, judged by :mod:`verdicts` (target 0.95 for the unchecked cell, as for a
``%%dist`` DDP loop; the checked one is reported).

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/manual_allreduce.py [--rounds 6] [--steps 200]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from verdicts import verdict  # noqa: E402

LOOP = '''
import time, torch, torch.nn.functional as F, torch.distributed as dist
from torchrun_digits import DigitsMLP, load_data
from distnb.engine.transport import shard as sharding

def manual_loop(rank, world_size, steps):
    """Seconds per step of `steps` steps of a hand-written data-parallel loop (after 20 untimed)."""
    torch.manual_seed(0)
    X, Y = load_data()
    mine = sharding.assign(len(X), world_size, 0)[rank]
    x, y = X[mine][:64], Y[mine][:64]
    model = DigitsMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        optimizer.step()
    for _ in range(20):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps
'''

TORCHRUN = LOOP + '''
import os, sys
torch.set_num_threads(1)
if sys.argv[2] == "cores":
    from distnb.engine.process import binding
    binding.bind(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
dist.init_process_group("gloo")
per_step = manual_loop(dist.get_rank(), dist.get_world_size(), int(sys.argv[1]))
t = torch.tensor([per_step], dtype=torch.float64)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
if dist.get_rank() == 0:
    print(t.item())
dist.destroy_process_group()
'''


def _torchrun(steps: int, bind: str, script: str) -> float:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE)]), OMP_NUM_THREADS="1")
    out = subprocess.run([torchrun, "--nproc-per-node", "2", script, str(steps), bind], capture_output=True,
                         text=True, env=env, check=True, timeout=300).stdout
    return float(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="alternated rounds (default 6: the fewest the sign test "
                                                         "can decide)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per run (default 200)")
    p.add_argument("--torchrun-cpu-bind", choices=("cores", "none"), default="cores")
    p.add_argument("--json", default=None, help="also write every measurement to this file")
    args = p.parse_args(argv)
    import tempfile

    import distnb

    script = os.path.join(tempfile.mkdtemp(prefix="distnb-bench-"), "manual_loop.py")
    with open(script, "w") as f:
        f.write(TORCHRUN)
    s = distnb.start(n=2, quiet=True, cpu_bind="cores")
    rows = []
    try:
        s.run(f"import sys\nsys.path[:0] = [{HERE!r}]\nimport torch\ntorch.set_num_threads(1)")
        s.run(LOOP)  # defined in a cell: its collectives are checked unless the cell says --unchecked
        cell = (f"t = torch.tensor([manual_loop(rank, world_size, {args.steps})], dtype=torch.float64)\n"
                "dist.all_reduce(t, op=dist.ReduceOp.MAX)\nt.item()")  # the slower rank's time per step
        for r in range(args.rounds):
            row = {"torchrun": _torchrun(args.steps, args.torchrun_cpu_bind, script)}
            for name, unchecked in (("checked", False), ("unchecked", True))[::1 if r % 2 == 0 else -1]:
                with contextlib.redirect_stdout(io.StringIO()):  # the cell's value, printed per rank
                    row[name] = float(s.run(cell, unchecked=unchecked)[0])
            rows.append(row)
            print(f"round {r + 1}: ms/step torchrun {row['torchrun'] * 1e3:.2f}, %%dist {row['checked'] * 1e3:.2f}, "
                  f"%%dist --unchecked {row['unchecked'] * 1e3:.2f}", flush=True)
    finally:
        s.stop(quiet=True)
    print("\n| figure | ms/step (median) | torchrun / cell, median of rounds | target | verdict |")
    print("|---|---|---|---|---|")
    print(f"| torchrun, {args.torchrun_cpu_bind} | {statistics.median(r['torchrun'] for r in rows) * 1e3:.2f} | | | |")
    for name, target in (("checked", None), ("unchecked", 0.95)):
        ratios = [r["torchrun"] / r[name] for r in rows]
        label = "%%dist (checked)" if name == "checked" else "%%dist --unchecked"
        print(f"| {label} | {statistics.median(r[name] for r in rows) * 1e3:.2f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) | {'>= %.2f' % target if target else 'reported'} | "
              f"{verdict(ratios, target)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
