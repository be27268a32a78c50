"""Issue 17, target 2: distnb on a shared machine, under a load the benchmark makes itself.

A shared JupyterHub node has other people's work on it. This benchmark makes that load
reproducible: ``--load-procs`` processes, each busy for ``--duty`` of every ``--period``
seconds and asleep for the rest (a fixed duty cycle, started before the rounds and stopped
after them by the benchmark itself). Under it, three sides train the same digits model with
the same loop as ``run.py --torchrun`` (``torchrun_digits.py``):

- ``template``: ``%%distrain`` on 2 warm engines forked from distnb's engine template;
- ``fresh``: the same on 2 engines started as fresh processes (``DISTNB_ZYGOTE=0``);
- ``torchrun``: the plain script under ``torchrun --nproc-per-node 2``.

Each round runs every side (``--repeats`` timed runs each; the order rotates round by round,
and the cluster is restarted when the engine kind changes, outside the timing). Reported per
side: the median samples/s, and the ratio to torchrun's median under the same load (target
>= 0.90), the spread of the per-round ratios (a figure is called decided only when a sign test over
its rounds puts it on one side of the target, ``benchmarks/verdicts.py``), and the CPU the load used. With ``--load-procs 0`` the same
rows are the quiet reference, in the same script::

    .venv/bin/python benchmarks/shared_load.py --load-procs 2 --duty 0.5 --rounds 5

``--cpu-bind`` (the engines, default auto) and ``--torchrun-cpu-bind`` (default none) set each side's
CPU binding (:mod:`distnb.engine.process.binding`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run as harness  # noqa: E402  (benchmarks/run.py: the notebook driver and the torchrun side)
import verdicts  # noqa: E402  (the sign test that says "decided")

TARGET = 0.90
SIDES = ("template", "fresh", "torchrun")
_SPIN = """
import os, sys, time
duty, period = float(sys.argv[1]), float(sys.argv[2])
while True:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duty * period:
        pass
    time.sleep(max(0.0, (1 - duty) * period))
