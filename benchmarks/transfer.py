"""Targets 4 and 5: moving a 400 MB model and a 200 MB data set between the kernel and 2 ranks.

Measured through the code a training cell runs (``training.ensure_model`` with ``reset``,
``training.weights_back``, ``Session.scatter``), once with distnb's same-host shared-memory
path and once with the ipyparallel path it falls back to (tensors as zero-copy message
frames; what distnb used for every transfer before), alternated round by round.

- model: ``nn.Sequential`` of 24 ``Linear(2048, 2048)``: 100.7M parameters, 402.8 MB fp32;
  *send* = kernel to both ranks (each rank holds its own copy), *back* = rank 0's state
  into the kernel's model. Rate = model bytes / wall seconds of the call.
- data: ``X`` float32 (50000, 1000) = 200 MB plus int64 labels; *scatter* = each rank
  gets its half (the shard sizes and the bytes each rank holds are checked).
- kernel memory: the largest rise of the kernel's resident set during the call (sampled
  every millisecond), i.e. the extra copy a path makes in the kernel.
- the first shared-memory round after start is reported on its own (nothing is pooled yet: every
  page is touched for the first time, and the model and data move into the kernel's segments,
  :mod:`distnb.resident`); the target is for the rounds after it, a model and a data set sent
  again and again as a notebook does between cells: then the kernel copies nothing (the rounds
  check that the model and the data lie in its segments), each rank copies once.
- the machine's two memory-copy rates, measured in every round beside the transfers
  (:func:`copy_rates`): 400 MB ``numpy.copyto`` into pages already touched (*warm*) and into freshly
  allocated ones (*first touch*); every shared-memory rate is also given as a fraction of both.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

MODEL_LAYERS, WIDTH = 24, 2048
DATA_SHAPE = (50_000, 1000)


class PeakRss:
    """The highest resident-set size of this process above its level at entry, in bytes."""

    def __enter__(self):
        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.extra = self.peak - self.base
        return False


def set_path(session, path: str) -> None:
    """Use the shared-memory path (``"shm"``) or the ipyparallel one (``"ipyparallel"``) both ways."""
    from distnb import calls, transfer

    cluster = session.cluster
    if path == "shm":
        cluster.__dict__.pop("_distnb_shm_ranks", None)
        assert transfer.shm_ranks(cluster) == set(range(cluster.world_size)), "ranks cannot see /dev/shm"
    else:
        cluster._distnb_shm_ranks = frozenset()
        ars = cluster.apply_all(calls.probe_shm, "/nonexistent", "", os.getpid())
        cluster.wait_all(ars, timeout=60, what="turning shared memory off")


def copy_rates(nbytes: int = 400_000_000) -> tuple:
    """This machine's memory-copy rates now, bytes/s: (into touched pages, into fresh pages)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    t0 = time.perf_counter()
    dst = np.empty_like(src)
    np.copyto(dst, src)
    fresh = nbytes / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    warm = nbytes / (time.perf_counter() - t0)
    return warm, fresh


def _timed(fn):
    with PeakRss() as mem:
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    return seconds, mem.extra


