"""Progress state of a training cell, fed by rank messages (pure Python, no widgets)."""

from __future__ import annotations

import statistics

STATUSES = ("waiting", "running", "done", "failed", "interrupted")


class ProgressState:
    """Latest figures per rank plus the loss history, as the kernel knows them.

    Parameters
    ----------
    world_size : int
    total_steps : int
        Steps each rank runs at most in this cell.
    epochs : int
    hosts, devices : list of str, optional
        Per rank, for display.
    """

    def __init__(self, world_size, total_steps=0, epochs=1, hosts=None, devices=None):
        self.world_size = world_size
        self.total_steps = total_steps
        self.epochs = epochs
        self.rows = [dict(rank=r, host=(hosts or [""] * world_size)[r], device=(devices or [""] * world_size)[r],
                          status="waiting", epoch=None, step=0, total=total_steps, loss=None, samples_per_s=0.0,
                          step_time=0.0, error=None) for r in range(world_size)]
        self.curves = [dict() for _ in range(world_size)]  # rank -> {step: loss}
        self.epoch_means = {}  # epoch -> mean loss over all ranks
        self.version = 0

    def update(self, rank: int, msg: dict) -> bool:
        """Merge one rank message; returns True if anything changed."""
        if not msg or not 0 <= rank < self.world_size:
            return False
        row = self.rows[rank]
        before = (row["status"], row["step"], row["loss"], len(self.epoch_means))
        for key in ("status", "epoch", "step", "total", "loss", "samples_per_s", "step_time", "error"):
            if key in msg and msg[key] is not None:
                row[key] = msg[key]
        self.curves[rank].update({int(s): float(v) for s, v in msg.get("points", ())})
        for epoch, mean in msg.get("epoch_losses", ()):
            self.epoch_means[int(epoch)] = float(mean)
        changed = before != (row["status"], row["step"], row["loss"], len(self.epoch_means))
        if changed:
            self.version += 1
        return changed

    def set_status(self, status: str, ranks=None, error=None) -> None:
        for r in ranks if ranks is not None else range(self.world_size):
            self.rows[r]["status"] = status
            if error is not None:
                self.rows[r]["error"] = error
        self.version += 1

    def fraction(self, rank: int) -> float:
        row = self.rows[rank]
        return min(1.0, row["step"] / row["total"]) if row["total"] else 0.0

    def mean_curve(self) -> list:
        """(step, mean loss over ranks) for steps every rank has reported."""
        common = set.intersection(*(set(c) for c in self.curves)) if self.curves else set()
        return [(s, statistics.fmean(c[s] for c in self.curves)) for s in sorted(common)]
