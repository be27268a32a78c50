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
- kernel memory: the largest rise of the kernel's resident set during the call (Linux's own peak,
  reset before the call: :class:`PeakRss`), i.e. the extra copy a path makes in the kernel.
- each path moves a model and a data set of its own (the same sizes, under their own names), so
  that the rounds of one path leave the other's tensors where that path put them.
- the first shared-memory round after start is reported on its own (nothing is pooled yet: every
  page is touched for the first time, and the model and data move into the kernel's segments,
  :mod:`distnb.transfer.resident`); the target is for the rounds after it, a model and a data set sent
  again and again as a notebook does between cells: then the kernel copies nothing of the model
  (the rounds check that it lies in the kernel's segments), each rank copies once; a scatter is
  gathered by the kernel into a segment the ranks map (one copy, in the kernel).
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
    """The highest resident-set size of this process above its level at entry, in bytes.

    Linux keeps the peak (``VmHWM``) itself: writing 5 to ``/proc/self/clear_refs`` resets it
    to the current size, so the call being timed runs with nothing beside it. Where that file
    cannot be written, a thread samples the resident set every millisecond instead (it costs
    the kernel about 5 % of these transfers' speed on 2 cores).
    """

    def __enter__(self):
        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._hwm()
        except (OSError, ValueError):
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = max(self.peak, self._hwm())
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.extra = self.peak - self.base
        return False


def set_path(session, path: str) -> None:
    """Use the shared-memory path (``"shm"``) or the ipyparallel one (``"ipyparallel"``) both ways."""
    from distnb.core import calls
    from distnb.transfer import transfer

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

    from distnb import session as sessions
    from distnb.train import training
    from distnb.transfer import transfer
    from distnb.core.plan import TrainPlan

    s = sessions.current()
    torch.manual_seed(0)
    # each path moves its own model and data set under its own names: a notebook uses one path, and
    # the other path's rounds in between must not move this one's tensors out of its segments
    made = {}
    for path in ("shm", "ipyparallel"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(MODEL_LAYERS)])
        X, Y = torch.randn(*DATA_SHAPE), torch.randint(0, 10, (DATA_SHAPE[0],))
        names = (f"bench_big_{path}", f"bench_data_{path}")
        nb.ns[names[0]], nb.ns[names[1]] = model, (X, Y)
        made[path] = (model, X, Y, names, TrainPlan(model=names[0], data=names[1], reset=True))
    model_bytes = sum(p.numel() * p.element_size() for p in made["shm"][0].parameters())
    data_bytes = made["shm"][1].nbytes + made["shm"][2].nbytes
    runs = {"shm": [], "ipyparallel": []}
    held_by_path = {}
    try:
        for k in range(rounds):
            for path in (("shm", "ipyparallel") if k % 2 == 0 else ("ipyparallel", "shm")):
                runs[path].append(_round(s, path, made[path], held_by_path, data_bytes))
                r = runs[path][-1]
                log(f"  transfer round {k + 1} {path}: send {model_bytes / r['send_s'] / 1e9:.2f} GB/s, back "
                    f"{model_bytes / r['back_s'] / 1e9:.2f} GB/s, scatter {data_bytes / r['scatter_s'] / 1e9:.2f} GB/s; "
                    f"kernel +{r['send_mem'] / 1e6:.0f}/{r['back_mem'] / 1e6:.0f}/{r['scatter_mem'] / 1e6:.0f} MB; "
                    f"memory copy {r['copy_warm'] / 1e9:.1f} GB/s warm, {r['copy_fresh'] / 1e9:.1f} GB/s first "
                    f"touch; the model in the kernel's segments: {r['resident']}")
    finally:
        names = [n for m in made.values() for n in m[3]]
        for name in names:
            nb.ns.pop(name, None)
        s.run(f"for _n in {names + ['_bench_rows', '_bench_bytes']!r}:\n    globals().pop(_n, None)\n"
              "from distnb.engine.train import loop as _loop, shards as _shards\n"
              f"for _n in {names!r}:\n    _loop.RUNS.pop(_n, None)\n    _ = _shards.SHARDS.pop(_n, None)")
        for model_name, data_name in (m[3] for m in made.values()):
            s.holdings.models.pop(model_name, None)
            s.holdings.data.pop(data_name, None)
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


def _round(s, path, made, held_by_path, data_bytes) -> dict:
    """One round of one path: send, weights back, scatter, then the machine's copy rates."""
    import torch

    from distnb.train import training
    from distnb.transfer import transfer

    model, X, Y, (model_name, data_name), plan = made
    set_path(s, path)
    send, send_mem = _timed(lambda: training.ensure_model(s, plan, model, quiet=True))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the kernel's copy differs, so "back" visibly restores it
    back, back_mem = _timed(lambda: training.weights_back(s, model_name, model))
    with torch.no_grad():
        model[0].weight.sub_(1.0)
    scatter, scatter_mem = _timed(lambda: s.scatter(data_name, (X, Y), quiet=True))
    if path not in held_by_path:  # each rank holds only its shard, and the data arrived intact
        s.run(f"_bench_rows = len({data_name}[0])\n_bench_bytes = {data_name}[0].untyped_storage().nbytes()")
        rows, held = s.pull("_bench_rows"), s.pull("_bench_bytes")
        assert rows == [DATA_SHAPE[0] // 2] * 2, rows
        assert all(h < X.nbytes * 0.6 for h in held), held
        back_data = s.gather(data_name)
        assert torch.equal(back_data[0], X) and torch.equal(back_data[1], Y)
        held_by_path[path] = held
    warm, fresh = copy_rates()
    pool = transfer._pool()
    resident = all(pool.ours(t.data_ptr(), t.nbytes) for t in (model[0].weight, model[-1].bias))
    return dict(send_s=send, back_s=back, scatter_s=scatter, send_mem=send_mem, back_mem=back_mem,
                scatter_mem=scatter_mem, copy_warm=warm, copy_fresh=fresh, resident=resident)
