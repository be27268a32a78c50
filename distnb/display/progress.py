"""Progress state of a training cell, fed by rank messages (pure Python, no widgets)."""

from __future__ import annotations

import collections
import math
import statistics
import time

STATUSES = ("waiting", "running", "done", "failed", "interrupted")
#: A rank whose time per step is more than this fraction above the median is a straggler.
STRAGGLER_THRESHOLD = 0.20
#: Seconds of rank messages a rank's samples/s is measured over (cumulative samples / rank clock).
RATE_WINDOW = 1.0
#: Seconds a rank must stay at one spot before the dashboard says where it is.
STALL_SECONDS = 2.0
#: Innermost frames of each rank's stack that the where panel shows.
WHERE_FRAMES = 6
#: Fields of a rank message copied into the rank's row when present.
ROW_FIELDS = ("status", "epoch", "step", "total", "loss", "samples_per_s", "step_time", "busy_time", "error",
              "stage", "peak_memory", "memory_kind", "samples", "opt_step", "lr", "grad_norm", "epoch_loss",
              "train_seconds")
#: Statuses of a rank that has ended its cell (its samples/s is then the cell's, as in the TrainResult).
ENDED = ("done", "interrupted")


class Series:
    """(x, y) points appended in increasing x, kept at most ``2 * cap`` long by halving.

    A run of any length costs the same to store and to draw: when the series grows past
    ``2 * cap`` points every other point is dropped (the newest is always kept).
    """

    def __init__(self, cap=240):
        self.cap = cap
        self.points = []

    def __len__(self):
        return len(self.points)

    @property
    def last_x(self):
        return self.points[-1][0] if self.points else None

    def add(self, x, y) -> bool:
        """Append ``(x, y)`` if ``x`` is past the last point; returns True if added."""
        if self.points and x <= self.points[-1][0]:
            return False
        self.points.append((x, y))
        if len(self.points) > 2 * self.cap:
            last = self.points[-1]
            self.points = self.points[:-1:2] + [last]
        return True



def rank_rate(row) -> float:
    """A rank's samples/s: the cell's (samples over its training time) once it ended, else over the last
    second when known, else its last message's window."""
    return row["rate"] if row.get("rate") is not None else (row["samples_per_s"] or 0.0)


def loss_text(row) -> str:
    """A rank's loss figure: its mean loss over its current epoch so far (its last epoch's once it ended),
    else its newest step loss, else ``-``."""
    value = row["epoch_loss"] if row.get("epoch_loss") is not None else row["loss"]
    return "-" if value is None else f"{value:.4f}"


