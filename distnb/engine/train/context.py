"""What a ``%%distrain`` body sees as ``ctx``, and the stop that every rank takes at the same step.

:class:`Context` counts micro-steps and epochs, reports progress, runs validation at epoch
ends, saves checkpoints and agrees with the other ranks on a stop (:class:`StopRequest`); the
optimizer step itself is :class:`distnb.engine.train.stepping.Stepper`'s (``ctx.stepper``).
"""

from __future__ import annotations

import math
import signal
import threading
import time

import torch
import torch.distributed as dist

from distnb.engine.process import abort, collectives, runtime, where
from distnb.engine.process.collectives import group_device
from distnb.engine.strategies import compiling
from distnb.engine.train import checkpoint, epochrest, replicas, stepping, weighting


class _Stopped(BaseException):
    """Every rank agreed to stop at this step boundary (an interrupt from the kernel)."""


class StopRequest:
    """SIGINT during a training cell, turned into a stop that every rank takes at the same step.

    The first SIGINT only sets :attr:`requested`; ranks OR their flags with an all-reduce about
    every :data:`STOP_CHECK_SECONDS` (at a step count all ranks agree on), so they all stop after
    the same completed step, with identical parameters and a healthy process group. A second
    SIGINT raises KeyboardInterrupt at once (for a body stuck between steps).
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


#: Seconds of training between two checks for a stop request (one tiny all-reduce each).
STOP_CHECK_SECONDS = 0.1
#: Seconds between the first two looks at the store while a rank waits for the others' step counts; each
#: later wait doubles, up to :data:`STEPS_POLL_SECONDS`. Ranks usually arrive within a millisecond of each
#: other, and a fixed 5 ms poll made every epoch end wait a whole poll (6 % of a small CNN's training).
STEPS_POLL_FIRST = 0.0001
STEPS_POLL_SECONDS = 0.005
_AGREED = {"store": None, "seq": 0}  # the step agreements of this process group, counted alike on every rank


def agree_on_steps(steps: int, when: str) -> None:
    """Wait until every rank reports its step count ``steps`` through the group's store; raise if they differ.

    The ranks' ``when`` must agree too: the agreements are counted per process group, so a
    rank that left ``ctx.epochs()`` early meets the others' epoch end with its body end.

    Called at each epoch end of a ``--loop`` body or of a stream, and at the end of a ``--loop``
    body, before distnb's own collectives (the epoch's mean loss, the stop check, the trained
    state); a step body over data of known length takes the same steps on every rank. A ``--loop`` body
    in which some ranks leave ``ctx.loader`` early (``if ctx.rank == 0 and i == 3: break``)
    would otherwise send the early ranks into those collectives while the others are still
    in a step's DDP all-reduce: gloo, given buffers of different sizes, aborts the engine
    (SIGABRT). Here the early ranks wait outside torch.distributed, in their own code: if
    the others are stuck in a step's collective, the kernel's hang check (:mod:`distnb.execute.hangs`)
    interrupts the waiting ranks and names each rank's spot (this one's says its step count);
    if all arrive with different counts, every rank raises the same error.

    ``when``: words for the error (``"at the end of epoch 0"``). The store is the gloo
    group's (:data:`distnb.engine.process.abort.ARMED`); without one (nccl) this does nothing.

    Raises
    ------
    RuntimeError
        On every rank, when the ranks took different numbers of steps; it names each rank's count.
    """

    store, st = abort.ARMED.store, runtime.STATE
    if store is None or st.world_size < 2:
        return
    if _AGREED.get("store") is not store:  # a new group (its own store): counted from 0 on every rank alike; a
        _AGREED.update(store=store, seq=0)  # rank's group generation differs on ranks %dist scale added
    _AGREED["seq"] += 1
    key = f"distnb_steps/{_AGREED['seq']}/"
    store.set(key + str(st.rank), f"{steps}\t{when}")  # the spot too: one rank's epoch end may meet another's body end
    keys = [key + str(r) for r in range(st.world_size)]
    where.NOTE["text"] = (f"waiting {when} after {steps} step{'' if steps == 1 else 's'} of it for the other ranks "
                          "(a rank that takes fewer steps than the others, e.g. a --loop body that breaks out of "
                          "ctx.loader on some ranks only, leaves them waiting in the step's collective)")
    delay = STEPS_POLL_FIRST
    try:  # polled, not store.wait: the store's C++ logs a warning line (into the cell) at each wait's timeout
        while not store.check(keys):
            time.sleep(delay)
            delay = min(STEPS_POLL_SECONDS, 2 * delay)
    finally:
        where.NOTE.pop("text", None)
    seen = [v.decode().split("\t", 1) for v in store.multi_get(keys)]  # one round trip, not one per rank
    if len({tuple(v) for v in seen}) > 1:
        if len({w for _, w in seen}) == 1:
            what = f"the ranks took different numbers of steps {when} (" + \
                ", ".join(f"rank {r}: {n}" for r, (n, _) in enumerate(seen)) + ")"
        else:
            what = "the ranks left their steps at different points (" + \
                ", ".join(f"rank {r}: {n} steps, {w}" for r, (n, w) in enumerate(seen)) + ")"
        raise RuntimeError(f"{what}; every rank must take the same steps (a --loop body that breaks out of "
                           "ctx.loader or ctx.epochs(), or skips a batch, on some ranks only desynchronises "
                           "their collectives): break on every rank or none")


class Context:
    """What a ``%%distrain`` body sees as ``ctx``.

    Attributes
    ----------
    rank : int
        This rank (the torch.distributed global rank).
    world_size : int
        Ranks in the world.
    local_rank : int
        This rank's index on its host.
    device : torch.device
    model : torch.nn.Module
        The strategy-wrapped model (DistributedDataParallel for ddp, the sharded module
        for fsdp and tensor, this rank's pipeline stage for pipeline).
    module : torch.nn.Module
        The unwrapped model.
    optimizer : torch.optim.Optimizer
    plan : TrainPlan
    epoch : int
        Current epoch number (counts across cells).
    step : int
        Optimizer steps finished in this cell (0 during the first): an ``--accumulate N`` group of
        micro-steps is one, a group dropped by ``--nan skip`` counts too; with ``--loop``, the
        ``step()`` calls of the body's optimizer. Read-only.
    global_step : int
        Optimizer steps the model has taken, across cells (what checkpoints count). Read-only.
    micro_step : int
        The index of the running micro-step within its accumulation group, ``0 .. --accumulate - 1``
        (always 0 without ``--accumulate``). Read-only.
    micro_steps : int
        Micro-steps (batches) finished in this cell.
    lr : float
        The learning rate of the optimizer's first parameter group now (after ``--lr-schedule``).
    loss_scale : float or None
        ``--precision fp16``: the ``torch.amp.GradScaler`` scale the next backward multiplies the
        loss by (the same on every rank); None otherwise (fp32 and bf16 run without loss scaling).
    grad_norm : float or None
        The total 2-norm of the whole model's gradients at the last optimizer step, before
        clipping and after unscaling (fp16) and ``ctx.num_items`` normalisation; computed only
        with ``--clip-grad-norm`` (one pass over the gradients, and for sharded strategies one
        all-reduce; a bound no norm reaches, ``--clip-grad-norm 1e9``, measures without clipping),
        None before the first optimizer step or without it.
    num_items : int, float, torch.Tensor or None
        Set by the body when its ``loss`` is a *sum* over valid items (tokens, padding masked):
        ``ctx.num_items = mask.sum()``. distnb then divides the gradients by the count summed
        over the accumulation group's micro-steps and the ranks (token-weighted, as one process
        on the whole batch; ``distnb.engine.train.weighting``), and logs the token-weighted mean loss.
        Set it on every micro-step or on none. Not with ``--loop``, pipeline or ps (ValueError).
    steps_per_epoch : int
    loader : Iterable
        Batches of this rank's shard for the current epoch (used with ``--loop``).
    iterated_epochs : bool
        The body iterated :meth:`epochs` (with ``--loop``, the only thing that runs ``--epochs``
        and moves the model's epoch count: ``distnb.engine.train.loopwatch.LoopWatch``).
    """

    def __init__(self, plan, run, data, reporter, stop=None):
        st = runtime.STATE
        self.rank, self.world_size, self.local_rank, self.device = st.rank, st.world_size, st.local_rank, st.device
        self.plan, self.model, self.module, self.optimizer = plan, run.strategy.model, run.module, run.optimizer
        self.strategy = run.strategy
        self._run, self._data, self._reporter = run, data, reporter
        reporter.running_loss = self.running_mean  # the dashboard's loss column: the epoch's mean so far
        self._running = [None, 0, 0.0, None]  # running_mean's sums: (the list summed, entries in it, floats, tensors)
        self.steps_per_epoch = data.steps_per_epoch(plan)
        self.epoch = reporter.epoch = run.epoch  # (a --loop body may never iterate ctx.epochs(), which sets it)
        self.micro_steps = 0
        self.epoch_losses = []
        self.local_losses = []
        self.stopped_early = False
        self.iterated_epochs = False
        self._losses = []
        self._loss_count = 0
        self._loss_weight = 0.0  # what the epoch's losses are divided by: steps, or ctx.num_items summed
        self._batch_samples = 0
        self._forwards_seen = run.forwards
        # a step body over data of known length takes the same steps on every rank (distnb's loop runs them
        # all); a --loop body, or a stream that may end sooner on some ranks, has its step counts compared
        self._agree_at_epoch_end = plan.loop or data.epoch_length(plan) is None
        self._stop = stop or StopRequest()
        self._check_at = 1  # step count of the next stop check (the same on every rank)
        self._stop_work = None  # the stop check in flight: (work, flags)
        self._check_t0 = time.perf_counter()
        self._check_step0 = 0
        self.interrupted = False
        self.skipped_steps = 0  # steps dropped for a non-finite loss (--nan skip)
        self.skip = run.epoch_samples  # resume mid-epoch: samples of the first epoch already trained
        self.checkpoints = []
        self.stepper = stepping.Stepper(plan, run, self.steps_per_epoch, self.device)
        self.validator = None
        self.loss_history = stepping.History()
        self.logger = None
        self.stop_reason = None  # "target", "patience" or None (epochs ran out, or interrupted)
        self._save_pending = False
        self._step_times = []  # wall seconds of the first steps (--compile: the first one compiles)
        self.loss_dtype = None  # "bfloat16"/"float16": the body's loss was of that dtype, upcast to fp32 to report
        self._dynamo = compiling.snapshot() if plan.compile else None  # what dynamo did is counted from here
        self.epoch_batches, self.epoch_done = self.steps_per_epoch, 0  # batches of this epoch, and done
        self.epoch_samples = None  # the samples of those batches (None: a stream's, not known ahead)
        self._t_step = time.perf_counter()
        self._num_items = self._count = None  # ctx.num_items as set, and as a count
        self._stop_reason_local = None  # (reason, global step) of this rank's ctx.request_stop
        self.stop_request = None  # agreed: dict(ranks, reason, step) once the ranks stopped on a request
        if plan.check_replicas != "off":  # what a resume, a resize or a %%dist cell left on the ranks
            replicas.check(self.strategy, "before the cell's first step")

    # what the strategies' steps and the body use --------------------------------------
    def autocast(self):
        """The autocast context of ``--precision`` (forward and loss)."""
        return self.stepper.autocast()

    def backward(self, loss):
        self.stepper.backward(loss, self._count)

    def scale_loss(self, loss):
        return self.stepper.scale_loss(loss)

    def after_backward(self, fn):
        """Run ``fn()`` once the gradients of this optimizer step are complete (reduced, unscaled),
        before ``--clip-grad-norm`` and the optimizer step: e.g. ``ctx.after_backward(lambda:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))``. Register it in the body of
        every step (with ``--accumulate``, the last micro-step's registration runs)."""
        self.stepper.after_backward(fn)

    @property
    def lr(self) -> float:
        return self.stepper.lr

    @property
    def step(self) -> int:
        return self.stepper.optimizer_steps if self.plan.loop else self.stepper.groups_done

    @property
    def global_step(self) -> int:
        return self._run.optimizer_steps

    @property
    def micro_step(self) -> int:
        return self.epoch_done % self.plan.accumulate

    @property
    def loss_scale(self):
        scaler = self.stepper.scaler
        return None if scaler is None else float(scaler.get_scale())

    @property
    def grad_norm(self):
        return self.stepper._norm_reading.now()  # exact: a GPU rank waits for it here, only when the body asks

    @property
    def num_items(self):
        return self._num_items

    @num_items.setter
    def num_items(self, value):
        count = None
        if value is not None:
            weighting.check_allowed(self.plan)
            count = weighting.as_count(value, self.device)  # a bad value fails here, in the body's line
        self._num_items, self._count = value, count

    def _clear_items(self) -> None:
        """A new micro-step (or validation batch): the body sets ``ctx.num_items`` anew."""
        self._num_items = self._count = None

    def request_stop(self, reason: str = "") -> None:
        """Ask every rank to stop: all stop after the same optimizer step; the result names this rank and ``reason``.

        The request travels with distnb's stop check (one small all-reduce about every
        ``STOP_CHECK_SECONDS`` (0.1 s) of training, at an optimizer-step boundary every rank shares),
        so the ranks stop at the first check after the request: the step it was made in or a few
        later, never in the middle of an accumulation group. The trained weights come back and the
        position is kept, as after an interrupt; ``TrainResult.stop_request`` is ``{"ranks": [...],
        "reason": str, "step": int}`` (the lowest requesting rank's reason) and ``stop_reason``
        ``"requested"``. In a ``--loop`` body the check runs in :meth:`report`: call it after each step.

        Parameters
        ----------
        reason : str
            Why, in words (``"loss diverged"``); shown in the cell's result.
        """
        if self._stop_reason_local is None:
            self._stop_reason_local = (str(reason), self.global_step)

    @property
    def loader(self):
        skip, self.skip = self.skip, 0
        # this epoch's batches in this cell (fewer for an epoch resumed in the middle, or the rest of one a resize
        # left: engine/epochrest.py); --accumulate groups them; the samples they hold (the last may be short)
        self.epoch_batches, self.epoch_samples, batches = epochrest.epoch_batches(
            self._run, self._data, self.plan, self.epoch, skip, self.device, self.steps_per_epoch)
        self.epoch_done = 0
        for self._batch_samples, batch in batches:
            yield batch

    def epochs(self):
        """Yield the ``--epochs`` epoch numbers (counted across cells); after each, all-reduce the mean loss.

        Each epoch the body finishes here advances the model's epoch count, runs checkpoints and
        honours ``--target-loss`` (validation and ``--patience`` in a step cell; ``--val-data`` is
        refused with ``--loop``, whose body is not one step). With ``--loop`` this
        is the only place ``--epochs`` acts: a body that never iterates it runs the passes it
        writes itself, and the epoch count stays as it was.
        """
        self.iterated_epochs = True
        first = self._run.epoch
        for epoch in range(first, first + self.plan.epochs):
            self.epoch = self._reporter.epoch = epoch
            self._losses, self._loss_count, self._loss_weight = [], 0, 0.0
            step0 = self.micro_steps
            yield epoch
            if self._agree_at_epoch_end:
                # before any collective of distnb's
                agree_on_steps(self.micro_steps - step0, f"at the end of epoch {epoch}")
            mean = self._epoch_mean()
            if self.plan.check_replicas != "off":
                replicas.check(self.strategy, f"at the end of epoch {epoch}")
            self.epoch_losses.append(mean)
            self._run.epoch, self._run.epoch_step, self._run.epoch_samples = epoch + 1, 0, 0
            judged = mean
            if self.validator is not None and ((epoch - first + 1) % self.plan.val_every == 0
                                               or epoch == first + self.plan.epochs - 1):
                judged = self._validate(epoch)
            self._reporter.end_epoch(epoch, mean)  # with the validation's figures, in one message
            if self.logger is not None:
                self.logger.epoch(epoch, mean, self._reporter.samples_per_s)
            if self.plan.checkpoint_dir and self.plan.checkpoint_every is None:
                self.save_checkpoint()
            self._settle_stop_check()  # a stop asked for during the epoch lands here, after it
            if self.plan.target_loss is not None and judged <= self.plan.target_loss:
                self.stopped_early, self.stop_reason = True, "target"
                break
            if self.validator is not None and self.validator.out_of_patience:
                self.stopped_early, self.stop_reason = True, "patience"
                break

    def _validate(self, epoch):
        """One validation pass (every rank, same epoch); returns the validation loss."""
        entry = self.validator.evaluate(self, self._code, epoch)
        entry["step"] = self.micro_steps
        self._reporter.extra["val_points"] = [(e["step"], e["loss"], e["metric"])
                                              for e in self.validator.history[-16:]]
        self._reporter.extra["metric_name"] = self.validator.metric_name
        if self.logger is not None:
            self.logger.validation(entry)
        return entry["loss"]

    def any_nonfinite(self, loss, value) -> list:
        """The ranks (ascending) on which the loss of this step is NaN or infinite, the same list on every rank.

        Empty (false) when it is finite everywhere. One all-reduce of ``world_size`` flags, read once.
        """
        flags = torch.zeros(self.world_size, device=group_device())
        if value is not None:
            flags[self.rank] = 0.0 if math.isfinite(value) else 1.0
        else:  # the flag is made where the loss is: one read (after the all-reduce), not two
            flags[self.rank] = (~torch.isfinite(loss.detach().float())).float().reshape(()).to(group_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [r for r, flag in enumerate(flags.tolist()) if flag]

    def note_loss_dtype(self, loss) -> None:
        """Remember that the body's ``loss`` is a low-precision tensor (bf16, fp16) that distnb upcasts to report."""
        if self.loss_dtype is None and stepping.is_low_precision(loss):
            self.loss_dtype = self._reporter.extra["loss_dtype"] = str(loss.dtype).replace("torch.", "")

    def report(self, loss, num_samples=None, value=None, skipped=False):
        """Record one finished step (loss: scalar tensor; num_samples: default the last batch size).

        ``value`` is ``float(loss)`` when the caller has it already. With ``--loop`` and
        ``--lr-schedule``, each report steps the schedule (the optimizer steps the result
        counts are the body's real ``optimizer.step()`` calls: ``distnb.engine.train.loopwatch``).

        Raises if the step never called ``model`` (the strategy wrapper): calling the
        unwrapped module (e.g. by its notebook name) skips the gradient all-reduce and the
        replicas silently diverge.
        """
        if self.strategy.wraps_model and self._run.forwards == self._forwards_seen:
            raise RuntimeError(
                f"rank {self.rank}, epoch {self.epoch}, step {self.micro_steps}: the step never called `model`, "
                "the DistributedDataParallel-wrapped model; calling the notebook's model directly (e.g. "
                "`net(x)`) skips the gradient all-reduce and the ranks diverge. Use `model(x)` in the body")
        self._forwards_seen = self._run.forwards
        if self.plan.loop:  # the body's step: the rank moved on (distnb.engine.process.where; the stepper says so otherwise)
            collectives.PROGRESS[0] += 1
        detached = stepping.upcast(loss.detach())  # bf16/fp16: reduced and logged as fp32, said once (loss_dtype)
        self.note_loss_dtype(loss)
        if skipped:
            self.skipped_steps += 1
        else:  # a float when the step already read it (CPU); a tensor otherwise, summed per epoch (no GPU sync)
            self._losses.append(detached if value is None else value)  # a summed loss with ctx.num_items
            self._loss_count += 1
            self._loss_weight += 1.0 if self._count is None else self._item_weight()
        if self._count is not None:  # the step's own figures: its sum over its count
            detached, value = self._per_item(detached, value)
        self.micro_steps += 1
        self._run.steps += 1
        self._run.epoch_step += 1
        self._run.epoch_samples += self._batch_samples
        self.epoch_done += 1
        self.loss_history.add(self._run.steps, detached if value is None else value)
        self._time_step()
        stepper, extra = self.stepper, self._reporter.extra
        extra.update(micro_step=self.micro_steps, opt_step=stepper.optimizer_steps, lr=stepper.lr,
                     grad_norm=stepper.last_norm)
        self._reporter.record(detached if value is None else value,  # a value read already: no second read
                              self._batch_samples if num_samples is None else num_samples)
        if self.logger is not None:
            self.logger.micro_step(detached if value is None else value)
        every = self.plan.checkpoint_every
        if every and self.plan.checkpoint_dir and self._run.steps % every == 0:
            self._save_pending = True  # at the next optimizer step (a global step count every rank shares)
        if self.plan.loop and self._run.scheduler is not None:  # the loop stepped its optimizer: the schedule too
            self._run.scheduler.step()  # (the step itself was counted by loopwatch's optimizer hook)
        if not stepper.at_boundary(self.epoch_done, self.epoch_batches):
            return  # in the middle of an --accumulate group: stop checks and saves wait for its end
        if self.plan.check_replicas == "step":
            replicas.check(self.strategy, f"after optimizer step {self._run.optimizer_steps}")
        if self.logger is not None and stepper.optimizer_steps:
            self.logger.optimizer_step(self._run.optimizer_steps, stepper.lrs.values[-1] if stepper.lrs.values
                                       else stepper.lr, stepper.last_norm)
        if self._save_pending:
            self._save_pending = False
            self.save_checkpoint()
        if self.micro_steps >= self._check_at and not self._ends_epoch():
            self._agree_on_stop()

    def said(self) -> dict:
        """What the result says of how this rank's steps were done (results.training_notes)."""
        stepper = self.stepper
        return dict(stop_request=self.stop_request, stop_asked=self._stop_reason_local,
                    skipped=list(stepper.skipped), token_weighted=stepper.items.weighted,
                    loss_scale=self.loss_scale, scaler_skips=int(stepper.scaler_skips))

    def _item_weight(self):
        """This micro-step's ``ctx.num_items`` as the weight of its loss in the epoch's mean (a float on CPU)."""
        count = self._count
        return float(count) if count.device.type == "cpu" else count

    def _per_item(self, detached, value):
        """(loss tensor, float or None) of a summed loss divided by this micro-step's ``ctx.num_items`` (at least 1)."""
        count = self._count.to(detached.device).clamp_min(1.0)
        mean = (detached.double() / count).to(detached.dtype)
        return mean, (None if value is None else value / float(count))

    def _ends_epoch(self) -> bool:
        """Whether this step is the last of an epoch that :meth:`epochs` ends next on every rank alike.

        A stop asked for then lands at that end (:meth:`_settle_stop_check`), after the epoch's mean,
        validation and checkpoint, rather than between its last step and its end: a position that
        read as "epoch E, step N" of an epoch whose steps were all trained. A ``--loop`` body or a
        stream, whose ranks may take other steps (their counts are compared at the end), stops here.
        """
        return not self._agree_at_epoch_end and self.epoch_done >= self.epoch_batches

    def _time_step(self):
        if len(self._step_times) < 20:
            now = time.perf_counter()
            self._step_times.append(now - self._t_step)
            self._t_step = now

    def step_timing(self) -> dict:
        """``first_step_seconds`` and ``step_seconds`` (median of the next ones), for --compile's note, and
        with --compile ``dynamo``: what dynamo did this cell (``distnb.engine.strategies.compiling.report``)."""
        times = self._step_times
        dynamo = {} if self._dynamo is None else \
            dict(dynamo=compiling.report(self._dynamo, self._run.strategy.compiled_since))
        if not times:
            return dynamo
        later = sorted(times[1:])
        return dict(first_step_seconds=times[0], step_seconds=later[len(later) // 2] if later else times[0],
                    **dynamo)

    def save_checkpoint(self):
        """Save model, optimizer and position under --checkpoint-dir (a collective)."""
        meta = checkpoint.save(self._run, self.plan.checkpoint_dir, self.plan.to_dict(), self.plan.seed)
        self.checkpoints.append(meta["path"])
        self._saved_at = self._run.steps

    def final_checkpoint(self):
        """With --checkpoint-dir, save the cell's last step unless it was just saved (every rank calls it)."""
        if self.plan.checkpoint_dir and self._run.steps and getattr(self, "_saved_at", None) != self._run.steps:
            self.save_checkpoint()

    def _agree_on_stop(self):
        """All-reduce (max) of the stop flag and the step time, without waiting for it.

        The all-reduce started here is read at the next check (or epoch end), when it has long
        finished: every rank reads the same answer at the same step, so all stop after the same
        step (one check interval after the request), and training never stalls on a sync point
        of its own (a synchronous check cost a model with 50-ms steps several per cent).
        """
        now = time.perf_counter()
        per_step = (now - self._check_t0) / max(1, self.micro_steps - self._check_step0)
        asked = self._stop_reason_local is not None  # ctx.request_stop: a flag in this rank's slot names it
        flags = torch.tensor([1.0 if self._stop.requested else 0.0, per_step] +
                             [1.0 if asked and r == self.rank else 0.0 for r in range(self.world_size)],
                             dtype=torch.float64, device=group_device())
        pending = self._stop_work
        self._stop_work = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), flags)
        if pending is None:  # the first check since the last epoch end: read its answer at the next step
            self._check_at = self.micro_steps + 1
        else:
            stop, slowest = self._stop_answer(pending)
            self._check_at = self.micro_steps + max(1, min(10_000, math.ceil(STOP_CHECK_SECONDS / max(slowest, 1e-6))))
        self._check_t0, self._check_step0 = time.perf_counter(), self.micro_steps

    def _stop_answer(self, pending):
        """(stop, slowest step time) of a finished check; stops every rank here if one asked to."""
        work, flags = pending
        work.wait()
        stop, slowest, *asked = flags.tolist()
        ranks = [r for r, flag in enumerate(asked) if flag]
        if stop or ranks:
            if self._stop_work is not None and self._stop_work is not pending:
                self._stop_work[0].wait()  # the check just started: finished on every rank before leaving
            self._stop_work = None
            if stop:
                self.interrupted = True
            else:  # ctx.request_stop on some rank(s): the same ranks read here on every rank
                self.stopped_early, self.stop_reason = True, "requested"
                mine = self._stop_reason_local
                self.stop_request = dict(ranks=ranks, reason=mine[0] if mine else None,
                                         asked_at=mine[1] if mine else None, step=self.global_step)
            raise _Stopped()
        return stop, slowest

    def _settle_stop_check(self):
        """At an epoch end (every rank at the same step): read the check in flight, if any."""
        pending, self._stop_work = self._stop_work, None
        if pending is not None:
            self._stop_answer(pending)

    def _loss_sum(self) -> float:
        """The sum of this rank's step losses reported since the epoch began (the cell's, without ctx.epochs())."""
        floats = [v for v in self._losses if isinstance(v, float)]
        tensors = [v for v in self._losses if not isinstance(v, float)]
        return math.fsum(floats) + (float(torch.stack(tensors).double().sum()) if tensors else 0.0)

    def running_mean(self) -> tuple:
        """``(mean, steps)`` of this rank's step losses since the epoch began, for the dashboard: the mean is a float,
        or a 0-d tensor on the rank's device not read yet (the reporter reads it without waiting for the GPU,
        ``distnb.engine.transport.lazyread``). Only the losses reported since the last call are added (no re-summing)."""
        acc = self._running
        if acc[0] is not self._losses:  # a new epoch's list
            acc[:] = [self._losses, 0, 0.0, None]
        for v in self._losses[acc[1]:]:
            if isinstance(v, float):
                acc[2] += v
            else:
                acc[3] = v.double() if acc[3] is None else acc[3] + v.double()
        acc[1] = len(self._losses)
        if not self._loss_count:
            return math.nan, 0
        total = acc[2] if acc[3] is None else acc[3] + acc[2]
        return total / self._loss_weight, self._loss_count  # the weight: steps, or ctx.num_items summed

    def steps_mean(self) -> tuple:
        """``(mean, steps)``: this rank's mean loss over the steps it trained since the last epoch end (no collective).

        The figure of a cell that finished no epoch: interrupted in its first one, or a ``--loop`` body
        that never iterates :meth:`epochs` (then every step it reported). ``(nan, 0)`` when no step
        reported a loss (or every one was skipped, ``--nan skip``).
        """
        if not self._loss_count:
            return math.nan, 0
        return self._loss_sum() / float(self._loss_weight), self._loss_count

    def _epoch_mean(self):
        local = torch.zeros(2, dtype=torch.float64, device=group_device())
        if self._loss_count:
            local[0] = self._loss_sum()
            local[1] = self._loss_weight
        self.local_losses.append(float(local[0] / local[1]) if local[1] > 0 else math.nan)
        dist.all_reduce(local)
        return float(local[0] / local[1]) if local[1] > 0 else math.nan
