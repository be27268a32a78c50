"""Target 3 (cold start) and the launcher reference of targets 1 and 3.

(a) ``%dist start -n 2`` until it returns: engines registered, the gloo process group
formed, torch (and DDP) imported on the ranks. Reference, measured in the same run: a plain
``ipyparallel.Cluster(n=2)`` with its defaults (``start_and_connect_sync``), then a naive
process group: ``import torch`` and ``init_process_group("gloo", "tcp://...")`` applied to
each engine. Target: distnb <= 0.4 x reference.

(b) A cold ``%dist start`` plus the first ``%%distrain`` cell (model and shards sent, DDP
built, the training, the weights back) against Accelerate's ``notebook_launcher`` running
the same training (``accel_digits.py``), each from a notebook with the data and the model
class defined (and, for distnb, ``%load_ext distnb`` run earlier: its engine template has
imported torch, as the launcher's kernel has). Target: distnb faster (ratio < 1). Also
measured in the same rounds: ``%load_ext`` inside the timed cell (the template still
importing), and no template at all (``DISTNB_ZYGOTE=0``, fresh engine processes).

Rounds alternate which side goes first; each distnb round starts and stops its own cluster.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import statistics
import time

_quiet = logging.getLogger("distnb.bench.ipyparallel")
_quiet.setLevel(logging.CRITICAL)
_quiet.propagate = False


def distnb_start(nb) -> float:
    t0 = time.perf_counter()
    nb.cell("%dist start -n 2", quiet=True)
    return time.perf_counter() - t0


def distnb_stop(nb) -> None:
    nb.cell("%dist stop", quiet=True)


NAIVE_GROUP = """
import os, torch, torch.distributed as dist
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank={rank}, world_size={world_size})
"""
LEAVE = """
import os, torch.distributed as dist
if dist.is_initialized():
    dist.destroy_process_group()
os._exit(0)  # FIELD-NOTES pitfall 1: gloo processes may abort at a normal exit
"""


def ipyparallel_reference() -> dict:
    """A default ipyparallel cluster of 2 engines plus a naive gloo group; seconds of each part."""
    import ipyparallel as ipp

    from distnb.cluster.cluster import free_port

    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=2, log=_quiet)
    client = None
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
            client = cluster.start_and_connect_sync()
        t_cluster = time.perf_counter() - t0
        port = free_port()
        ids = sorted(client.ids)
        ars = [client[e].execute(NAIVE_GROUP.format(port=port, rank=r, world_size=len(ids)), block=False)
               for r, e in enumerate(ids)]
        for ar in ars:
            ar.get(timeout=120)
        total = time.perf_counter() - t0
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client[:].execute(LEAVE, block=False)
                time.sleep(0.3)
        with contextlib.suppress(Exception):
            cluster.stop_cluster_sync()
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
    return dict(cluster_seconds=t_cluster, group_seconds=total - t_cluster, seconds=total)


def measure_start(nb, rounds: int, log=print) -> dict:
    """(a): ``rounds`` alternated rounds of distnb's start and the ipyparallel reference."""
    a, b = [], []
    for k in range(rounds):
        for side in (("distnb", "reference") if k % 2 == 0 else ("reference", "distnb")):
            if side == "distnb":
                seconds = distnb_start(nb)
                from distnb import session

                setup = max(r.get("seconds") or 0.0 for r in session.current().cluster.ranks)
                distnb_stop(nb)
                a.append(dict(seconds=seconds, setup_seconds=setup))
            else:
                b.append(ipyparallel_reference())
        log(f"  cold start round {k + 1}: distnb {a[-1]['seconds']:.2f} s; ipyparallel defaults "
            f"{b[-1]['cluster_seconds']:.2f} s + naive group {b[-1]['group_seconds']:.2f} s = {b[-1]['seconds']:.2f} s")
    med = statistics.median
    return dict(distnb=med(x["seconds"] for x in a), reference=med(x["seconds"] for x in b),
                reference_cluster=med(x["cluster_seconds"] for x in b),
                reference_group=med(x["group_seconds"] for x in b), runs=dict(distnb=a, reference=b))


#: Variants of the distnb side of (b), measured in the same rounds (what the engine template gains, and
#: what it costs when ``%dist start`` comes right after ``%load_ext``): name -> cell run first, inside the timing.
FIRST_CELL_VARIANTS = {
    # the template started by the timed cell itself: %dist start waits for its imports
    "load_ext": "%reload_ext distnb",
    # no template: engines start as fresh processes and import torch themselves (the launch before it)
    "no_template": None,
}


def _distnb_first_cell(nb, cell, reset_cell, variant):
    from distnb.cluster import zygote

    if reset_cell:
        nb.cell(reset_cell, quiet=True)
    if variant == "load_ext":
        zygote.stop()
    elif variant == "no_template":
        os.environ["DISTNB_ZYGOTE"] = "0"
    else:
        zygote.get()  # ready, as after %load_ext earlier in the notebook (untimed)
    try:
        t0 = time.perf_counter()
        if FIRST_CELL_VARIANTS.get(variant):
            nb.cell(FIRST_CELL_VARIANTS[variant], quiet=True)
        start = distnb_start(nb)
        nb.cell(cell, quiet=True)
        wall = time.perf_counter() - t0
        r = nb.ns["r"]
        distnb_stop(nb)
    finally:
        os.environ.pop("DISTNB_ZYGOTE", None)
    return dict(seconds=wall, start_seconds=start, cell_seconds=r.wall_seconds, train_seconds=r.train_seconds,
                samples_per_s=r.samples_per_s)


