"""Many real ranks on one machine (issue 20): how each figure grows with the number of ranks.

A real IPython shell runs, for each world size in ``--sizes`` (default 2, 8, 16, 32; the order
flips every round, ``--rounds`` rounds), the cells a user would:

- ``%dist start -n N`` (engines forked from the engine template), its wall time in the kernel;
- a ``%%dist`` cell that does nothing, the median of ``--empty`` round trips in the kernel;
- a warm ``%%distrain`` cell on the digits MLP (2 epochs, batch 16 per rank), its overhead
  (``TrainResult.overhead_seconds``: the cell's wall time minus the slowest rank's training), the median
  of two after one untimed cell;
- a ``%%distrain`` cell in which rank N // 2 raises at step 3: seconds from its ``raise`` (the rank's
  clock, written to a file) to the end of the cell in the kernel (the RankError naming it);
- the memory of the engines after training (``/proc/PID/smaps_rollup``): USS (private memory, what one
  more engine adds) and PSS (shared pages divided among the processes that map them), in MiB;
- ``%dist stop``, its wall time.

``--fresh N`` also starts N engines as fresh processes (``DISTNB_ZYGOTE=0``) once, for their memory.
``--fanout`` measures, at the largest size, a no-op sent to every engine one apply per engine (as distnb
sends) against ipyparallel's broadcast view. The load average is printed with each figure (the machine is
shared). ``--plot PATH`` draws the figures against N (matplotlib, the ``bench`` extra).

Usage::

    .venv/bin/python benchmarks/ranks.py [--sizes 2,8,16,32] [--rounds 1] [--fresh 8] [--fanout]
        [--json PATH] [--plot benchmarks/ranks.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MLP = ("class MLP(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
       "        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))\n"
       "    def forward(self, x):\n        return self.net(x)\n")
TRAIN = "%%distrain --model net --data train --epochs 2 --batch-size 16 --progress none -o r\n" \
        "x, y = batch\nloss = F.cross_entropy(model(x), y)"
FAIL = ("%%distrain --model net --data train --epochs 2 --batch-size 16 --progress none\n"
        "x, y = batch\nif rank == {bad} and ctx.step == 3:\n"
        "    open({path!r}, 'w').write(repr(time.time()))\n    raise ValueError('a bad batch')\n"
        "loss = F.cross_entropy(model(x), y)")
FIGURES = ("start_s", "empty_ms", "overhead_s", "fail_named_s", "stop_s", "uss_mib", "pss_mib")


def load() -> float:
    return os.getloadavg()[0]


def memory(pids) -> dict:
    """Mean USS and PSS (MiB) of ``pids`` from /proc/PID/smaps_rollup."""
    uss, pss = [], []
    for pid in pids:
        fields = {}
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    fields[parts[0][:-1]] = int(parts[1])  # kB
        uss.append((fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)) / 1024)
        pss.append(fields.get("Pss", 0) / 1024)
    return dict(uss_mib=statistics.mean(uss), pss_mib=statistics.mean(pss))


def timed(nb, source) -> float:
    t0 = time.perf_counter()
    nb.cell(source, quiet=True)
    return time.perf_counter() - t0


def one_size(nb, n: int, empty: int, fanout: bool) -> dict:
    """Every figure at world size ``n`` (a cluster started and stopped here)."""
    from distnb import session

    out = dict(n=n, load=load(), start_s=timed(nb, f"%dist start -n {n}"))
    nb.cell("%%dist\nimport time, torch", quiet=True)
    out["empty_ms"] = 1000 * statistics.median(timed(nb, "%%dist\npass") for _ in range(empty))
    nb.cell(TRAIN, quiet=True)  # sends the model and the shards
    overheads = []
    for _ in range(2):
        nb.cell(TRAIN, quiet=True)
        overheads.append(nb.ns["r"].overhead_seconds)
    out["overhead_s"] = statistics.median(overheads)
    out.update(memory([r["pid"] for r in session.current().cluster.ranks]))
    mark = tempfile.mktemp(prefix="distnb-raise-")
    try:
        nb.cell(FAIL.format(bad=n // 2, path=mark), quiet=True)
        raise AssertionError("the failing cell did not fail")
    except RuntimeError as exc:  # Notebook.cell: the cell's RankError
        ended = time.time()
        assert f"rank {n // 2}" in str(exc), exc
    with open(mark) as f:
        out["fail_named_s"] = ended - float(f.read())
    os.remove(mark)
    if fanout:
        out.update(fan_out(session.current().cluster))
    out["load_end"] = load()
    out["stop_s"] = timed(nb, "%dist stop")
    return out


def fan_out(cluster, rounds: int = 9) -> dict:
    """Median ms of a no-op on every engine: one apply per engine (distnb) vs ipyparallel's broadcast view."""
    client, ids = cluster.client, list(cluster.engine_ids)
    noop = lambda: None  # noqa: E731
    direct, broadcast = [], []
    view = client.broadcast_view(targets=ids)
    for k in range(rounds):
        for side in (("direct", "broadcast") if k % 2 == 0 else ("broadcast", "direct")):
            t0 = time.perf_counter()
            if side == "direct":
                for ar in [client[e].apply_async(noop) for e in ids]:
                    ar.get(60)
                direct.append(time.perf_counter() - t0)
            else:
                view.apply_async(noop).get(60)
                broadcast.append(time.perf_counter() - t0)
    return dict(fanout_direct_ms=1000 * statistics.median(direct),
                fanout_broadcast_ms=1000 * statistics.median(broadcast))


