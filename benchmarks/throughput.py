"""Targets 2, 6 and 7: training throughput against torchrun, thread settings, and scaling.

- :func:`against_torchrun`: warm ``%%distrain`` cells against ``torchrun_digits.py`` under
  ``torchrun --nproc-per-node 2`` (see ``run.py``: same model, shards, order, optimizer,
  threads; the torchrun command times ``repeats`` runs after its own warm-up), alternated
  round by round. Ratio = median distnb samples/s / median torchrun samples/s.
- :func:`threads`: the same warm cell with distnb's thread setting (each rank
  ``cores // ranks`` intra-op threads, so their sum is the core count) against torch's
  default in a process (every rank as many threads as cores), set on the live ranks
  between cells, alternated.
- :func:`scaling`: a compute-bound model on 2 ranks against 1 rank (a second, 1-engine
  distnb cluster beside the first; the same per-rank batch), alternated; speed-up =
  samples/s of 2 ranks / samples/s of 1 rank, efficiency = speed-up / 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


def _args(model, epochs, repeats, batch_size=64, lr=1e-3, warmup_epochs=2):
    return argparse.Namespace(model=model, epochs=epochs, repeats=repeats, batch_size=batch_size, lr=lr,
                              warmup_epochs=warmup_epochs)


def use_model(nb, model_cls) -> None:
    """Make the notebook's ``net`` a fresh instance of ``model_cls`` (its class defined in a cell)."""
    import inspect

    nb.cell(inspect.getsource(model_cls), quiet=True)
    nb.cell(f"torch.manual_seed(0)\nnet = {model_cls.__name__}()", quiet=True)


def against_torchrun(nb, harness, model: str, rounds: int, repeats: int, epochs: int, log=print,
                     max_foreign: float = 0.1, retries: int = 4) -> dict:
    """distnb vs torchrun for ``model`` ("cnn", "mlp5m"): ``rounds`` rounds of ``repeats`` runs a side.

    A round during which other processes used more than ``max_foreign`` cores (on this shared
    machine: someone else's test run) is run again, at most ``retries`` times in all, and left out.
    """
    import torchrun_digits as ref

    args = _args(model, epochs, repeats)
    use_model(nb, ref.MODELS[model])
    nb.cell(harness.distrain_line(model, args.warmup_epochs, args) + "\n" + BODY, quiet=True)  # send, DDP, optimizer
    rounds_out = []
    k = 0
    while sum(r["kept"] for r in rounds_out) < rounds:
        next_epoch = nb.ns["r"].epochs[-1] + 1
        for side in (("a", "b") if k % 2 == 0 else ("b", "a")):
            if side == "a":
                a = [harness.run_distnb(nb, args) for _ in range(repeats)]
            else:
                cmd = harness.run_torchrun(args, next_epoch)
        b = cmd["runs"]
        med = statistics.median
        foreign = max(x["foreign_cores"] for x in a + b)
        rerun = foreign > max_foreign and retries > 0
        retries -= rerun
        rnd = dict(a=a, b=b, ratio=med(x["samples_per_s"] for x in a) / med(x["samples_per_s"] for x in b),
                   foreign_cores=foreign, command_seconds=cmd["command_seconds"], kept=not rerun)
        rounds_out.append(rnd)
        log(f"  {model} round {k + 1}: distnb " + " ".join(f"{x['samples_per_s']:.0f}" for x in a)
            + " samples/s; torchrun " + " ".join(f"{x['samples_per_s']:.0f}" for x in b)
            + f"; ratio {rnd['ratio']:.3f}; others' load up to {foreign:.2f} cores"
            + ("; re-run" if rerun else "; noisy, kept (no re-runs left)" if foreign > max_foreign else ""))
        k += 1
    kept = [r for r in rounds_out if r["kept"]]
    A = [x for r in kept for x in r["a"]]
    B = [x for r in kept for x in r["b"]]
    med = statistics.median
    return dict(distnb=med(x["samples_per_s"] for x in A), reference=med(x["samples_per_s"] for x in B),
                ratio_of_medians=med(x["samples_per_s"] for x in A) / med(x["samples_per_s"] for x in B),
                median_round_ratio=med(r["ratio"] for r in kept), rerun=len(rounds_out) - len(kept),
                overhead_ms=1000 * med(x["overhead_seconds"] for x in A),
                wall_seconds=med(x["wall_seconds"] for x in A),
                train_seconds=med(x["train_seconds"] for x in A), ref_train_seconds=med(x["train_seconds"] for x in B),
                foreign_cores=max(r["foreign_cores"] for r in kept), rounds=rounds_out)