def measure(nb, rounds: int, log=print) -> dict:
    """Alternate the two paths for ``rounds`` rounds; medians and per-run figures."""
    import torch
    import torch.nn as nn

    from distnb import session as sessions, training, transfer
    from distnb.plan import TrainPlan

    s = sessions.current()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(MODEL_LAYERS)])
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    X = torch.randn(*DATA_SHAPE)
    Y = torch.randint(0, 10, (DATA_SHAPE[0],))
    data_bytes = X.nbytes + Y.nbytes
    nb.ns["bench_big"], nb.ns["bench_data"] = model, (X, Y)
    plan = TrainPlan(model="bench_big", data="bench_data", reset=True)
    runs = {"shm": [], "ipyparallel": []}
    held_by_path = {}
    try:
        for k in range(rounds):
            for path in (("shm", "ipyparallel") if k % 2 == 0 else ("ipyparallel", "shm")):
                set_path(s, path)
                send, send_mem = _timed(lambda: training.ensure_model(s, plan, model, quiet=True))
                with torch.no_grad():
                    model[0].weight.add_(1.0)  # the kernel's copy differs, so "back" visibly restores it
                back, back_mem = _timed(lambda: training.weights_back(s, "bench_big", model))
                with torch.no_grad():
                    model[0].weight.sub_(1.0)
                scatter, scatter_mem = _timed(lambda: s.scatter("bench_data", (X, Y), quiet=True))
                if path not in held_by_path:  # each rank holds only its shard, and the data arrived intact
                    s.run("_bench_rows = len(bench_data[0])\n"
                          "_bench_bytes = bench_data[0].untyped_storage().nbytes()")
                    rows, held = s.pull("_bench_rows"), s.pull("_bench_bytes")
                    assert rows == [DATA_SHAPE[0] // 2] * 2, rows
                    assert all(h < X.nbytes * 0.6 for h in held), held
                    back_data = s.gather("bench_data")
                    assert torch.equal(back_data[0], X) and torch.equal(back_data[1], Y)
                    held_by_path[path] = held
                warm, fresh = copy_rates()
                pool = transfer._pool()
                resident = all(pool.ours(t.data_ptr(), t.nbytes) for t in (model[0].weight, model[-1].bias, X, Y))
                runs[path].append(dict(send_s=send, back_s=back, scatter_s=scatter, send_mem=send_mem,
                                       back_mem=back_mem, scatter_mem=scatter_mem, copy_warm=warm, copy_fresh=fresh,
                                       resident=resident))
                log(f"  transfer round {k + 1} {path}: send {model_bytes / send / 1e9:.2f} GB/s, back "
                    f"{model_bytes / back / 1e9:.2f} GB/s, scatter {data_bytes / scatter / 1e9:.2f} GB/s; kernel +"
                    f"{send_mem / 1e6:.0f}/{back_mem / 1e6:.0f}/{scatter_mem / 1e6:.0f} MB; memory copy "
                    f"{warm / 1e9:.1f} GB/s warm, {fresh / 1e9:.1f} GB/s first touch; model and data in the "
                    f"kernel's segments: {resident}")
    finally:
        for name in ("bench_big", "bench_data"):
            nb.ns.pop(name, None)
        s.run("for _n in ('bench_big', 'bench_data', '_bench_rows', '_bench_bytes'):\n    globals().pop(_n, None)\n"
              "from distnb.engine import loop as _loop\n_loop.RUNS.pop('bench_big', None)\n"
              "_ = _loop.SHARDS.pop('bench_data', None)")
        s.holdings.models.pop("bench_big", None)
        s.holdings.data.pop("bench_data", None)
        set_path(s, "shm")
    med = statistics.median
    out = dict(model_bytes=model_bytes, data_bytes=data_bytes, runs=runs)
    sets = dict(runs)
    sets["shm_first"], sets["shm"] = runs["shm"][:1], runs["shm"][1:] or runs["shm"]
    for path, rs in sets.items():
        out[path] = dict(send_gbs=model_bytes / med(r["send_s"] for r in rs) / 1e9,
                         copy_warm_gbs=med(r["copy_warm"] for r in rs) / 1e9,
                         copy_fresh_gbs=med(r["copy_fresh"] for r in rs) / 1e9,
                         back_gbs=model_bytes / med(r["back_s"] for r in rs) / 1e9,
                         scatter_gbs=data_bytes / med(r["scatter_s"] for r in rs) / 1e9,
                         send_mem_mb=med(r["send_mem"] for r in rs) / 1e6,
                         back_mem_mb=med(r["back_mem"] for r in rs) / 1e6,
                         scatter_mem_mb=med(r["scatter_mem"] for r in rs) / 1e6,
                         shard_mb=[b / 1e6 for b in held_by_path[path.removesuffix("_first")]])
    return out