"""


class Load:
    """``procs`` processes at a fixed duty cycle, for the span of a ``with`` block.

    Parameters
    ----------
    procs : int
        Number of load processes (0: no load).
    duty : float
        Fraction of each period a process spins, in (0, 1].
    period : float
        Seconds per cycle.
    """

    def __init__(self, procs: int, duty: float, period: float):
        self.procs, self.duty, self.period = procs, duty, period
        self._pids = []

    def __enter__(self):
        # detached (started by a shell that exits at once): like other users' work, the load is not a
        # descendant of this kernel, which is how --cpu-bind auto tells others' processes from its own
        for _ in range(self.procs):
            out = subprocess.run(["sh", "-c", '"$0" -c "$1" "$2" "$3" >/dev/null 2>&1 & echo $!', sys.executable,
                                  _SPIN, str(self.duty), str(self.period)], capture_output=True, text=True,
                                 check=True, start_new_session=True)
            self._pids.append(int(out.stdout.split()[-1]))
        time.sleep(0.2)
        return self

    def cpu_seconds(self) -> float:
        """CPU seconds the load processes have used so far."""
        import psutil

        total = 0.0
        for pid in self._pids:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def __exit__(self, *exc):
        import psutil

        procs = []
        for pid in self._pids:
            try:
                procs.append(psutil.Process(pid))
                procs[-1].kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
        self._pids = []
        return False


def ensure_engines(nb, kind: str, current: str | None, args) -> str:
    """A warm 2-rank cluster of ``kind`` (template or fresh), restarting the current one if it differs."""
    if kind == current:
        return current
    if current is not None:
        nb.cell("%dist stop", quiet=True)
    os.environ["DISTNB_ZYGOTE"] = "1" if kind == "template" else "0"
    nb.cell(f"%dist start -n 2 --cpu-bind {args.cpu_bind}", quiet=True)
    nb.cell(harness.distrain_line(args.model, args.warmup_epochs, args) + "\n" + harness.BODY, quiet=True)
    return kind


def one_round(nb, k: int, current, args, load: Load) -> tuple:
    """Every side once, in an order rotated by ``k``; (per-side runs, the cluster kind left running)."""
    out = {}
    order = SIDES[k % 3:] + SIDES[:k % 3]
    for side in order:
        c0, t0 = load.cpu_seconds(), time.perf_counter()
        if side == "torchrun":
            next_epoch = nb.ns["r"].epochs[-1] + 1 if "r" in nb.ns else 0
            runs = harness.run_torchrun(args, next_epoch)["runs"]
        else:
            current = ensure_engines(nb, side, current, args)
            c0, t0 = load.cpu_seconds(), time.perf_counter()
            runs = [harness.run_distnb(nb, args) for _ in range(args.repeats)]
        load_cores = (load.cpu_seconds() - c0) / max(1e-9, time.perf_counter() - t0)
        out[side] = dict(samples_per_s=statistics.median(x["samples_per_s"] for x in runs), runs=runs,
                         load_cores=load_cores)
    return out, current


def summarise(rounds: list) -> list:
    """Rows: side, median samples/s, ratio to torchrun, per-round ratios' range, decided or within noise."""
    med = statistics.median
    ref = med(r["torchrun"]["samples_per_s"] for r in rounds)
    rows = []
    for side in SIDES:
        value = med(r[side]["samples_per_s"] for r in rounds)
        per = [r[side]["samples_per_s"] / r["torchrun"]["samples_per_s"] for r in rounds]
        ratio = value / ref
        lo, hi = min(per), max(per)
        decided = side == "torchrun" or verdicts.decided(per, TARGET)
        rows.append(dict(side=side, samples_per_s=value, ratio=ratio, lo=lo, hi=hi, decided=decided,
                         load_cores=med(r[side]["load_cores"] for r in rounds)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load-procs", type=int, default=2, help="load processes (default 2; 0 = quiet)")
    p.add_argument("--duty", type=float, default=0.5, help="fraction of each period a load process spins")
    p.add_argument("--period", type=float, default=0.05, help="seconds per load cycle (default 0.05)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per side per round (default 2)")
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--cpu-bind", choices=("auto", "cores", "none"), default="auto",
                   help="the engines' %%dist start --cpu-bind (default auto, distnb's default)")
    p.add_argument("--torchrun-cpu-bind", choices=("none", "cores"), default="none",
                   help="the torchrun side's binding (default none, torchrun's default)")
    args = p.parse_args(argv)
    if not 0 < args.duty <= 1 or args.load_procs < 0 or args.rounds < 1:
        p.error("--duty must be in (0, 1], --load-procs >= 0, --rounds >= 1")
    args.epochs = args.epochs or harness.DEFAULT_EPOCHS[args.model]
    tmp = harness.isolate_dirs()
    import torchrun_digits as ref

    nb = harness.Notebook()
    nb.cell("%load_ext distnb")
    nb.cell("import torch, torch.nn as nn, torch.nn.functional as F\nfrom sklearn.datasets import load_digits\n"
            "X, y = load_digits(return_X_y=True)\n"
            "train = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))")
    import inspect

    nb.cell(inspect.getsource(ref.MODELS[args.model]))
    nb.cell(f"torch.manual_seed(0)\nnet = {ref.MODELS[args.model].__name__}()")
    print(f"shared-machine benchmark: {args.load_procs} load processes at duty {args.duty} (period {args.period} s); "
          f"{args.model}, {args.epochs} epochs; {args.rounds} rounds x {args.repeats} runs a side; "
          f"load average before {os.getloadavg()}", flush=True)
    rounds, current = [], None
    try:
        with Load(args.load_procs, args.duty, args.period) as load:
            for k in range(args.rounds):
                rnd, current = one_round(nb, k, current, args, load)
                rounds.append(rnd)
                print(f"round {k + 1}: " + ", ".join(f"{s} {rnd[s]['samples_per_s']:.0f} samples/s" for s in SIDES)
                      + f"; load used {rnd['torchrun']['load_cores']:.2f} cores", flush=True)
    finally:
        harness.stop_and_sweep(nb, tmp)
    rows = summarise(rounds)
    print()
    print(harness.fmt_table(("side", "samples/s (median)", "÷ torchrun", "per-round range", "target", "verdict",
                             "load cores"),
                            [(r["side"], f"{r['samples_per_s']:.0f}", f"{r['ratio']:.3f}",
                              f"{r['lo']:.3f}-{r['hi']:.3f}", "" if r["side"] == "torchrun" else f">= {TARGET}",
                              "" if r["side"] == "torchrun" else
                              ("PASS" if r["ratio"] >= TARGET else "FAIL") + ("" if r["decided"] else " (within noise)"),
                              f"{r['load_cores']:.2f}") for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rounds=rounds, rows=rows), f, indent=1, default=str)
    return 0 if all(r["ratio"] >= TARGET for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
