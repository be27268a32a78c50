"""The training loop that runs on every rank for a ``%%distrain`` cell.

State that lives between cells is kept here per name: the model (unwrapped module,
its strategy wrapper, the optimizer, the epoch count) in ``RUNS`` and each rank's
data shard in ``SHARDS`` (the tensor path); data sets loaded on the ranks through a
DataLoader are :mod:`distnb.engine.datasets`'s. The loop asks either for an epoch's
batches (``data.epoch(plan, epoch, skip, device)``) and ends its loader with the cell.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from ..plan import DEFAULT_LR, STRATEGIES, TrainPlan, redistribution
from . import checkpoint, collectives, datasets, runtime, shard as sharding, wire
from .report import Reporter
from . import strategies


class Shard:
    """This rank's part of a data set: columns of equal first dimension.

    ``structure`` is ``("tensor",)`` for one tensor, ``("tuple", k)`` for a k-tuple and
    ``("dict", keys)`` for a dict of tensors; a batch has the same structure.
    ``num_shards`` is the data-parallel size the set was cut for (world_size, or 1 when
    every rank trains on the same batches) and ``index`` the shard this rank holds.
    """

    def __init__(self, num_samples, num_shards, seed, index, structure, columns):
        self.num_samples, self.num_shards, self.seed, self.index = num_samples, num_shards, seed, index
        self.structure, self.columns = tuple(structure), columns

    def __len__(self):
        return len(self.columns[0])

    def batch(self, idx, device):
        if device.type == "cpu":
            cols = [c[idx] for c in self.columns]
        else:
            cols = [c[idx].to(device, non_blocking=True) for c in self.columns]
        kind = self.structure[0]
        if kind == "tensor":
            return cols[0]
        if kind == "dict":
            return dict(zip(self.structure[1], cols))
        return tuple(cols)

    def as_value(self):
        """The shard as the user gave it: tensor, tuple of tensors or dict."""
        return self.batch(slice(None), torch.device("cpu"))

    def steps_per_epoch(self, plan) -> int:
        sharding.check_sizes(self.num_samples, self.num_shards, plan.batch_size, plan.drop_last)
        return sharding.steps_per_epoch(self.num_samples, self.num_shards, plan.batch_size, plan.drop_last)

    def epoch_length(self, plan) -> int:
        return sharding.samples_per_epoch(self.num_samples, self.num_shards, plan.drop_last)

    def epoch(self, plan, epoch, skip, device):
        """Yield ``(samples, batch)`` per step of ``epoch``, starting ``skip`` samples in."""
        order = sharding.epoch_order(self.num_samples, self.num_shards, self.index, plan.seed, epoch, plan.drop_last)
        for idx in sharding.batches(order[skip:], plan.batch_size, plan.drop_last):
            yield len(idx), self.batch(idx, device)

    def close(self):
        """Nothing to end: the shard is plain tensors."""


class Run:
    """A model living on this rank between cells."""

    def __init__(self, module):
        self.module = module
        self.strategy = None  # a strategies.Strategy, rebuilt when the plan or process group changes
        self.generation = -1
        self.strategy_key = None
        self.optimizer = None
        self.optimizer_key = None
        self.epoch = 0
        self.epoch_step = 0  # steps done in the current (unfinished) epoch
        self.epoch_samples = 0  # positions of this rank's epoch order consumed: the sampler position
        self.steps = 0
        self.plan_dict = None  # the plan it was last trained with (recorded in checkpoints)
        self.forwards = 0  # calls of the strategy wrapper, to catch bodies that bypass it

    def count_forward(self, module, args):
        self.forwards += 1


RUNS: dict[str, Run] = {}
SHARDS: dict[str, Shard] = {}


def _drop_wrappers(ns):
    for run in RUNS.values():
        if run.strategy is not None:
            run.strategy.close()
        run.strategy = None
        run.generation = -1


runtime.RELEASE_HOOKS.append(_drop_wrappers)


def install_model(ns, name, payload, descs, *buffers):
    """Receive a model from the kernel; start a new Run (fresh optimizer, epoch 0)."""
    module = wire.loads(payload, descs, buffers)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{name} is a {type(module).__name__}, not a torch.nn.Module")
    module.to(runtime.STATE.device)
    old = RUNS.get(name)
    if old is not None and old.strategy is not None:
        old.strategy.close()  # the replaced model must not keep the process group referenced
    RUNS[name] = Run(module)
    ns[name] = module
    return sum(p.numel() for p in module.parameters())


def install_shard(ns, name, num_samples, num_shards, seed, index, structure, descs, *buffers):
    """Receive shard ``index`` (of ``num_shards``) of a data set and bind it to ``name`` in the engine.

    From shared memory the shard is mapped copy-on-write, not copied (it is read, not written).
    """
    columns = wire.receive(descs, buffers, mapped=True)
    old = datasets.SOURCES.pop(name, None)  # a data set of that name loaded on the ranks before
    if old is not None:
        old.close()
    SHARDS[name] = Shard(num_samples, num_shards, seed, index, structure, columns)
    ns[name] = SHARDS[name].as_value()
    return len(SHARDS[name])


def pull_state(name):
    """The model's full state as (keys, descriptions, sizes, flat uint8 array) on rank 0.

    Call on every rank: strategies that shard the model assemble it with collectives.
    Other ranks return None.
    """
    run = RUNS[name]
    if run.strategy is not None:
        return run.strategy.full_state()
    if runtime.STATE.rank != 0:
        return None
    if any(hasattr(p, "to_local") for p in run.module.parameters()):
        raise RuntimeError(f"{name} is sharded over a process group that was re-formed; its weights are "
                           "only in the kernel now")
    return wire.flatten_state(run.module.state_dict())


def _set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


def _optimizer(ns, run, plan):
    """The live optimizer, kept (with its state) unless --optimizer names a different one.

    Returns (optimizer, note): note says what changed ("" when nothing did).
    """
    if run.optimizer is not None and plan.optimizer in (None, run.optimizer_key):
        if plan.lr is not None and any(g["lr"] != plan.lr for g in run.optimizer.param_groups):
            _set_lr(run.optimizer, plan.lr)
            return run.optimizer, f"lr set to {plan.lr:g}"
        return run.optimizer, ""
    name = plan.optimizer or "sgd"
    params = list(run.strategy.parameters())
    lr = plan.lr if plan.lr is not None else plan.lr_if_new
    if name in DEFAULT_LR:
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
        optimizer = cls(params, lr=lr if lr is not None else DEFAULT_LR[name])
    else:
        factory = ns.get(name)
        if factory is None:
            raise NameError(f"optimizer {name!r} is not defined on rank {runtime.STATE.rank}")
        optimizer = factory(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"--optimizer {name} returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        if lr is not None:
            _set_lr(optimizer, lr)
    # a first optimizer was announced with the model ("fresh ... optimizer"); say only replacements
    note = f"new {name} optimizer (was {run.optimizer_key})" if run.optimizer is not None else ""
    run.optimizer, run.optimizer_key = run.strategy.wrap_optimizer(optimizer), name
    return run.optimizer, note


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


class Context:
    """What a ``%%distrain`` body sees as ``ctx``.

    Attributes
    ----------
    rank, world_size, local_rank : int
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
        Steps finished in this cell.
    steps_per_epoch : int
    loader : iterable
        Batches of this rank's shard for the current epoch (used with ``--loop``).
    """

    def __init__(self, plan, run, data, reporter, stop=None):
        st = runtime.STATE
        self.rank, self.world_size, self.local_rank, self.device = st.rank, st.world_size, st.local_rank, st.device
        self.plan, self.model, self.module, self.optimizer = plan, run.strategy.model, run.module, run.optimizer
        self.strategy = run.strategy
        self._run, self._data, self._reporter = run, data, reporter
        self.steps_per_epoch = data.steps_per_epoch(plan)
        self.epoch = run.epoch
        self.step = 0
        self.epoch_losses = []
        self.local_losses = []
        self.stopped_early = False
        self._losses = []
        self._loss_count = 0
        self._batch_samples = 0
        self._forwards_seen = run.forwards
        self._stop = stop or StopRequest()
        self._check_at = 1  # step count of the next stop check (the same on every rank)
        self._stop_work = None  # the stop check in flight: (work, flags)
        self._check_t0 = time.perf_counter()
        self._check_step0 = 0
        self.interrupted = False
        self.skipped_steps = 0  # steps dropped for a non-finite loss (--nan skip)
        self.skip = run.epoch_samples  # resume mid-epoch: samples of the first epoch already trained
        self.checkpoints = []

    @property
    def loader(self):
        skip, self.skip = self.skip, 0
        for self._batch_samples, batch in self._data.epoch(self.plan, self.epoch, skip, self.device):
            yield batch

    def epochs(self):
        """Yield epoch numbers; after each, all-reduce the mean loss and honour --target-loss."""
        first = self._run.epoch
        for epoch in range(first, first + self.plan.epochs):
            self.epoch = self._reporter.epoch = epoch
            self._losses, self._loss_count = [], 0
            yield epoch
            mean = self._epoch_mean()
            self.epoch_losses.append(mean)
            self._run.epoch, self._run.epoch_step, self._run.epoch_samples = epoch + 1, 0, 0
            self._reporter.end_epoch(epoch, mean)
            if self.plan.checkpoint_dir and self.plan.checkpoint_every is None:
                self.save_checkpoint()
            self._settle_stop_check()  # a stop asked for during the epoch lands here, after it
            if self.plan.target_loss is not None and mean <= self.plan.target_loss:
                self.stopped_early = True
                break

    def any_nonfinite(self, loss, value) -> bool:
        """True on every rank when the loss of this step is NaN or infinite on any rank."""
        bad = (not math.isfinite(value)) if value is not None else bool((~torch.isfinite(loss.detach())).item())
        flag = torch.tensor([1.0 if bad else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def report(self, loss, num_samples=None, value=None, skipped=False):
        """Record one finished step (loss: scalar tensor; num_samples: default the last batch size).

        ``value`` is ``float(loss)`` when the caller has it already.

        Raises if the step never called ``model`` (the strategy wrapper): calling the
        unwrapped module (e.g. by its notebook name) skips the gradient all-reduce and the
        replicas silently diverge.
        """
        if self.strategy.wraps_model and self._run.forwards == self._forwards_seen:
            raise RuntimeError(
                f"rank {self.rank}, epoch {self.epoch}, step {self.step}: the step never called `model`, "
                "the DistributedDataParallel-wrapped model; calling the notebook's model directly (e.g. "
                "`net(x)`) skips the gradient all-reduce and the ranks diverge. Use `model(x)` in the body")
        self._forwards_seen = self._run.forwards
        detached = loss.detach()
        if skipped:
            self.skipped_steps += 1
        else:  # a float when the step already read it (CPU); a tensor otherwise, summed per epoch (no GPU sync)
            self._losses.append(detached if value is None else value)
            self._loss_count += 1
        self.step += 1
        self._run.steps += 1
        self._run.epoch_step += 1
        self._run.epoch_samples += self._batch_samples
        self._reporter.record(detached, self._batch_samples if num_samples is None else num_samples)
        every = self.plan.checkpoint_every
        if every and self.plan.checkpoint_dir and self._run.steps % every == 0:
            self.save_checkpoint()  # at a global step count every rank shares
        if self.step >= self._check_at:
            self._agree_on_stop()

    def save_checkpoint(self):
        """Save model, optimizer and position under --checkpoint-dir (a collective)."""
        meta = checkpoint.save(self._run, self.plan.checkpoint_dir, self.plan.to_dict(), self.plan.seed)
        self.checkpoints.append(meta["path"])

    def _agree_on_stop(self):
        """All-reduce (max) of the stop flag and the step time, without waiting for it.

        The all-reduce started here is read at the next check (or epoch end), when it has long
        finished: every rank reads the same answer at the same step, so all stop after the same
        step (one check interval after the request), and training never stalls on a sync point
        of its own (a synchronous check cost a model with 50-ms steps several per cent).
        """
        now = time.perf_counter()
        per_step = (now - self._check_t0) / max(1, self.step - self._check_step0)
        flags = torch.tensor([1.0 if self._stop.requested else 0.0, per_step], dtype=torch.float64,
                             device=self.device)
        pending = self._stop_work
        self._stop_work = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), flags)
        if pending is None:  # the first check since the last epoch end: read its answer at the next step
            self._check_at = self.step + 1
        else:
            stop, slowest = self._stop_answer(pending)
            self._check_at = self.step + max(1, min(10_000, math.ceil(STOP_CHECK_SECONDS / max(slowest, 1e-6))))
        self._check_t0, self._check_step0 = time.perf_counter(), self.step

    def _stop_answer(self, pending):
        """(stop, slowest step time) of a finished check; stops every rank here if one asked to."""
        work, flags = pending
        work.wait()
        stop, slowest = flags.tolist()
        if stop:
            if self._stop_work is not None and self._stop_work is not pending:
                self._stop_work[0].wait()  # the check just started: finished on every rank before leaving
            self._stop_work = None
            self.interrupted = True
            raise _Stopped()
        return stop, slowest

    def _settle_stop_check(self):
        """At an epoch end (every rank at the same step): read the check in flight, if any."""
        pending, self._stop_work = self._stop_work, None
        if pending is not None:
            self._stop_answer(pending)

    def _epoch_mean(self):
        local = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self._loss_count:
            floats = [v for v in self._losses if isinstance(v, float)]
            tensors = [v for v in self._losses if not isinstance(v, float)]
            total = math.fsum(floats) + (float(torch.stack(tensors).double().sum()) if tensors else 0.0)
            local[0] = total
            local[1] = self._loss_count
        self.local_losses.append(float(local[0] / local[1]) if local[1] > 0 else math.nan)
        dist.all_reduce(local)
        return float(local[0] / local[1]) if local[1] > 0 else math.nan


def _steps(ns, code, ctx):
    optimizer, step = ctx.optimizer, ctx.strategy.step
    for _ in ctx.epochs():
        for batch in ctx.loader:
            optimizer.zero_grad(set_to_none=True)
            ns["batch"] = batch
            loss, value = step(ns, code, ctx)
            if ctx.plan.nan == "skip" and ctx.any_nonfinite(loss, value):
                optimizer.zero_grad(set_to_none=True)  # drop the step on every rank
                ctx.report(loss, value=value, skipped=True)
                continue
            optimizer.step()
            ctx.report(loss, value=value)


def _run_body(ns, code, ctx, plan):
    if plan.loop:
        exec(code, ns)
        if ctx.step == 0:
            raise ValueError("the --loop body ran no step: drive it with `for epoch in ctx.epochs():` / "
                             "`for batch in ctx.loader:` and call `ctx.report(loss)` after each step")
    else:
        _steps(ns, code, ctx)


def train(ns, plan_dict, code_text):
    """Run one ``%%distrain`` cell on this rank; returns this rank's figures (dict)."""
    plan = TrainPlan.from_dict(plan_dict)
    st = runtime.STATE
    if st.broken:
        raise RuntimeError(f"rank {st.rank}: the process group is broken; the kernel must re-form it")
    run = RUNS.get(plan.model)
    data = datasets.SOURCES.get(plan.data) or SHARDS.get(plan.data)
    if run is None or data is None:
        raise RuntimeError(f"rank {st.rank}: model {plan.model!r} or data {plan.data!r} was not sent")
    steps = data.steps_per_epoch(plan)
    reporter = Reporter(st.rank, steps * plan.epochs, plan.epochs, interval=plan.report_interval)
    code = runtime.compile_cell(code_text, "distrain")
    stop = StopRequest().__enter__()
    try:
        note, resumed = _prepare(ns, plan, run)
        if run.epoch_samples:  # stopped after an epoch's last batch, before its end (or a stream): it is done
            left = (data.epoch_length(plan) or 0) - run.epoch_samples
            if left <= 0 or (plan.drop_last and left < plan.batch_size):
                run.epoch, run.epoch_step, run.epoch_samples = run.epoch + 1, 0, 0
        run.plan_dict = plan.to_dict()
        reporter.extra.update(run.strategy.holdings())
        ctx = Context(plan, run, data, reporter, stop=stop)
        reporter.total = steps * plan.epochs - math.ceil(ctx.skip / plan.batch_size)
        continued = dict(epoch=run.epoch, samples=ctx.skip) if ctx.skip else None
        ns.update(model=run.strategy.model, optimizer=run.optimizer, ctx=ctx)
        run.module.train()
        reporter.set_status("running")
        t0 = time.perf_counter()
        try:
            with collectives.checked():  # a mismatched collective in the body: an error, not a hang
                _run_body(ns, code, ctx, plan)
        except _Stopped:
            pass
        seconds = time.perf_counter() - t0
    except BaseException as exc:
        if "find_unused_parameters=True" in str(exc) and not plan.find_unused_parameters and exc.args:
            exc.args = (f"{exc.args[0]}\n[distnb] some parameters got no gradient: run the cell with "
                        "--find-unused-parameters",) + exc.args[1:]
        datasets.explain(exc)  # a DataLoader worker that died, a full /dev/shm
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        reporter.set_status(status, error=f"{type(exc).__name__}: {exc}"[:300], failed_at=time.time())
        runtime.clear_exception_frames(exc)  # frames must not keep the DDP wrapper alive
        ctx = None
        runtime.mark_broken(ns)
        raise
    finally:
        stop.__exit__()
        data.close()  # DataLoader workers end with the cell, however it ends
        sys.stdout.flush()
    reporter.set_status("interrupted" if ctx.interrupted else "done")
    state = run.strategy.full_state()  # a collective for sharded strategies: every rank calls it
    last = ctx.local_losses[-1] if ctx.local_losses else math.nan
    return dict(rank=st.rank, steps=ctx.step, samples=reporter.samples, seconds=seconds,
                samples_per_s=reporter.samples / seconds if seconds > 0 else 0.0,
                final_loss=last, epoch_losses=list(ctx.epoch_losses),
                first_epoch=run.epoch - len(ctx.epoch_losses), next_epoch=run.epoch,
                stopped_early=ctx.stopped_early, steps_per_epoch=steps, note=note, interrupted=ctx.interrupted,
                where=dict(epoch=run.epoch, step=run.epoch_step), holdings=run.strategy.holdings(), state=state,
                resumed=resumed, continued=continued, checkpoints=ctx.checkpoints, skipped_steps=ctx.skipped_steps)