class ProgressState:
    """Latest figures per rank plus the loss and throughput history, as the kernel knows them.

    Parameters
    ----------
    world_size : int
    total_steps : int
        Steps each rank runs at most in this cell.
    epochs : int
    hosts, devices : list of str, optional
        Per rank, for display.
    strategy : str, optional
        The plan's strategy; ``"pipeline"`` shows each rank's stage.
    settings : str, optional
        The cell's words on options carried from the model's last cell (:func:`distnb.train.carried.cell_sentence`),
        shown in the dashboard's header.
    ranks_per_shard : int, optional
        Ranks that train on the same batch (tensor or pipeline parallel groups); the total samples/s
        counts each batch once, as :attr:`distnb.train.results.TrainResult.samples_per_s` does. Default 1.
    clock : callable, optional
        Seconds, for messages that carry no ``time`` of their own; default ``time.time``.
    """

    def __init__(self, world_size, total_steps=0, epochs=1, hosts=None, devices=None, strategy=None,
                 ranks_per_shard=1, settings="", clock=time.time):
        self.world_size = world_size
        self.total_steps = total_steps
        self.epochs = epochs
        self.strategy = strategy
        self.ranks_per_shard = max(1, int(ranks_per_shard))
        self.settings = settings
        self.rows = [dict(rank=r, host=(hosts or [""] * world_size)[r], device=(devices or [""] * world_size)[r],
                          status="waiting", epoch=None, step=0, total=total_steps, loss=None, epoch_loss=None,
                          samples_per_s=0.0, step_time=0.0, busy_time=None, error=None, stage=None,
                          peak_memory=None, memory_kind=None, samples=0, rate=None, where=None, opt_step=None,
                          lr=None, grad_norm=None, train_seconds=None, first_epoch=None)
                     for r in range(world_size)]
        self.curves = [Series() for _ in range(world_size)]  # per rank: (step, loss)
        self.epoch_means = {}  # epoch -> mean loss over all ranks
        self.epoch_rates = [{} for _ in range(world_size)]  # per rank: epoch -> its samples/s over that epoch
        self.throughput = Series()  # (seconds since the first message, samples/s summed over ranks)
        self.band = Series()  # (step, (mean, p10, p90) of the ranks' newest losses): display/aggregate.py
        self.validation = {}  # cell step -> (validation loss, metric or None), from rank 0's messages
        self.metric_name = None
        self.start = None  # rank 0's notes on the cell's start (its first message), see distnb.display.text.start_notes
        self.start_shown = False  # a view printed them (the cell's end does not again)
        self.version = 0
        self.wheres = {}  # rank -> its latest where report (engine/where.py), for the where panel
        self.where_version = 0  # bumped when the where panel would draw differently
        self._where_keys = {}
        self._clock = clock
        self._t0 = None
        self._counts = [collections.deque() for _ in range(world_size)]  # per rank: (time, cumulative samples)
        self._rate_parts = [0.0] * world_size  # per rank: its part of the throughput line's total
        self._rate_total = 0.0

    def update(self, rank: int, msg: dict) -> bool:
        """Merge one rank message; returns True if anything changed."""
        if not msg or not 0 <= rank < self.world_size:
            return False
        row = self.rows[rank]
        row_changed = False
        for key in ROW_FIELDS:
            value = msg.get(key)
            if value is not None and row[key] != value:
                row[key] = value
                row_changed = True
        curve = self.curves[rank]
        last = curve.last_x  # a message repeats its rank's newest points: convert only those not seen yet
        fresh = [(int(s), float(v)) for s, v in msg.get("points", ()) if last is None or s > last]
        new_points = [(step, value) for step, value in sorted(fresh) if curve.add(step, value)]
        if row["first_epoch"] is None and row["epoch"] is not None and row["step"]:
            row["first_epoch"] = row["epoch"]  # at its first step the rank is in the cell's first epoch
        if row["status"] in ENDED and row["train_seconds"]:  # the cell's figure, the TrainResult's
            row["rate"] = row["samples"] / row["train_seconds"]
        n_means, n_val, n_rates = len(self.epoch_means), len(self.validation), len(self.epoch_rates[rank])
        for epoch, mean in msg.get("epoch_losses", ()):
            if self.epoch_means.get(epoch) != mean:
                self.epoch_means[int(epoch)] = float(mean)
        for epoch, rate in msg.get("epoch_rates", ()):
            self.epoch_rates[rank][int(epoch)] = float(rate)
        for step, loss, metric in msg.get("val_points", ()):  # the same figures on every rank
            self.validation[int(step)] = (float(loss), None if metric is None else float(metric))
        self.metric_name = msg.get("metric_name") or self.metric_name
        if rank == 0 and self.start is None and msg.get("start"):
            self.start = msg["start"]
        changed = (bool(new_points) or n_means != len(self.epoch_means) or n_val != len(self.validation) or row_changed
                   or n_rates != len(self.epoch_rates[rank]))
        if changed:
            self.version += 1
            if "samples" in msg or "samples_per_s" in msg:
                self._record_throughput(rank, msg)
        return changed

    def _record_throughput(self, rank, msg):
        """Update ``rank``'s samples/s over the last RATE_WINDOW s of its messages, and the total line.

        The rate comes from the cumulative sample count and the rank's own clock, so it does not
        depend on when messages arrive, nor on the (short, uneven) windows of single messages.
        """
        now = float(msg.get("time") or self._clock())
        row = self.rows[rank]
        counts = self._counts[rank]
        if msg.get("samples") is not None:
            counts.append((now, msg["samples"]))
            while len(counts) > 2 and now - counts[1][0] >= RATE_WINDOW:
                counts.popleft()
            t_then, n_then = counts[0]
            if now - t_then >= 0.2 and row["status"] == "running":
                row["rate"] = (msg["samples"] - n_then) / (now - t_then)
        if self._t0 is None:
            self._t0 = now
        part = row["rate"] if row["rate"] is not None else (row["samples_per_s"] or 0.0)
        self._rate_total += part - self._rate_parts[rank]  # the sum over ranks, kept as ranks change: O(1)
        self._rate_parts[rank] = part
        total = self._rate_total / self.ranks_per_shard  # each batch once (tensor/pipeline groups share one)
        t = now - self._t0
        points = self.throughput.points
        if points and t - points[-1][0] < 0.05:  # coalesce ranks reporting together
            points[-1] = (points[-1][0], total)
        else:
            self.throughput.add(t, total)

    def set_where(self, rank: int, where: dict) -> None:
        """Keep where ``rank`` is (a :mod:`distnb.engine.process.where` summary) and note it once it stalls there.

        The report is kept in :attr:`wheres` (the dashboard's where panel); :attr:`where_version`
        changes only when the panel would draw differently (another spot or frame, another
        whole second there). The row's ``where`` becomes a short sentence ("waiting in
        all_reduce for 4 s", "at cell line 3 `time.sleep(60)` for 4 s") after
        :data:`STALL_SECONDS` at one spot, else None.
        """
        if not 0 <= rank < self.world_size or not where:
            return
        waited = max(0.0, where.get("sent", 0.0) - where.get("since", 0.0))
        self.wheres[rank] = where
        key = (where.get("state"), where.get("op"), where.get("shape"), where.get("cell_line"),
               tuple(map(tuple, (where.get("stack") or [])[-WHERE_FRAMES:])), int(waited))
        if key != self._where_keys.get(rank):  # the panel shows whole seconds: a new second is a change
            self._where_keys[rank] = key
            self.where_version += 1
        text = None
        if waited >= STALL_SECONDS and where.get("state") in ("collective", "running"):
            if where["state"] == "collective":
                text = f"waiting in {where.get('op')}"
            elif where.get("cell_line"):
                text = f"at cell line {where['cell_line']} `{where.get('cell_code')}`"
            else:
                top = (where.get("stack") or [("?", 0, "?", "")])[-1]
                text = f"in {top[2]} ({top[0].rsplit('/', 1)[-1]}:{top[1]})"
            text += f" for {waited:.0f} s"
        if text != self.rows[rank]["where"]:
            self.rows[rank]["where"] = text
            self.version += 1

    def set_status(self, status: str, ranks=None, error=None) -> None:
        """Set the status (and error text) of ``ranks`` (default all)."""
        for r in ranks if ranks is not None else range(self.world_size):
            self.rows[r]["status"] = status
            if error is not None:
                self.rows[r]["error"] = error
        self.version += 1

    def fraction(self, rank: int) -> float:
        """Share of this cell's steps that ``rank`` has finished, 0 to 1 (a stream, whose total is not
        known: 1 once the rank is done, else 0)."""
        row = self.rows[rank]
        if not row["total"]:
            return 1.0 if row["status"] == "done" else 0.0
        return min(1.0, row["step"] / row["total"])

    def cell_epoch(self, rank: int) -> int:
        """Which of this cell's epochs ``rank`` is in, counted from 1 (epoch numbers continue across cells).

        From the epoch numbers the rank reports (a cell stopped early at an epoch's end is in that
        epoch, not the next); before its first step, from its share of the cell's steps.
        """
        row = self.rows[rank]
        if not self.epochs:
            return 0
        if row["epoch"] is not None and row["first_epoch"] is not None:
            return max(1, min(self.epochs, row["epoch"] - row["first_epoch"] + 1))
        if not row["total"]:
            return 0
        return min(self.epochs, max(0, row["step"] - 1) * self.epochs // row["total"] + 1)

    def total_rate(self) -> float:
        """Samples/s of the whole world: each rank's (:func:`rank_rate`), each batch counted once."""
        return sum(rank_rate(row) for row in self.rows) / self.ranks_per_shard

    def mean_curve(self, steps=None) -> list:
        """(step, mean loss over ranks), each rank's latest loss at or before that step.

        ``steps`` defaults to the steps of rank 0's points. Ranks report at their own moments
        (a step or two apart); steps before every rank has reported are left out. One walk
        along each rank's (bounded) history: the cost does not grow with the run.
        """
        if not self.curves:
            return []
        steps = [x for x, _ in self.curves[0].points] if steps is None else steps
        walks = [(c.points, [0]) for c in self.curves]
        out = []
        for step in steps:
            values = []
            for points, pos in walks:
                j = pos[0]
                while j < len(points) and points[j][0] <= step:
                    j += 1
                pos[0] = j
                if j == 0:
                    break
                values.append(points[j - 1][1])
            if len(values) == len(walks):
                out.append((step, math.fsum(values) / len(values)))
        return out

    @property
    def show_stage(self) -> bool:
        """True for pipeline runs, or when any rank reported a stage."""
        return self.strategy == "pipeline" or any(r["stage"] is not None for r in self.rows)

    def time_per_step(self) -> tuple:
        """The per-rank time per step the straggler view compares, and what it is.

        Returns
        -------
        tuple of (list of float or None, str)
            ``busy_time`` (CPU seconds of the training thread per step, time not spent waiting
            for peers) when every rank reports it, else the wall ``step_time``; ``None`` for a
            rank that has not reported yet. The string is ``"busy"`` or ``"step"``.
        """
        if all(r["busy_time"] is not None for r in self.rows):
            return [r["busy_time"] if r["step"] else None for r in self.rows], "busy"
        return [r["step_time"] if r["step"] and r["step_time"] else None for r in self.rows], "step"

    def skews(self) -> list:
        """Per rank: time per step relative to the median over ranks, minus 1 (None if unknown)."""
        times, _ = self.time_per_step()
        known = [t for t in times if t is not None]
        if not known:
            return [None] * self.world_size
        median = statistics.median(known)
        return [None if t is None or median <= 0 else t / median - 1.0 for t in times]

    def straggler(self, threshold: float = STRAGGLER_THRESHOLD):
        """The slowest rank if its time per step is more than ``threshold`` above the median, else None."""
        skews = self.skews()
        known = [(s, r) for r, s in enumerate(skews) if s is not None]
        if len(known) < 2:
            return None
        skew, rank = max(known)
        return rank if skew > threshold else None
