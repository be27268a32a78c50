"""What a ``--loop`` body does that ``ctx.report`` does not tell: its optimizer steps, and whether it ran epochs.

A step body's optimizer steps are distnb's own (:class:`distnb.engine.train.stepping.Stepper`); a
``--loop`` body steps its optimizer itself, so :class:`LoopWatch` counts those steps with torch's
optimizer step hook, and keeps the model's carried epoch and position where the cell found them
unless the body iterated ``ctx.epochs()`` (the one thing that moves them in a ``--loop`` cell).
"""

from __future__ import annotations

import threading

from torch.optim.optimizer import register_optimizer_step_post_hook


class LoopWatch:
    """The span of one ``--loop`` body on this rank (a context manager around its ``exec``).

    Every ``step()`` of a ``torch.optim.Optimizer`` the body's thread makes while it runs (the
    ``optimizer`` distnb gives it, or one the body made itself) counts as an optimizer step of
    the cell and of the model (``stepper.optimizer_steps``, ``run.optimizer_steps``), and its lr
    goes into the lr history. Not counted: the steps of the parameter server's own optimizer
    (the exchange inside ``optimizer.step()``) and steps in other threads. Updates made without
    an optimizer (``p -= lr * p.grad``) cannot be seen.

    On leaving, however the body ended: when it never iterated ``ctx.epochs()``, the model's epoch
    number and its position in the epoch are put back as they were when the body started, so a
    body that only walks ``ctx.loader`` leaves the epoch count alone (each such cell sees the
    same epoch's batches, like a ``DistributedSampler`` whose ``set_epoch`` is never called).

    Parameters
    ----------
    ctx : distnb.engine.train.context.Context
        The cell's context (its run, stepper and ``iterated_epochs`` flag).
    """

    def __init__(self, ctx):
        self.ctx, self.run, self.stepper = ctx, ctx._run, ctx.stepper
        inner = getattr(self.run.strategy, "_optimizer", None)  # ps: the server's optimizer inside the wrapper's
        self._not_counted = inner if inner is not None and inner is not self.run.optimizer else None
        self._thread = None
        self._handle = None
        self._position = None

    def __enter__(self):
        run = self.run
        self._position = (run.epoch, run.epoch_step, run.epoch_samples)
        self._thread = threading.get_ident()
        self._handle = register_optimizer_step_post_hook(self._stepped)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        if not self.ctx.iterated_epochs:
            self.run.epoch, self.run.epoch_step, self.run.epoch_samples = self._position
        return False

    def _stepped(self, optimizer, args, kwargs) -> None:
        if optimizer is self._not_counted or threading.get_ident() != self._thread:
            return
        self.stepper.lrs.add(self.run.optimizer_steps + 1, float(optimizer.param_groups[0]["lr"]))
        self.stepper.optimizer_steps += 1
        self.run.optimizer_steps += 1
