"""distnb against torchrun on character-level transformers: every strategy, compile and bf16 (issue 17, 1 and 6).

For each case (model size, strategy, precision, compile) it alternates, round by round:

(a) distnb on 2 warm CPU engines in a real IPython ``InteractiveShell`` (``%load_ext distnb``,
    ``%dist start -n 2``): ``%%distrain --strategy S`` cells, or for ``dist-ddp`` (``dist-fsdp``) the
    reference's hand-written DDP (FSDP2) loop in a ``%%dist`` cell (``torchrun_transformer.Trainer``
    built once on the engines): the engines as processes, without distnb's loop;
    a first, untimed cell sends the model and data and builds the strategy and optimizer;
(b) ``benchmarks/torchrun_transformer.py`` under ``torchrun --standalone --nproc-per-node 2``:
    the same model, seeds, shards, batch order, AdamW, one thread per rank and the same torch
    APIs, written by hand; one command per round (its start-up and warm-up epoch untimed).

Figure per case: training time, the slowest rank's first step to the end of its last epoch
(seconds), median over all runs; ratio = torchrun time / distnb time (> 1: distnb faster).
Beside it, the CPU seconds the ranks' processes used in that time (``time.process_time``,
all threads, summed over the ranks; distnb's ``TrainResult.rows[i]["cpu_seconds"]``) and
the CPU ratio = torchrun CPU s / distnb CPU s: the work each side did, which other processes
on a shared machine disturb far less than the wall time (a rank descheduled for a second
adds a second of wall time and no CPU time).
Targets (issue 17): ddp >= 1.00, fsdp >= 0.95, tensor and pipeline >= 0.90, the ``%%dist``
loops >= 0.95. A figure is *decided* when a sign test over its rounds puts it on one side of its
target at 5 % (at least 6 rounds; ``benchmarks/verdicts.py``), else *within noise*.
Losses: the warm-up cell's per-epoch mean losses against the reference's warm-up epochs (both
from the same seed-0 model and epoch 0).

Every run also records the CPU other processes used meanwhile (cores); on a shared machine
a round where that exceeds ``--max-foreign`` is re-run, at most ``--retries`` times.

On GPUs (``--device cuda``): distnb's side is ``%dist start`` (distnb picks one engine per GPU and
nccl; checked before the first case; ``--ranks N`` below the GPUs visible adds ``-n N``), its
``%%distrain`` moves the model and each batch to the rank's GPU itself; the reference runs
``torchrun --nproc-per-node N`` with ``--device cuda`` (nccl, ``cuda:LOCAL_RANK``). ``--cpu-bind``
is a CPU option only. ``tests/gpu/device_run.sh`` runs the ddp and fsdp rows this way on a lent GPU.

Usage::

    .venv/bin/python benchmarks/char_transformers.py [--sizes small,large] [--cases ddp,fsdp,tensor,pipeline,
        dist-ddp,dist-fsdp,ddp-bf16,ddp-compile] [--rounds 3] [--epochs 1] [--json PATH]
        [--device cpu|cuda] [--ranks N]
    .venv/bin/python benchmarks/run.py --transformers ...   # the same
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from verdicts import median_interval, verdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGETS = {"ddp": 1.00, "fsdp": 0.95, "tensor": 0.90, "pipeline": 0.90, "dist-ddp": 0.95, "dist-fsdp": 0.95}
CASES = ("ddp", "fsdp", "tensor", "pipeline", "dist-ddp", "dist-fsdp", "ddp-bf16", "ddp-compile")
BODY = "x, y = batch\nloss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())"


def parse_case(case: str) -> dict:
    """``"ddp-bf16"`` -> strategy ddp, precision bf16, compile False (``dist-ddp``, ``dist-fsdp`` are strategies)."""
    strategy, _, flag = case.partition("-") if not case.startswith("dist-") else (case, "", "")
    return dict(strategy=strategy, precision="bf16" if flag == "bf16" else "fp32", compile=flag == "compile")


def start_line(device: str = "cpu", ranks: int = 2, cpu_bind: str = "auto", gpus: int = 0) -> str:
    """``%dist start``: ``-n ranks`` and ``--cpu-bind`` on cpu; on cuda distnb's own pick (one engine per GPU,
    nccl), with ``-n`` only when ``ranks`` is fewer than the ``gpus`` visible."""
    # a shared machine can hold a rank back for many seconds: no hang verdict or gloo timeout may end a round
    if device == "cpu":
        return f"%dist start -n {ranks} --timeout 600 --hang-after 300 --cpu-bind {cpu_bind}"
    return "%dist start --timeout 600 --hang-after 300" + ("" if ranks == gpus else f" -n {ranks}")


def check_started(device: str, ranks: int) -> str:
    """What ``%dist start`` started, as one line; RuntimeError unless it is ``ranks`` engines of the
    expected backend (nccl on cuda, gloo on cpu) on ``device``."""
    from distnb import session

    spec = session.current().cluster.spec
    got = (spec.num_engines, spec.backend, spec.device_type)
    want = (ranks, "nccl" if device == "cuda" else "gloo", device)
    if got != want:
        raise RuntimeError(f"%dist start started {got[0]} engines, {got[1]} on {got[2]}; expected {want}")
    return f"distnb started {got[0]} engines, {got[1]} on {got[2]}"


def prepare(nb, ref, cpu_bind: str = "auto", device: str = "cpu", ranks: int = 2, gpus: int = 0) -> None:
    """Cells run once: load distnb, the ranks, the model classes (the reference's source), the text windows."""
    nb.cell("%load_ext distnb")
    nb.cell(start_line(device, ranks, cpu_bind, gpus))
    if device != "cpu":  # on CPU -n and gloo are given: nothing of distnb's choosing to check
        print(check_started(device, ranks), flush=True)
    nb.cell("import torch, torch.nn as nn, torch.nn.functional as F")
    nb.cell(inspect.getsource(ref.Block))
    nb.cell(inspect.getsource(ref.CharGPT))
    nb.cell(f"import sys\nsys.path.insert(0, {HERE!r})\nimport torchrun_transformer as ref\n"
            "data = {}\nfor size, cfg in ref.SIZES.items():\n"
            "    X, Y, vocab = ref.load_text(cfg['block'])\n"
            "    data[size] = torch.utils.data.TensorDataset(X, Y)\n")


def distrain_line(name, size, epochs, case, ref) -> str:
    c = parse_case(case)
    extra = ""
    if c["strategy"] == "pipeline":
        extra = f" --split blocks.{ref.SIZES[size]['layers'] // 2} --microbatches 2"
    if c["precision"] != "fp32":
        extra += f" --precision {c['precision']}"
    if c["compile"]:
        extra += " --compile"
    return (f"%%distrain --model {name} --data train_{size} --epochs {epochs} --batch-size {ref.BATCH_SIZE} "
            f"--optimizer adamw --lr {ref.LR} --drop-last --strategy {c['strategy']}{extra} --progress none -o r")


class DistnbSide:
    """One case on the warm engines: :meth:`warm` (untimed, returns its epoch losses), :meth:`run` (timed)."""

    def __init__(self, nb, harness, ref, size, case, device="cpu"):
        self.nb, self.harness, self.ref, self.size, self.case = nb, harness, ref, size, case
        self.device = device
        self.name = f"net_{size}_{case.replace('-', '_')}"
        self.epoch = 0

    def warm(self, epochs: int) -> list:
        nb, size = self.nb, self.size
        nb.cell(f"train_{size} = data[{size!r}]", quiet=True)
        if self.case.startswith("dist-"):
            nb.cell(f"%%dist\nimport sys\nsys.path.insert(0, {HERE!r})\nimport torchrun_transformer as ref\n"
                    f"trainer = ref.Trainer({self.case!r}, {size!r}"
                    f"{'' if self.device == 'cpu' else ', device=device'})\n"
                    f"warm_losses = [trainer.epoch(e)[2] for e in range({epochs})]", quiet=True)
            self.epoch = epochs
            return self.nb_pull("warm_losses")[0]
        nb.cell(f"torch.manual_seed(0)\n{self.name} = CharGPT(vocab, **ref.SIZES[{size!r}])", quiet=True)
        nb.cell(distrain_line(self.name, size, epochs, self.case, self.ref) + "\n" + BODY, quiet=True)
        self.epoch = epochs
        return list(nb.ns["r"].epoch_losses)

    def nb_pull(self, name):
        from distnb import session

        return session.current().pull(name)

    def run(self, epochs: int) -> dict:
        harness = self.harness
        with harness.ForeignCpu() as foreign:
            if self.case.startswith("dist-"):
                self.nb.cell(f"%%dist\nimport torch\nbench_out = ref.timed_run(trainer, {self.epoch}, {epochs})\n"
                             "bench_out['threads'] = torch.get_num_threads()", quiet=True)
                out = self.nb_pull("bench_out")[0]
                fig = dict(train_seconds=out["train_seconds"], epoch_losses=out["epoch_losses"],
                           threads=out["threads"], cpu_utilisation=out["cpu_utilisation"],
                           cpu_seconds=sum(row["cpu_seconds"] for row in out["rows"]))
            else:
                self.nb.cell(distrain_line(self.name, self.size, epochs, self.case, self.ref) + "\n" + BODY,
                             quiet=True)
                r = self.nb.ns["r"]
                fig = dict(train_seconds=r.train_seconds, epoch_losses=list(r.epoch_losses),
                           overhead_seconds=r.overhead_seconds,
                           cpu_seconds=sum(row["cpu_seconds"] for row in r.rows))
        self.epoch += epochs
        fig["foreign_cores"] = foreign.cores
        return fig


def torchrun_command(size, case, epochs, first_epoch, warmup_epochs, device="cpu", ranks=2) -> list:
    """The reference's torchrun command line (on cpu the same as before ``--device`` existed)."""
    c = parse_case(case)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           os.path.join(HERE, "torchrun_transformer.py"), "--size", size, "--strategy", c["strategy"],
           "--epochs", str(epochs), "--first-epoch", str(first_epoch), "--warmup-epochs", str(warmup_epochs),
           "--precision", c["precision"]] + (["--compile"] if c["compile"] else [])
    return cmd if device == "cpu" else cmd + ["--device", device]