def measure_first_cell(nb, rounds: int, cell: str, launch, reset_cell: str = "", log=print) -> dict:
    """(b): cold start + first cell, against ``launch()`` (one notebook_launcher call), alternated.

    ``reset_cell`` (untimed) runs before each distnb round: a fresh model, as the launcher builds.
    The main figure has the engine template ready (``%load_ext distnb`` ran earlier in the
    notebook); :data:`FIRST_CELL_VARIANTS` are measured in the same rounds, the order of the
    sides rotating from round to round.
    """
    sides = ["distnb", "accelerate", *FIRST_CELL_VARIANTS]
    runs = {s: [] for s in sides}
    for k in range(rounds):
        for side in sides[k % len(sides):] + sides[:k % len(sides)]:
            if side == "accelerate":
                res = launch()
                runs[side].append(dict(seconds=res["wall_seconds"], train_seconds=res["train_seconds"],
                                       samples_per_s=res["samples_per_s"], setup_seconds=res["setup_seconds"]))
            else:
                runs[side].append(_distnb_first_cell(nb, cell, reset_cell, side))
        a, b = runs["distnb"][-1], runs["accelerate"][-1]
        extra = "; ".join(f"{v} {runs[v][-1]['seconds']:.2f} s" for v in FIRST_CELL_VARIANTS)
        log(f"  first cell round {k + 1}: distnb start {a['start_seconds']:.2f} s + cell "
            f"{a['cell_seconds']:.2f} s (training {a['train_seconds']:.2f} s) = {a['seconds']:.2f} s; "
            f"notebook_launcher {b['seconds']:.2f} s (training {b['train_seconds']:.2f} s); {extra}")
    med = statistics.median
    a, b = runs["distnb"], runs["accelerate"]
    out = dict(distnb=med(x["seconds"] for x in a), reference=med(x["seconds"] for x in b),
               distnb_start=med(x["start_seconds"] for x in a), distnb_cell=med(x["cell_seconds"] for x in a),
               distnb_train=med(x["train_seconds"] for x in a), reference_train=med(x["train_seconds"] for x in b),
               runs=runs, pid=os.getpid())
    for v in FIRST_CELL_VARIANTS:
        out[v] = med(x["seconds"] for x in runs[v])
        out[v + "_start"] = med(x["start_seconds"] for x in runs[v])
    return out


@contextlib.contextmanager
def previous_launch():
    """distnb's engine launch as it was before the cold-start fix (for ``--only launch``).

    ``python -m ipyparallel.engine`` with its nanny process and history database, started only
    once the controller's connection info exists, 0.1 s apart; torch and ``torch._dynamo``
    imported after registration, before the process group forms (as ``runtime.setup`` did).
    """
    import sys

    import ipyparallel as ipp

    from distnb.cluster import cluster, launchers

    start, init, setup = launchers._EngineSetLauncher.start, ipp.Cluster.__init__, cluster.Cluster._setup_ranks

    def old_setup(self):
        ars = [self.client[e].execute("import torch, torch._dynamo", block=False) for e in self.engine_ids]
        for ar in ars:
            ar.get(timeout=300)
        return setup(self)

    def old_start(self, n):
        self.engine_cmd = [sys.executable, "-m", "ipyparallel.engine"]
        self.engine_args = []
        self.delay = 0.1
        self.environment = {**self.environment, "DISTNB_PRELOAD": "none"}
        return start(self, n)

    def old_init(self, *args, **kwargs):
        kwargs["send_engines_connection_env"] = True
        init(self, *args, **kwargs)

    launchers._EngineSetLauncher.start, ipp.Cluster.__init__ = old_start, old_init
    cluster.Cluster._setup_ranks = old_setup
    before = os.environ.get("DISTNB_ZYGOTE")
    os.environ["DISTNB_ZYGOTE"] = "0"  # nor were the controller and engines forked from a template then
    beat = cluster.HEARTBEAT_MS, cluster.HEARTBEAT_MISSES
    cluster.HEARTBEAT_MS, cluster.HEARTBEAT_MISSES = 250, 10  # the heartbeat then (misses: ipyparallel's default)
    try:
        yield
    finally:
        cluster.HEARTBEAT_MS, cluster.HEARTBEAT_MISSES = beat
        launchers._EngineSetLauncher.start, ipp.Cluster.__init__ = start, init
        cluster.Cluster._setup_ranks = setup
        if before is None:
            os.environ.pop("DISTNB_ZYGOTE", None)
        else:
            os.environ["DISTNB_ZYGOTE"] = before


def measure_launch_fix(nb, rounds: int, log=print) -> dict:
    """``%dist start`` with the current launch against the previous one, alternated (what the fix gained)."""
    a, b = [], []
    for k in range(rounds):
        for side in (("now", "before") if k % 2 == 0 else ("before", "now")):
            if side == "now":
                a.append(distnb_start(nb))
            else:
                with previous_launch():
                    b.append(distnb_start(nb))
            distnb_stop(nb)
        log(f"  launch round {k + 1}: now {a[-1]:.2f} s, before the fix {b[-1]:.2f} s")
    med = statistics.median
    return dict(distnb=med(a), reference=med(b), runs=dict(now=a, before=b))