def torch_default_threads() -> int:
    """What ``torch.get_num_threads()`` is in a fresh process without OMP_NUM_THREADS (torch's default)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.strip())


def _cell(nb, epochs, batch_size, session=None) -> dict:
    if session is None:
        nb.cell(f"%%distrain --model net --data train --epochs {epochs} --batch-size {batch_size} --optimizer adam "
                f"--lr 1e-3 --progress none -o r\n{BODY}", quiet=True)
        r = nb.ns["r"]
    else:
        r = session.train(BODY, model="net", data="train", epochs=epochs, batch_size=batch_size, optimizer="adam",
                          lr=1e-3, progress="none", quiet=True)
    return dict(samples_per_s=r.samples_per_s, train_seconds=r.train_seconds)


def _set_threads(nb, n: int) -> None:
    nb.cell(f"%%dist\nimport torch\ntorch.set_num_threads({n})", quiet=True)


def threads(nb, model_cls, rounds: int, epochs: int, batch_size: int, log=print) -> dict:
    """distnb's thread setting against torch's default, on the live 2-rank cluster."""
    from distnb import session as sessions

    s = sessions.current()
    ours = s.cluster.ranks[0]["num_threads"]
    default = torch_default_threads()
    use_model(nb, model_cls)
    _cell(nb, 1, batch_size)  # warm-up: model, shards, DDP
    runs = {"distnb": [], "default": []}
    try:
        for k in range(rounds):
            for side in (("distnb", "default") if k % 2 == 0 else ("default", "distnb")):
                _set_threads(nb, ours if side == "distnb" else default)
                runs[side].append(_cell(nb, epochs, batch_size))
            log(f"  threads round {k + 1}: {ours}/rank {runs['distnb'][-1]['samples_per_s']:.0f} samples/s; "
                f"{default}/rank (torch default) {runs['default'][-1]['samples_per_s']:.0f} samples/s")
    finally:
        _set_threads(nb, ours)
    med = statistics.median
    return dict(distnb=med(x["samples_per_s"] for x in runs["distnb"]),
                reference=med(x["samples_per_s"] for x in runs["default"]), threads=ours, default_threads=default,
                world_size=s.world_size, cores=os.cpu_count(), runs=runs)


def scaling(nb, model_cls, rounds: int, epochs: int, batch_size: int, log=print) -> dict:
    """2 ranks (the live cluster) against 1 rank (1 and then all cores' threads) on a compute-bound model."""
    from distnb import session as sessions
    from distnb.cluster.cluster import Cluster
    from distnb.cluster.defaults import default_spec
    from distnb.session import Session

    two = sessions.current()
    use_model(nb, model_cls)
    one = Session(Cluster(default_spec(n=1)).start(), ns=nb.ns)
    cores = one.cluster.ranks[0]["num_threads"]
    runs = {"2 ranks": [], "1 rank": [], f"1 rank, {cores} threads": []}
    try:
        _cell(nb, 1, batch_size)
        _cell(nb, 1, batch_size, session=one)
        for k in range(rounds):
            order = list(runs) if k % 2 == 0 else list(reversed(runs))
            for side in order:
                if side == "2 ranks":
                    runs[side].append(_cell(nb, epochs, batch_size))
                else:
                    one.run(f"import torch\ntorch.set_num_threads({1 if side == '1 rank' else cores})")
                    runs[side].append(_cell(nb, epochs, batch_size, session=one))
            log(f"  scaling round {k + 1}: " + "; ".join(f"{side} {v[-1]['samples_per_s']:.0f} samples/s"
                                                         for side, v in runs.items()))
    finally:
        one.stop(quiet=True)
    med = statistics.median
    fig = {side: med(x["samples_per_s"] for x in v) for side, v in runs.items()}
    two_r, one_r = fig["2 ranks"], fig["1 rank"]
    return dict(two=two_r, one=one_r, one_all_threads=fig[f"1 rank, {cores} threads"], cores=cores,
                speedup=two_r / one_r, efficiency=two_r / one_r / 2,
                speedup_vs_threads=two_r / fig[f"1 rank, {cores} threads"], runs=runs,
                two_world=two.world_size)