def _prepare(ns, plan, run):
    """Build (or keep) ``run``'s strategy and optimizer for ``plan``; resume from a checkpoint.

    Returns (note, resumed): what changed about the optimizer, and the checkpoint path
    resumed from (None). A model just received (no optimizer yet) with --checkpoint-dir
    holding a checkpoint resumes from its newest one, unless --reset.
    """
    st = runtime.STATE
    fresh = run.optimizer is None and run.steps == 0
    key = plan.strategy_key()
    last = None if run.strategy_key is None else (run.strategy_key, run.generation)
    verdict = redistribution(last, key, st.generation)
    if verdict == "resend":
        raise RuntimeError(f"rank {st.rank}: {plan.model} was distributed for --strategy "
                           f"{run.strategy_key[0]}; the kernel must send it again (--reset)")
    if verdict == "rebuild" or run.strategy is None:
        if run.strategy is not None:
            run.strategy.close()
        run.strategy = strategies.build(run.module, plan, st.device, ns)
        if run.strategy.wraps_model:
            run.strategy.model.register_forward_pre_hook(run.count_forward)
        if run.optimizer is not None and run.strategy_key is not None and run.strategy_key != key:
            run.optimizer = None  # its parameters belong to the old distribution
        run.generation, run.strategy_key = st.generation, key
    meta = None
    if fresh and plan.checkpoint_dir and not plan.reset and checkpoint.latest(plan.checkpoint_dir):
        meta = checkpoint.read_meta(plan.checkpoint_dir)
        if plan.optimizer is None:  # the optimizer the checkpoint was saved with (its lr comes back with it)
            plan = dataclasses.replace(plan, optimizer=meta["optimizer"])
    _, note = _optimizer(ns, run, plan)
    if meta is None:
        return note, None
    checkpoint.load(run, meta)
    return note, meta["path"]