def run_torchrun(size, case, epochs, first_epoch, warmup_epochs, timeout=900.0, device="cpu", ranks=2) -> dict:
    """One torchrun command of the reference; its JSON (rank 0) plus the command's wall time."""
    cmd = torchrun_command(size, case, epochs, first_epoch, warmup_epochs, device, ranks)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: our own session
        proc.communicate()
        raise RuntimeError(f"torchrun reference timed out after {timeout:.0f} s") from None
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"torchrun reference failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
    res = json.loads(lines[-1])
    res["command_seconds"] = time.perf_counter() - t0
    return res


def measure_case(nb, harness, ref, size, case, args, log=print) -> dict:
    """Warm-up, the loss check, then ``args.rounds`` alternated rounds (re-runs for others' load)."""
    side = DistnbSide(nb, harness, ref, size, case, args.device)
    warm = side.warm(args.warmup_epochs)
    rounds, retries, k = [], args.retries, 0
    ref_warm = None
    while sum(r["kept"] for r in rounds) < args.rounds:
        order = ("a", "b") if k % 2 == 0 else ("b", "a")
        e0 = side.epoch  # both sides time epoch e0 on (same shuffles); the reference warms up to it
        for which in order:
            if which == "a":
                a = side.run(args.epochs)
            else:
                b_cmd = run_torchrun(size, case, args.epochs, e0, args.warmup_epochs, device=args.device,
                                     ranks=args.ranks)
        b = b_cmd["runs"][0]
        b["cpu_seconds"] = sum(row["cpu_seconds"] for row in b["rows"])
        if ref_warm is None and e0 == args.warmup_epochs:  # its warm-up = distnb's warm-up cell, from epoch 0
            ref_warm = b_cmd["warmup_losses"]
        foreign = max(a["foreign_cores"], b["foreign_cores"])
        rerun = foreign > args.max_foreign and retries > 0
        retries -= rerun
        rnd = dict(a=a, b=b, first="distnb" if order[0] == "a" else "torchrun", foreign_cores=foreign,
                   ratio=b["train_seconds"] / a["train_seconds"], cpu_ratio=b["cpu_seconds"] / a["cpu_seconds"],
                   kept=not rerun,
                   command_seconds=b_cmd["command_seconds"])
        rounds.append(rnd)
        log(f"  {size} {case} round {k + 1} ({rnd['first']} first): distnb {a['train_seconds']:.2f} s, torchrun "
            f"{b['train_seconds']:.2f} s, ratio {rnd['ratio']:.3f}; CPU s (ranks summed) distnb {a['cpu_seconds']:.2f}, "
            f"torchrun {b['cpu_seconds']:.2f}, CPU ratio {rnd['cpu_ratio']:.3f}; others' load up to {foreign:.2f} cores"
            + ("; re-run" if rerun else ""))
        k += 1
    kept = [r for r in rounds if r["kept"]]
    med = statistics.median
    ta, tb = med(r["a"]["train_seconds"] for r in kept), med(r["b"]["train_seconds"] for r in kept)
    ratios = [r["ratio"] for r in kept]
    cpu_a, cpu_b = med(r["a"]["cpu_seconds"] for r in kept), med(r["b"]["cpu_seconds"] for r in kept)
    cpu_ratios = [r["cpu_ratio"] for r in kept]
    target = TARGETS.get(case)
    loss_diff = (max(abs(x - y) for x, y in zip(warm, ref_warm)) if ref_warm else None)
    return dict(size=size, case=case, distnb_s=ta, torchrun_s=tb, ratio=tb / ta, round_ratios=ratios,
                target=target, verdict=verdict(ratios, target), distnb_cpu_s=cpu_a, torchrun_cpu_s=cpu_b,
                cpu_ratio=cpu_b / cpu_a, cpu_round_ratios=cpu_ratios, cpu_verdict=verdict(cpu_ratios, target), warm_losses=warm, ref_warm_losses=ref_warm,
                loss_diff=loss_diff, foreign_cores=max(r["foreign_cores"] for r in kept),
                rerun=len(rounds) - len(kept), rounds=rounds)


