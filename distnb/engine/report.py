"""Throttled progress messages from a rank to the kernel.

Messages go through ipyparallel's ``publish_data`` (the kernel reads them from
``AsyncResult.data`` while the cell runs), or to :data:`SINK` in a job run without a kernel.
A rank publishes at most once per
``interval`` seconds (default 0.1 s, i.e. <= 10 messages/s), plus once on every
status change and epoch end. Loss values are read off the device (``.item()``)
only when a message goes out, so reporting never forces a GPU sync per step.

Besides progress, each message carries what the kernel's dashboard shows per rank:
``busy_time`` (CPU seconds of the training thread per step, on CPU devices: time not spent
waiting for peers, so a straggler stands out even when collectives equalise the wall
``step_time``), ``peak_memory`` (bytes: the process's peak resident set on CPU, or
``torch.cuda.max_memory_allocated`` on a GPU; ``memory_kind`` says which) and, when a
strategy sets it, ``stage`` (the pipeline stage this rank runs).
"""

from __future__ import annotations

import resource
import sys
import time


#: Loss points and epoch means a message repeats (the newest), so the kernel loses none when it reads
#: the latest message only every second or so; more would make every message dearer to send and read.
TAIL = 16


#: Where messages go outside an engine: a callable taking each payload (a job that torchrun started,
#: :mod:`distnb.engine.job`, prints the epochs' losses from them). None in an engine: to the kernel.
SINK = None


def publish_raw(payload: dict) -> None:
    """``payload`` to the kernel, merged into the running cell's ``AsyncResult.data`` (or to :data:`SINK`)."""
    if SINK is not None:
        SINK(payload)
        return
    from ipyparallel.datapub import publish_data  # lazy: only inside an engine

    publish_data(payload)


def _default_publish(data: dict) -> None:
    publish_raw({"distnb": data})


def peak_memory(device=None) -> tuple:
    """Peak memory of this process so far: ``(bytes, kind)``.

    Parameters
    ----------
    device : torch.device or str, optional
        A CUDA device: ``torch.cuda.max_memory_allocated`` (kind ``"cuda"``). Otherwise the
        peak resident set size of the process (kind ``"rss"``).

    Returns
    -------
    tuple of (int, str)
    """
    if device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device)), "cuda"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak if sys.platform == "darwin" else peak * 1024), "rss"


def _engine_device():
    """The rank's device when running in an engine (None in plain processes and tests)."""
    runtime = sys.modules.get(__package__ + ".runtime") if __package__ else None
    return getattr(getattr(runtime, "STATE", None), "device", None)


class Reporter:
    """Collects per-step figures on one rank and publishes them, throttled.

    Parameters
    ----------
    rank : int
    total_steps : int
        Steps this cell will run at most (for the progress bar).
    epochs : int
        Epochs this cell will run at most.
    interval : float
        Minimum seconds between two throttled messages.
    publish : callable, optional
        ``publish(dict)``; default: ipyparallel's ``publish_data``.
    stage : int, optional
        Pipeline stage of this rank, sent with every message (``extra["stage"]`` works too).
    device : torch.device, optional
        Where the rank computes (for peak memory); default: the engine's device.
    """

    def __init__(self, rank, total_steps, epochs, interval=0.1, publish=None, stage=None, device=None):
        self.rank = rank
        self.total = int(total_steps)
        self.epochs = int(epochs)
        self.interval = float(interval)
        self.publish = publish or _default_publish
        self.step = 0
        self.samples = 0
        self.epoch = 0
        self.status = "waiting"
        self.points = []  # (step, loss) at each published message
        self.epoch_losses = []
        self._last_loss = None
        self._t_last = time.perf_counter()
        self._win_samples = 0
        self._win_steps = 0
        self._win_t0 = self._t_last
        self.samples_per_s = 0.0
        self.step_time = 0.0
        self.extra = {} if stage is None else {"stage": stage}
        self.messages = 0
        self.device = device if device is not None else _engine_device()
        self.busy_time = None  # CPU seconds of the training thread per step (CPU devices only)
        self._win_cpu0 = time.thread_time()

    def record(self, loss, num_samples: int) -> None:
        """Count one finished step of ``num_samples`` samples whose loss tensor is ``loss``."""
        self.step += 1
        self.samples += num_samples
        self._win_samples += num_samples
        self._win_steps += 1
        self._last_loss = loss
        now = time.perf_counter()
        if now - self._t_last >= self.interval:
            self._flush(now)

    def set_status(self, status: str, **extra) -> None:
        self.status = status
        self.extra.update(extra)
        self._flush(time.perf_counter())

    def end_epoch(self, epoch: int, mean_loss: float) -> None:
        self.epoch_losses.append((epoch, mean_loss))
        del self.epoch_losses[:-TAIL]
        self._flush(time.perf_counter())

    def _flush(self, now: float) -> None:
        window = now - self._win_t0
        cpu = time.thread_time()
        if self._win_steps and window > 0:
            self.samples_per_s = self._win_samples / window
            self.step_time = window / self._win_steps
            on_gpu = getattr(self.device, "type", None) == "cuda"
            self.busy_time = None if on_gpu else (cpu - self._win_cpu0) / self._win_steps
        self._win_t0, self._win_samples, self._win_steps, self._win_cpu0 = now, 0, 0, cpu
        try:
            memory, memory_kind = peak_memory(self.device)
        except Exception:  # progress must never break training
            memory, memory_kind = None, None
        loss = None
        if self._last_loss is not None:
            loss = float(self._last_loss)
            if not self.points or self.points[-1][0] != self.step:
                self.points.append((self.step, loss))
                del self.points[:-TAIL]
        self._t_last = now
        self.messages += 1
        msg = dict(rank=self.rank, status=self.status, epoch=self.epoch, epochs=self.epochs,
                   step=self.step, total=self.total, samples=self.samples, loss=loss,
                   samples_per_s=self.samples_per_s, step_time=self.step_time, busy_time=self.busy_time,
                   peak_memory=memory, memory_kind=memory_kind, points=self.points[-TAIL:],
                   epoch_losses=self.epoch_losses[-TAIL:], time=time.time())
        msg.update(self.extra)
        try:
            self.publish(msg)
        except Exception:  # progress must never break training
            pass