def save_checkpoint(ns, name, directory):
    """``%dist save``: checkpoint model ``name`` (strategy, optimizer, position) on every rank."""
    run = RUNS.get(name)
    if run is None:
        raise RuntimeError(f"rank {runtime.STATE.rank}: no model {name!r} on the ranks; train it first")
    plan = run.plan_dict
    if plan is None:
        raise RuntimeError(f"rank {runtime.STATE.rank}: {name} has not been trained yet; nothing to save")
    if run.strategy is None:  # dropped with the process group after a failed cell
        if STRATEGIES[plan["strategy"]][1]:  # sharded in place: that copy went with the group
            raise RuntimeError(f"rank {runtime.STATE.rank}: the ranks' {plan['strategy']} copy of {name} was lost "
                               "with the failed cell; the notebook's model holds the last weights (train a cell, "
                               "then save)")
        _prepare(ns, TrainPlan.from_dict(plan), run)  # the same distribution on the re-formed group
    return checkpoint.save(run, directory, plan, plan["seed"])


def restore(ns, name, directory):
    """``%dist load``: rebuild the strategy and optimizer the checkpoint was saved with and load it.

    The model must have been sent (install_model) just before. Returns the checkpoint metadata.
    """
    meta = checkpoint.read_meta(directory)
    plan_dict = dict(meta["plan"], model=name, checkpoint_dir=None, checkpoint_every=None, reset=False,
                     optimizer=meta["optimizer"])
    plan = TrainPlan.from_dict(plan_dict)
    run = RUNS[name]
    _prepare(ns, plan, run)
    run.plan_dict = plan.to_dict()
    checkpoint.load(run, meta)
    return meta