def speedups(results) -> list:
    """Rows of --compile / --precision bf16 speed-up vs eager fp32 ddp, distnb and torchrun side by side."""
    by = {(r["size"], r["case"]): r for r in results}
    rows = []
    for (size, case), r in by.items():
        base = by.get((size, "ddp"))
        if case in ("ddp-bf16", "ddp-compile") and base:
            rows.append((size, case.split("-")[1], f"{base['distnb_s'] / r['distnb_s']:.2f}x",
                         f"{base['torchrun_s'] / r['torchrun_s']:.2f}x"))
    return rows


def report(results, harness, load0, load1) -> None:
    rows = []
    for r in results:
        target = r["target"]
        ok = "" if target is None else ("PASS" if r["ratio"] >= target else "FAIL")
        lo, hi, _ = median_interval(r["round_ratios"])
        spread = f"{min(r['round_ratios']):.3f}-{max(r['round_ratios']):.3f} (median in {lo:.3f}-{hi:.3f})"
        cpu_spread = f"{min(r['cpu_round_ratios']):.3f}-{max(r['cpu_round_ratios']):.3f}"
        rows.append((r["size"], r["case"], f"{r['distnb_s']:.3f}", f"{r['torchrun_s']:.3f}", f"{r['ratio']:.3f}",
                     spread, "-" if target is None else f">= {target:.2f}", ok, r["verdict"],
                     f"{r['cpu_ratio']:.3f}", cpu_spread, r["cpu_verdict"],
                     "n/a" if r["loss_diff"] is None else f"{r['loss_diff']:.1e}", f"{r['foreign_cores']:.2f}"))
    print()
    print(harness.fmt_table(("model", "case", "distnb train s", "torchrun train s", "ratio (torchrun/distnb)",
                             "round ratios", "target", "pass/fail", "noise", "CPU ratio", "CPU round ratios",
                             "CPU noise", "max |loss diff|",
                             "others' load, cores"), rows))
    sp = speedups(results)
    if sp:
        print()
        print(harness.fmt_table(("model", "flag", "distnb speed-up vs eager fp32", "torchrun speed-up"), sp))
    print(f"\nload average before {load0}, after {load1}")


