"""Every target of issue 6 in one run, each as a ratio against its reference measured alongside.

``make bench`` (``benchmarks/run.py``) runs this; ``--only`` picks sections. Each section
alternates distnb and its reference for ``--rounds`` rounds (default 5) and reports medians;
the table has one row per figure: figure, distnb, reference, ratio, target, pass/fail.

Sections (in this order, so that clusters are started as few times as possible):

- ``cold``: ``%dist start -n 2`` vs a default ``ipyparallel.Cluster`` + naive gloo group (3a);
  cold start + first training cell vs Accelerate's ``notebook_launcher`` (3b, and the
  launcher's wall time that 1 is a share of).  [cold_start.py, accel_digits.py]
- ``transfer``: a 403 MB model to 2 ranks and back, a 200 MB data set scattered (4, 5),
  distnb's shared-memory path vs the ipyparallel buffers it falls back to.  [transfer.py]
- ``throughput``: warm cells vs ``torchrun`` for the digits CNN and a 4.9M-parameter MLP (2),
  and the warm-cell overhead of the CNN cells (1).  [throughput.py, run.py]
- ``threads``: distnb's threads per rank vs torch's default (6); ``scaling``: 2 ranks vs 1
  rank on a compute-bound CNN (7).  [throughput.py]
- ``dashboard``: ``--progress widgets`` vs ``none`` (8).  [run.py --dashboard]

Not in this run (it takes long on 2 cores): every strategy, bf16 and --compile on char-level
transformers against hand-written torchrun scripts (issue 17).  [run.py --transformers, char_transformers.py]

Usage::

    .venv/bin/python benchmarks/run.py [--rounds 5] [--only cold,transfer,...] [--json results.json]
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
SECTIONS = ("cold", "transfer", "throughput", "threads", "scaling", "dashboard")
EXTRA_SECTIONS = ("launch",)  # not run by default: what the cold-start fix gained (the previous launch, emulated)
EPOCHS = 15  # the digits CNN run of targets 1-3: about 1.5 s of training on 2 cores
COMPUTE_EPOCHS, COMPUTE_BATCH = 2, 64  # the compute-bound CNN of targets 6-7


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine() -> str:
    import torch

    try:
        import ipyparallel

        ipp = ipyparallel.__version__
    except ImportError:
        ipp = "?"
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    mem = ""
    try:
        import psutil

        mem = f", {psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    except ImportError:
        pass
    return (f"{os.cpu_count()} cores ({cpu or platform.processor()}){mem}; Linux {platform.release()}; "
            f"Python {platform.python_version()}; torch {torch.__version__}; ipyparallel {ipp}")


def _fmt(x, digits=2):
    if x is None or x == "":
        return ""
    if isinstance(x, str):
        return x
    return f"{x:.{digits}f}"


class Table:
    def __init__(self):
        self.rows = []

    def add(self, figure, distnb, reference, ratio, target, ok, digits=2, ratio_digits=3):
        verdict = "info" if ok is None else ("PASS" if ok else "FAIL")
        self.rows.append((figure, _fmt(distnb, digits), _fmt(reference, digits), _fmt(ratio, ratio_digits),
                          target, verdict))

    @contextlib.contextmanager
    def section(self, figure):
        """One section of the suite: a failure is printed and becomes an error row; the suite goes on."""
        try:
            yield
        except Exception as exc:
            traceback.print_exc()
            self.error(figure, exc)

    def error(self, figure, exc):
        self.rows.append((figure, "", "", "", "", f"ERROR: {type(exc).__name__}: {exc}"[:120]))

    def render(self, fmt_table):
        return fmt_table(("figure", "distnb", "reference", "ratio", "target", "pass/fail"), self.rows)


def prepare_notebook(nb):
    nb.cell("%load_ext distnb")
    nb.cell("import torch, torch.nn as nn, torch.nn.functional as F\n"
            "from sklearn.datasets import load_digits\n"
            "X, y = load_digits(return_X_y=True)\n"
            "train = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))")


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="distnb benchmarks: every target of issue 6 in one run",
                                epilog="Single benchmarks with their own options: run.py --torchrun --help "
                                       "(throughput against torchrun), run.py --dashboard --help.")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds per figure (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="training runs a side per throughput round (default 3)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections: {', '.join(SECTIONS)} (default: all), or {', '.join(EXTRA_SECTIONS)}")
    p.add_argument("--json", default=None, help="also write every measurement to this file")
    args = p.parse_args(argv)
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only) - set(SECTIONS) - set(EXTRA_SECTIONS))
    if unknown or args.rounds < 1:
        p.error(f"unknown sections {unknown}" if unknown else "--rounds must be at least 1")

    sys.path.insert(0, HERE)
    import run as harness  # noqa: E402  the notebook shell, torchrun runner, tables, clean-up
    import torchrun_digits as ref  # noqa: E402

    tmp = harness.isolate_dirs()
    t_start = time.perf_counter()
    load0 = load_average()
    print(f"distnb benchmarks: {', '.join(only)}; {args.rounds} rounds each; {machine()}; load average {load0}",
          flush=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    table, results, section_load = Table(), {}, {}

    def loaded(name, fn):  # fn() while measuring the CPU other processes use (the machine is shared)
        with harness.ForeignCpu() as foreign:
            out = fn()
        section_load[name] = foreign.cores
        return out

    nb = harness.Notebook()
    cnn_cell = (f"%%distrain --model net --data train --epochs {EPOCHS} --batch-size 64 --optimizer adam --lr 0.001 "
                f"--progress none -o r\n{harness.BODY}")
    try:
        prepare_notebook(nb)
        import throughput

        throughput.use_model(nb, ref.DigitsCNN)

        if "cold" in only:
            import accel_digits
            import cold_start

            with table.section("cold start"):
                log("cold start: %dist start vs ipyparallel.Cluster defaults + naive process group")
                c = results["cold_start"] = loaded("cold", lambda: cold_start.measure_start(nb, args.rounds, log=log))
                table.add("cold start: `%dist start -n 2` until ready, s (ref: ipyparallel.Cluster defaults + naive "
                          "gloo group)", c["distnb"], c["reference"], c["distnb"] / c["reference"], "<= 0.40",
                          c["distnb"] / c["reference"] <= 0.40)
            with table.section("cold start + first cell"):
                log(f"cold start + first training cell ({EPOCHS} epochs) vs Accelerate notebook_launcher")
                X, Y = nb.ns["train"].tensors
                launch = lambda: accel_digits.launch(ref.DigitsCNN, X, Y, EPOCHS, 64, 1e-3)  # noqa: E731
                f = results["first_cell"] = loaded("first cell", lambda: cold_start.measure_first_cell(
                    nb, args.rounds, cnn_cell, launch, reset_cell="torch.manual_seed(0)\nnet = DigitsCNN()", log=log))
                table.add(f"cold start + first training cell ({EPOCHS} epochs digits CNN; `%load_ext` earlier), s (ref: Accelerate "
                          "notebook_launcher, same training)", f["distnb"], f["reference"],
                          f["distnb"] / f["reference"], "< 1.00", f["distnb"] / f["reference"] < 1.0)
                table.add("  same, `%load_ext distnb` in the timed cell (the engine template still importing), s",
                          f["load_ext"], f["reference"], f["load_ext"] / f["reference"], "(reported)", None)
                table.add("  same, no engine template (DISTNB_ZYGOTE=0: fresh engine processes), s",
                          f["no_template"], f["reference"], f["no_template"] / f["reference"], "(reported)", None)

        if "launch" in only:
            import cold_start

            with table.section("launch"):
                log("launch: %dist start now vs the engine launch before the cold-start fix")
                c = results["launch"] = cold_start.measure_launch_fix(nb, args.rounds, log=log)
                table.add("`%dist start -n 2`, s (ref: the same before the launch fix)", c["distnb"], c["reference"],
                          c["distnb"] / c["reference"], "< 1.00 (what the fix gained)", c["distnb"] < c["reference"])

        if any(s in only for s in ("transfer", "throughput", "threads", "scaling")):
            nb.cell("%dist start -n 2", quiet=True)
            nb.cell("torch.manual_seed(0)\nnet = DigitsCNN()", quiet=True)

        if "transfer" in only:
            import transfer

            with table.section("transfer"):
                log("transfer: 403 MB model to 2 ranks and back, 200 MB data scattered; shared memory vs ipyparallel")
                t = results["transfer"] = loaded("transfer", lambda: transfer.measure(nb, args.rounds, log=log))
                a, b, first = t["shm"], t["ipyparallel"], t["shm_first"]
                copies = f"memory copy {a['copy_warm_gbs']:.1f} GB/s warm, {a['copy_fresh_gbs']:.1f} first touch"
                table.add("  the machine now: " + copies, "", "", "", "", None)
                for key, what in (("send_gbs", "model 403 MB fp32 (100.7M params) to 2 ranks"),
                                  ("back_gbs", "weights back 403 MB, rank 0 to the kernel's model"),
                                  ("scatter_gbs", "scatter 200 MB float32 data set to 2 ranks")):
                    table.add(f"{what}, again (rounds 2+), GB/s (ref: ipyparallel buffers)", a[key], b[key],
                              a[key] / b[key], ">= 4 GB/s", a[key] >= 4.0)
                    table.add("  as a fraction of the copy rates: warm / first touch",
                              f"{a[key] / a['copy_warm_gbs']:.2f} / {a[key] / a['copy_fresh_gbs']:.2f}", "", "", "", None)
                    table.add("  the first one after start, GB/s", first[key], "", "", "reported", None)
                table.add("kernel memory added while sending / pulling back the model, MB (peak RSS)",
                          f"{a['send_mem_mb']:.0f} / {a['back_mem_mb']:.0f}",
                          f"{b['send_mem_mb']:.0f} / {b['back_mem_mb']:.0f}", "",
                          "no full copy (< 403)", max(a["send_mem_mb"], a["back_mem_mb"]) < 403 * 0.5)
                table.add("  bytes each rank holds of the 200 MB set, MB", " / ".join(f"{x:.0f}" for x in a["shard_mb"]),
                          " / ".join(f"{x:.0f}" for x in b["shard_mb"]), "", "its shard only (100)",
                          all(x < 110 for x in a["shard_mb"]))

        if "throughput" in only:
            for model, label in (("cnn", "digits CNN, 38k params"), ("mlp5m", "MLP, 4.9M params")):
                with table.section(f"throughput {model}"):
                    log(f"throughput: {label}, warm %%distrain vs torchrun --nproc-per-node 2")
                    epochs = EPOCHS if model == "cnn" else 3
                    t = results[f"throughput_{model}"] = loaded(model, lambda: throughput.against_torchrun(
                        nb, harness, model, args.rounds, args.repeats, epochs, log=log))
                    table.add(f"training throughput, {label}, samples/s (ref: torchrun, same script)",
                              t["distnb"], t["reference"], t["ratio_of_medians"], ">= 1.00",
                              t["ratio_of_medians"] >= 1.0, digits=0)
                    table.add("  same, median of the per-round ratios", "", "", t["median_round_ratio"], "", None)
            cnn = results.get("throughput_cnn")
            launcher = results.get("first_cell", {}).get("runs", {}).get("accelerate")
            if cnn:
                wall = statistics.median(x["seconds"] for x in launcher) * 1000 if launcher else None
                table.add(f"warm-cell overhead ({EPOCHS}-epoch CNN cell), ms (ref: the notebook_launcher call, ms)",
                          cnn["overhead_ms"], wall, cnn["overhead_ms"] / wall if wall else None,
                          "<= 50 ms and <= 0.05", cnn["overhead_ms"] <= 50 and (wall is None or
                                                                                cnn["overhead_ms"] / wall <= 0.05),
                          digits=0, ratio_digits=4)

        if "threads" in only:
            with table.section("threads"):
                log("threads: distnb's threads per rank vs torch's default, compute-bound CNN")
                t = results["threads"] = loaded("threads", lambda: throughput.threads(
                    nb, ref.DigitsWideCNN, args.rounds, COMPUTE_EPOCHS, COMPUTE_BATCH, log=log))
                table.add(f"threads: {t['threads']}/rank x {t['world_size']} ranks on {t['cores']} cores, samples/s "
                          f"(ref: torch default, {t['default_threads']}/rank)", t["distnb"], t["reference"],
                          t["distnb"] / t["reference"], ">= 1.00 (speed-up)", t["distnb"] / t["reference"] >= 1.0,
                          digits=0)

        if "scaling" in only:
            with table.section("scaling"):
                log("scaling: compute-bound CNN, 2 ranks vs 1 rank")
                t = results["scaling"] = loaded("scaling", lambda: throughput.scaling(
                    nb, ref.DigitsWideCNN, args.rounds, COMPUTE_EPOCHS, COMPUTE_BATCH, log=log))
                table.add("scaling: 2 ranks vs 1 rank (1 thread each), samples/s; ratio = speed-up",
                          t["two"], t["one"], t["speedup"], f"report (efficiency {t['efficiency']:.2f})", None,
                          digits=0)
                table.add(f"  2 ranks vs 1 rank with {t['cores']} threads, samples/s", t["two"], t["one_all_threads"],
                          t["speedup_vs_threads"], "report", None, digits=0)
    finally:
        harness.stop_and_sweep(nb, tmp)

    if "dashboard" in only:
        out = tempfile.mktemp(prefix="distnb-bench-dashboard-", suffix=".json")
        try:
            with table.section("dashboard"):
                log("dashboard: --progress widgets vs none")
                harness.main(["--dashboard", "--rounds", str(args.rounds), "--repeats", str(args.repeats),
                              "--json", out])
                with open(out) as fh:
                    d = results["dashboard"] = json.load(fh)
                table.add("dashboard on vs off: throughput widgets / none (median of per-round ratios)",
                          "", "", d["ratio"], "overhead < 1 %", d["overhead"] < 0.01, ratio_digits=4)
        finally:
            if os.path.exists(out):
                os.unlink(out)

    total = time.perf_counter() - t_start
    print()
    print(table.render(harness.fmt_table))
    foreign = {k.split("_", 1)[1]: v for k, v in results.items() if k.startswith("throughput_")}
    if foreign:
        print("throughput rounds kept: others' CPU load up to "
              + ", ".join(f"{k} {v['foreign_cores']:.2f} cores ({v['rerun']} noisy rounds re-run)"
                          for k, v in foreign.items()))
    if section_load:
        print("others' CPU load per section (average cores used by processes not ours): "
              + ", ".join(f"{k} {v:.2f}" for k, v in section_load.items()))
    print(f"\n{machine()}; load average at start {load0}, at end {load_average()}; total {total:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), table=table.rows, results=results, machine=machine(), others_load=section_load,
                           load_start=load0, load_end=load_average()), fh, indent=1, default=str)
    return 0 if all(r[-1] in ("PASS", "info") for r in table.rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
