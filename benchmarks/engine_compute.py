"""Does an engine compute as fast as a plain Python process? (issue 17: the %%dist DDP loop's gap)

The same work, 1,500 AdamW steps of a 64-256-64 MLP on one torch thread (no collective), runs in a
``%%dist`` cell on rank 0 alone (rank 1 idle) and in a fresh plain ``python -c`` process, alternated
``--rounds`` times. Per run: wall seconds, the process's CPU seconds (every thread) and the main
thread's CPU seconds, so an engine's extra threads show as the difference of the last two.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/engine_compute.py [--rounds 4] [--steps 1500]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

WORK = """
import time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
_m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
_opt = torch.optim.AdamW(_m.parameters(), 1e-3)
_x = torch.randn(32, 64)
def _loop(n):
    for _ in range(n):
        _opt.zero_grad()
        _m(_x).pow(2).mean().backward()
        _opt.step()
_loop(50)
_t0, _c0, _h0 = time.perf_counter(), time.process_time(), time.thread_time()
_loop(STEPS)
_res = (time.perf_counter() - _t0, time.process_time() - _c0, time.thread_time() - _h0)
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=1500)
    args = p.parse_args(argv)
    import distnb

    work = WORK.replace("STEPS", str(args.steps))
    session = distnb.start(n=2, quiet=True)
    ratios = []
    try:
        for r in range(args.rounds):
            session.run(work, targets=[0])
            engine = session.pull("_res", rank=0)
            out = subprocess.run([sys.executable, "-c", work + "\nprint(*_res)"], capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True).stdout.split()
            plain = tuple(float(v) for v in out)
            ratios.append(plain[0] / engine[0])
            print(f"round {r}: engine wall {engine[0]:.3f} s, CPU {engine[1]:.3f} s (main thread {engine[2]:.3f}); "
                  f"plain wall {plain[0]:.3f} s, CPU {plain[1]:.3f} s; plain / engine {ratios[-1]:.3f}; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        session.stop(quiet=True)
    print(f"plain / engine wall, median of {len(ratios)}: {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