def fresh_memory(nb, n: int) -> dict:
    """USS/PSS of ``n`` engines started as fresh processes (no template), after the same training."""
    from distnb import session

    os.environ["DISTNB_ZYGOTE"] = "0"
    try:
        start = timed(nb, f"%dist start -n {n}")
        nb.cell(TRAIN, quiet=True)
        nb.cell(TRAIN, quiet=True)
        mem = memory([r["pid"] for r in session.current().cluster.ranks])
        nb.cell("%dist stop", quiet=True)
    finally:
        os.environ.pop("DISTNB_ZYGOTE", None)
    return dict(n=n, start_s=start, load=load(), **mem)


def table(rows) -> str:
    lines = ["| ranks | `%dist start` | empty `%%dist` | warm `%%distrain` overhead | failing rank named | "
             "`%dist stop` | USS / engine | PSS / engine | load (1 min) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['start_s']:.2f} s | {r['empty_ms']:.0f} ms | {r['overhead_s']:.2f} s | "
                     f"{r['fail_named_s']:.2f} s | {r['stop_s']:.2f} s | {r['uss_mib']:.0f} MiB | "
                     f"{r['pss_mib']:.0f} MiB | {r['load']:.1f}-{r['load_end']:.1f} |")
    return "\n".join(lines)


def medians(runs) -> list:
    by_n = {}
    for r in runs:
        by_n.setdefault(r["n"], []).append(r)
    return [dict({k: statistics.median(x[k] for x in rs) for k in (*FIGURES, "load", "load_end")}, n=n)
            for n, rs in sorted(by_n.items())]


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in rows]
    panels = [("start_s", "%dist start (s)", 10), ("empty_ms", "empty %%dist (ms)", 100),
              ("overhead_s", "warm %%distrain overhead (s)", 0.5), ("fail_named_s", "failing rank named (s)", 5),
              ("stop_s", "%dist stop (s)", 5), ("uss_mib", "USS per engine (MiB)", None)]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, (key, title, target) in zip(axes.flat, panels):
        ax.plot(ns, [r[key] for r in rows], "o-")
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target at 32: {target}")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ranks")
        ax.set_xticks(ns)
        ax.set_ylim(bottom=0)
    fig.suptitle("distnb: real CPU ranks on one 2-core machine (benchmarks/ranks.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2,8,16,32")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--empty", type=int, default=5, help="empty %%dist cells per size (median)")
    p.add_argument("--fresh", type=int, default=0, help="also start this many fresh engines once, for memory")
    p.add_argument("--fanout", action="store_true", help="direct vs broadcast view fan-out, at each size")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    sys.path.insert(0, HERE)
    import run as harness  # noqa: E402  the notebook shell and the clean-up

    tmp = harness.isolate_dirs()
    nb = harness.Notebook()
    runs, fresh = [], None
    try:
        nb.cell("%load_ext distnb")
        nb.cell("import time, torch, torch.nn as nn, torch.nn.functional as F\n"
                "from sklearn.datasets import load_digits\nX, y = load_digits(return_X_y=True)\n"
                "train = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))\n"
                + MLP + "torch.manual_seed(0)\nnet = MLP()")
        from distnb.cluster import zygote

        zygote.get().ready(60)
        for k in range(args.rounds):
            for n in (sizes if k % 2 == 0 else list(reversed(sizes))):
                runs.append(one_size(nb, n, args.empty, args.fanout))
                print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in runs[-1].items()}),
                      flush=True)
        if args.fresh:
            fresh = fresh_memory(nb, args.fresh)
            print("fresh engines:", json.dumps(fresh), flush=True)
    finally:
        harness.stop_and_sweep(nb, tmp)
    rows = medians(runs)
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(runs=runs, rows=rows, fresh=fresh), f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
