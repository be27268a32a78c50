"""``--log-dir DIR``: TensorBoard event files written on the ranks (``torch.utils.tensorboard``).

Each rank writes its own run folder ``DIR/rank<r>`` (TensorBoard shows one run per rank):

- ``train/loss``: the rank's loss at each optimizer step (the mean of its micro-steps);
- ``train/samples_per_s``: the rank's samples per second over each epoch;

and rank 0 also the figures that are the same on every rank:

- ``train/lr`` and ``train/grad_norm`` (with ``--clip-grad-norm``) at each optimizer step;
- ``train/epoch_loss``: the mean loss over all ranks of each epoch;
- ``val/loss`` and ``val/<metric>`` at each validation (x: the epoch).

Steps are the model's optimizer steps counted across cells. The ``tensorboard`` package is an
optional dependency: the kernel checks for it before anything is sent.
"""

from __future__ import annotations

import os


class Logger:
    """This rank's event-file writer for one cell (``close`` flushes it)."""

    def __init__(self, directory: str, rank: int):
        from torch.utils.tensorboard import SummaryWriter

        self.rank = rank
        self.writer = SummaryWriter(log_dir=os.path.join(directory, f"rank{rank}"))
        self._losses = []

    def micro_step(self, value) -> None:
        self._losses.append(value)

    def optimizer_step(self, step: int, lr: float, grad_norm) -> None:
        if self._losses:
            self.writer.add_scalar("train/loss", sum(float(v) for v in self._losses) / len(self._losses), step)
            self._losses = []
        if self.rank == 0:
            self.writer.add_scalar("train/lr", lr, step)
            if grad_norm is not None:
                self.writer.add_scalar("train/grad_norm", grad_norm, step)

    def epoch(self, epoch: int, mean_loss: float, samples_per_s: float) -> None:
        self.writer.add_scalar("train/samples_per_s", samples_per_s, epoch)
        if self.rank == 0:
            self.writer.add_scalar("train/epoch_loss", mean_loss, epoch)

    def validation(self, entry: dict) -> None:
        if self.rank != 0:
            return
        self.writer.add_scalar("val/loss", entry["loss"], entry["epoch"])
        if entry.get("metric") is not None:
            self.writer.add_scalar(f"val/{entry['metric_name'] or 'metric'}", entry["metric"], entry["epoch"])

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