def check_device_args(p, args) -> int:
    """Fill ``args.ranks`` and ``args.cpu_bind`` for ``args.device``; returns the GPUs visible (0 on cpu)."""
    gpus = 0
    if args.device == "cuda":
        from distnb.core.net import visible_gpus  # counts without initialising CUDA in this kernel

        gpus = len(visible_gpus())
        if not gpus:
            p.error("--device cuda: no GPU visible")
        if args.cpu_bind is not None:
            p.error("--cpu-bind is a CPU option (--device cpu)")
    args.ranks = args.ranks if args.ranks is not None else (gpus or 2)
    args.cpu_bind = args.cpu_bind or "auto"
    if args.ranks < 1 or (gpus and args.ranks > gpus):
        p.error(f"--ranks {args.ranks}: at least 1" + (f", at most the {gpus} GPUs visible" if gpus else ""))
    return gpus


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,large", help="comma-separated: small, large (default both)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)} (default all; "
                   "bf16/compile rows only for the small model unless --sizes says otherwise)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per case (default 3)")
    p.add_argument("--epochs", type=int, default=1, help="epochs per timed run (default 1)")
    p.add_argument("--warmup-epochs", type=int, default=1, help="untimed epochs first, both sides (default 1)")
    p.add_argument("--max-foreign", type=float, default=0.1, help="re-run a round in which other processes used "
                   "more than this many cores on average (default 0.1)")
    p.add_argument("--retries", type=int, default=0, help="at most this many re-run rounds per case (default 0)")
    p.add_argument("--json", default=None, help="also write every measurement to this file")
    p.add_argument("--cpu-bind", choices=("auto", "cores", "none"), default=None,
                   help="distnb's %%dist start --cpu-bind (default auto, distnb's default; torchrun: unbound); "
                   "cpu only")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo (default); cuda: nccl, one engine (and torchrun rank) per GPU")
    p.add_argument("--ranks", type=int, default=None,
                   help="ranks on each side (default 2 on cpu; on cuda the GPUs visible, which may be 1)")
    args = p.parse_args(argv)
    gpus = check_device_args(p, args)
    sizes = [s for s in args.sizes.split(",") if s]
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES] + [s for s in sizes if s not in ("small", "large")]
    if bad or args.rounds < 1 or args.epochs < 1 or args.warmup_epochs < 1:
        p.error(f"unknown {bad}" if bad else "--rounds, --epochs and --warmup-epochs must be at least 1")
    sys.path.insert(0, HERE)
    import run as harness  # the notebook shell, foreign-CPU meter, tables, clean-up
    import torchrun_transformer as ref

    tmp = harness.isolate_dirs()
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"distnb vs torchrun, char-level transformers {sizes}, cases {cases}; {args.rounds} rounds x "
          f"{args.epochs} epochs, batch {ref.BATCH_SIZE}/rank, AdamW, {args.ranks} ranks "
          f"{'gloo' if args.device == 'cpu' else 'nccl on cuda'}; load average {load0}", flush=True)
    nb = harness.Notebook()
    results = []
    try:
        prepare(nb, ref, args.cpu_bind, args.device, args.ranks, gpus)
        nb.cell("vocab = ref.load_text(32)[2]", quiet=True)
        for size in sizes:
            for case in cases:
                if case in ("ddp-bf16", "ddp-compile") and size != "small" and "small" in sizes:
                    continue
                results.append(measure_case(nb, harness, ref, size, case, args,
                                            log=lambda m: print(m, flush=True)))
    finally:
        harness.stop_and_sweep(nb, tmp)
    report(results, harness, load0, " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
    return 0 if all(r["target"] is None or r["ratio"] >= r["target"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
