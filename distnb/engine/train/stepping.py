"""The optimizer step of a training cell on one rank: accumulation, precision, clipping, the lr schedule.

A cell's batches are *micro-steps* (one forward and backward each); every ``--accumulate N``
consecutive micro-steps of an epoch form one *optimizer step* (the last group of an epoch may
be shorter: an epoch always ends with an optimizer step). :class:`Stepper` runs them:

- **accumulation**: each micro-step's loss (a batch mean) is scaled by its batch's share of the
  group's samples before backward (``1 / group size`` when the batches are full), so the summed
  gradients are the mean over the group's samples, the epoch's short last batch weighted by what it
  holds (2 ranks x batch B x N equals one process on the global batch 2*B*N, the epoch's last
  one included; a stream's batch sizes are not known ahead, so there every batch counts the same).
  On the first N-1 micro-steps the strategy skips its
  gradient reduction (``Strategy.no_sync``: DDP's ``no_sync()``, FSDP2's
  ``set_requires_gradient_sync(False)``); the last one reduces the sum.
- **precision**: the body's forward and loss run under ``torch.autocast`` (bf16/fp16);
  fp16 scales the loss with ``torch.amp.GradScaler`` (``"cuda"`` or ``"cpu"``), unscaled before
  clipping; the ranks skip a step and back off the scale together (an all-reduce of the found-inf
  flags, so the scale stays the same on every rank). bf16 runs without loss scaling (it has
  fp32's exponent range).
  Parameters and optimizer state stay fp32.
- **hooks**: callables the body registered with ``ctx.after_backward(fn)`` during the group's
  last micro-step run once the gradients are complete (reduced and unscaled), before clipping.
- **clipping**: the total gradient norm over the *whole* model (:func:`total_norm`: DTensor
  shards of fsdp and tensor summed over the mesh, pipeline stages summed over the ranks) is
  computed, reported (``grad_norm``) and the gradients scaled to at most ``--clip-grad-norm``,
  with ``torch.nn.utils.clip_grad_norm_``'s coefficient ``max_norm / (norm + 1e-6)``.
- **schedule**: ``--lr-schedule`` (cosine, linear, constant after ``--warmup-steps``, or a
  notebook ``f(optimizer, total_steps)``) is an ``LRScheduler`` stepped after each optimizer
  step; it lives on the :class:`~distnb.engine.train.loop.Run` between cells and in checkpoints.

Histories (:class:`History`, bounded) of the lr and the pre-clip norm per optimizer step go
back in the cell's result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import types

import torch
import torch.distributed as dist

from distnb.engine.process import collectives
from distnb.engine.train import weighting
from distnb.engine.transport import lazyread

#: Points a history keeps at most before halving (pairs averaged): long runs cost the same.
HISTORY_POINTS = 1000


def upcast(value):
    """``value`` as fp32 when it is a floating tensor of fewer bits (bf16, fp16), else unchanged: the figures
    distnb reduces and logs (losses, their means and histories) are fp32 or wider."""
    return value.float() if is_low_precision(value) else value


def is_low_precision(value) -> bool:
    """Whether ``value`` is a floating tensor of fewer than 32 bits (bf16, fp16)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.element_size() < 4


class History:
    """(step, value) points, at most ``2 * cap``: past that, consecutive pairs are averaged.

    ``values`` may be floats or 0-d tensors (a GPU loss is read only at the end, in :meth:`points`); a tensor of a
    low-precision dtype (bf16, fp16) is kept and averaged as fp32, never summed in its own precision.
    """

    def __init__(self, cap=HISTORY_POINTS):
        self.cap = cap
        self.steps, self.values = [], []
        self.stride = 1  # how many raw points each kept point stands for
        self._pending = None  # (step, sum, count) of the pair being formed at stride > 1

    def add(self, step, value) -> None:
        value = upcast(value)
        if self.stride > 1:
            if self._pending is None:
                self._pending = (step, value, 1)
            else:
                s, total, n = self._pending
                total, n = total + value, n + 1
                self._pending = (s, total, n) if n < self.stride else None
                if n == self.stride:
                    self._append(step, total / n)
            return
        self._append(step, value)

    def _append(self, step, value) -> None:
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) > 2 * self.cap:
            self.steps = self.steps[1::2]
            self.values = [(a + b) / 2 for a, b in zip(self.values[0::2], self.values[1::2])]
            self.stride *= 2

    def points(self) -> list:
        """``[(step, float)]`` (the partial group at the end included)."""
        steps, values = list(self.steps), list(self.values)
        if self._pending is not None:
            s, total, n = self._pending
            steps.append(s)
            values.append(total / n)
        floats = [float(v) for v in values]
        return [(int(s), v) for s, v in zip(steps, floats)]


# -- learning-rate schedules --------------------------------------------------------------
class Schedule:
    """The factor of the built-in ``--lr-schedule`` at optimizer step ``s`` (0-based), as a picklable object.

    ``warmup`` steps rise linearly to 1 (``(s + 1) / (warmup + 1)``), then ``cosine`` falls as
    ``0.5 * (1 + cos(pi * p))``, ``linear`` as ``1 - p``, ``constant`` stays 1, with
    ``p = (s - warmup) / (total - warmup)``, clamped to 1 past ``total`` (the factor stays 0).
    ``LambdaLR.state_dict`` keeps this object's attributes, so a checkpoint restores it.
    """

    def __init__(self, kind: str, warmup: int, total: int):
        self.kind, self.warmup, self.total = kind, int(warmup), int(total)

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return 1.0
        p = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * p)) if self.kind == "cosine" else 1.0 - p


def lr_sequence(kind: str, base_lr: float, warmup: int, total: int) -> list:
    """The lr of each of ``total`` optimizer steps under a built-in schedule (for tests and docs)."""
    f = Schedule(kind, warmup, total)
    return [base_lr * f(s) for s in range(total)]


def make_scheduler(plan, optimizer, total_steps: int, ns: dict):
    """A new ``LRScheduler`` for ``plan.lr_schedule`` over ``total_steps`` optimizer steps."""
    from torch.optim.lr_scheduler import LambdaLR, LRScheduler

    for group in optimizer.param_groups:  # the schedule scales the lr the optimizer has now
        group["initial_lr"] = group["lr"]
    name = plan.lr_schedule
    if name in ("cosine", "linear", "constant"):
        return LambdaLR(optimizer, Schedule(name, plan.warmup_steps, total_steps))
    factory = ns.get(name)
    if not callable(factory):
        raise NameError(f"--lr-schedule {name!r} is not a function on this rank")
    scheduler = factory(optimizer, total_steps)
    if not isinstance(scheduler, LRScheduler):
        raise TypeError(f"--lr-schedule {name} returned {type(scheduler).__name__}, not a "
                        "torch.optim.lr_scheduler.LRScheduler (f(optimizer, total_steps) -> scheduler)")
    return scheduler


def scheduler_state(run) -> dict | None:
    """What a checkpoint records of ``run``'s live schedule (JSON-safe), or None."""

    if run.scheduler is None:
        return None
    state = {}
    for key, value in run.scheduler.state_dict().items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        state[key] = value
    return dict(name=run.schedule_name, total=run.schedule_total, state=state)


def load_scheduler(run, saved, ns) -> None:
    """Rebuild ``run``'s schedule from :func:`scheduler_state` (None: no schedule)."""

    run.scheduler = run.schedule_name = None
    if not saved:
        return
    plan = types.SimpleNamespace(lr_schedule=saved["name"], warmup_steps=0)
    run.scheduler = make_scheduler(plan, run.optimizer, saved["total"], ns)
    run.scheduler.load_state_dict(saved["state"])
    run.schedule_name, run.schedule_total = saved["name"], saved["total"]


def adopt_optimizer(ns: dict, run, plan, make_optimizer) -> None:
    """On a rank added by ``%dist scale``, at the model's first cell: rank 0's optimizer and schedule, with their state.

    ``make_optimizer(ns, run, plan)`` builds an optimizer for ``run`` (:func:`distnb.engine.train.loop._optimizer`).
    A cell that names another optimizer gets a new one, as the surviving ranks do.
    """

    held, run.inherited = run.inherited, None
    key = held["optimizer_key"]
    if key is None or plan.optimizer not in (None, key):
        return
    make_optimizer(ns, run, dataclasses.replace(plan, optimizer=key, lr=None))
    load_scheduler(run, held["scheduler"], ns)  # before the optimizer's state: it sets initial_lr
    run.optimizer.load_state_dict(held["optimizer"])


def _lr_at_position(scheduler) -> None:
    """Set the optimizer's lr to what ``scheduler`` gives at the step it has reached, from its (new) ``base_lrs``.

    A cell's ``--lr`` on a live (or resumed) schedule becomes the schedule's base; without this the
    cell's first optimizer step ran at that base itself (a cosine at 0.0015 stepped once at 0.01)
    and only the next at the schedule's value. A closed form is needed (``LambdaLR``, the built-in
    schedules, and torch's schedulers that have one); others keep the lr until their next step.
    """
    from torch.optim.lr_scheduler import LambdaLR

    if isinstance(scheduler, LambdaLR):
        lrs = [base * f(scheduler.last_epoch) for f, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    elif hasattr(scheduler, "_get_closed_form_lr"):
        lrs = scheduler._get_closed_form_lr()
    else:
        return
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)


def prepare_schedule(plan, run, total_steps: int, ns: dict, lr_given: bool) -> str:
    """A new schedule when the cell names one, else the live one (kept); returns a note ("" if none)."""
    if plan.lr_schedule is not None:
        old = run.scheduler
        if old is not None and not lr_given and getattr(old, "optimizer", None) is run.optimizer:
            for group, base in zip(run.optimizer.param_groups, old.base_lrs):
                group["lr"] = base  # a new schedule starts from the lr the last one started from, not where it ended
        run.scheduler = make_scheduler(plan, run.optimizer, total_steps, ns)
        run.schedule_name, run.schedule_total = plan.lr_schedule, total_steps
        return ""
    if run.scheduler is None:
        return ""
    if getattr(run.scheduler, "optimizer", None) is not run.optimizer:
        run.scheduler = run.schedule_name = None  # it drove an optimizer that was replaced
        return ""
    if lr_given and run.scheduler.last_epoch >= run.schedule_total:
        run.scheduler = run.schedule_name = None  # --lr after a schedule that has run out: that lr, unscheduled
        return ""
    if lr_given:
        run.scheduler.base_lrs = [g["lr"] for g in run.optimizer.param_groups]
        _lr_at_position(run.scheduler)
    if run.scheduler.last_epoch >= run.schedule_total:
        return (f"the --lr-schedule {run.schedule_name} of an earlier cell has taken the {run.schedule_total} steps "
                f"it was made for and goes on stepping from there (lr {run.optimizer.param_groups[0]['lr']:.3g}); "
                "pass --lr-schedule again for a new one")
    return ""


# -- gradient norm --------------------------------------------------------------------------
def _share(t, world_size: int):
    """How much of a DTensor's squared local norm this rank adds to the all-ranks sum, or None: count it once.

    A DTensor on mesh ``M`` is held ``world_size / M.size()`` times over the world (a 2-D
    strategy's whole layers live on its ``dp`` sub-mesh, repeated in every tensor-parallel
    column), and within ``M`` each local piece ``R`` times (``R``: the product of the sizes of
    the dimensions it is ``Replicate`` on). So every rank adds ``M.size() / (world_size * R)``
    of its local square; 1 for a tensor sharded over all ranks (fsdp). None when the tensor
    is whole on every rank (replicated over a mesh of all ranks, a ``Shard`` only on dimensions
    of size 1, as ``--mesh 1xN``'s dp): it counts once, locally.
    """
    mesh = t.device_mesh
    size, copies = mesh.size(), 1
    for dim, pl in enumerate(t.placements):
        if pl.is_replicate():
            copies *= mesh.size(dim)
    if copies == size == world_size:
        return None
    return size / (world_size * copies)


def total_norm(params, partitioned: bool, device) -> float:
    """The 2-norm of the gradients of the whole model, of which this rank holds ``params``' part.

    DTensor gradients sharded over a mesh (fsdp, tensor, fsdp+tensor) add their local squares
    over the ranks, each weighted by :func:`_share` of its parameter's placements so that a
    piece held by several ranks counts once (a ``Partial`` gradient is first reduced to its
    parameter's layout); whole ones (DTensor whole on every rank, or plain tensors of ddp and
    tensor) count once. With ``partitioned`` (pipeline: every rank holds other parameters),
    plain tensors add over the ranks too. A collective whenever anything is summed: every
    rank calls it.
    """
    summed = torch.zeros((), dtype=torch.float64, device=device)
    once = torch.zeros((), dtype=torch.float64, device=device)
    any_sharded = partitioned
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    for p in params:
        share = _share(p, world_size) if hasattr(p, "placements") else None
        any_sharded |= share is not None  # decided by the parameters, the same on every rank, never by grads
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local"):
            if hasattr(p, "placements") and any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(p.device_mesh, p.placements)  # pending sums: a local square of them is no norm
            local = g.to_local().detach().double().pow(2).sum().to(device)
            # the share is the parameter's, never guessed from a Shard of the grad: on --mesh 1xN a
            # row-wise bias is (Shard(0) over a dp of 1, Replicate over tp), whole on every rank
            if share is None:
                once += local
            else:
                summed += local if share == 1 else local * share
        elif partitioned:
            summed += g.detach().double().pow(2).sum().to(device)
        else:
            once += g.detach().double().pow(2).sum().to(device)
    if any_sharded and dist.is_initialized():
        dist.all_reduce(summed)  # group device: `device`, the rank's (the gradients')
    return (summed + once).sqrt()  # a float64 0-d tensor on ``device``: not read here (no GPU sync)


def clip_(params, max_norm: float, norm) -> None:
    """Scale the gradients by ``torch.nn.utils.clip_grad_norm_``'s clamped coefficient.

    ``norm`` is :func:`total_norm`'s tensor: the coefficient ``min(1, max_norm / (norm + 1e-6))``
    (1 for a non-finite norm: the gradients are left as they are) is computed on its device and
    multiplied in with ``torch._foreach_mul_`` per device and mesh, as torch's own clipping does, without a
    host read (GPU review, finding 8). A coefficient of 1 multiplies exactly.
    """
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    groups = {}  # one foreach per device and DTensor mesh (a foreach over several meshes is refused)
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.device, getattr(p.grad, "device_mesh", None)), []).append(p.grad)
    with torch.no_grad():
        for (device, _), grads in groups.items():
            torch._foreach_mul_(grads, coef.to(device))


#: A step body that ran backward itself (the same on every rank: the RankError names the ranks)
BODY_BACKWARD = ("the %%distrain body ran backward itself (`loss.backward()`): distnb runs the backward pass "
                 "(with the gradient all-reduce), the optimizer step and zero_grad after the body, so the "
                 "gradients would be computed twice. Remove that line and only set `loss`, or pass --loop to "
                 "write the whole loop yourself")
#: A backward into a graph an earlier backward freed, the body's own backward ruled out (its gradients were None)
GRAPH_FREED = ("the loss depends on a tensor kept from an earlier step (a hidden state or running value carried "
               "between batches, as in truncated backpropagation through time), whose graph that step's backward "
               "freed: `.detach()` it where it is carried over")


# -- the step -----------------------------------------------------------------------------
class Stepper:
    """Runs the micro-steps and optimizer steps of one cell on this rank.

    Parameters
    ----------
    plan : distnb.core.plan.TrainPlan
    run : distnb.engine.train.loop.Run
        Model, strategy, optimizer, schedule and scaler (kept between cells).
    steps_per_epoch : int
        Micro-steps per epoch (the same on every rank).
    """

    def __init__(self, plan, run, steps_per_epoch: int, device):
        self.plan, self.run, self.device = plan, run, device
        self.strategy, self.optimizer = run.strategy, run.optimizer
        self.accumulate = plan.accumulate
        self.steps_per_epoch = steps_per_epoch
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)
        self.scaler = None
        if plan.precision == "fp16":
            if run.scaler is None:
                run.scaler = torch.amp.GradScaler(device.type)
            self.scaler = run.scaler
        self.optimizer_steps = 0
        self.lrs, self.grad_norms = History(), History()
        self._norm_reading = lazyread.Latest()  # --clip-grad-norm's norm, read without a sync per step
        self.skipped_groups = 0
        self.scaler_skips = 0  # fp16: optimizer steps the GradScaler skipped (inf/NaN gradients), its scale halved
        self.groups_done = 0  # optimizer steps of this cell, applied or dropped by --nan skip (ctx.step)
        self.skipped = []  # per group dropped by --nan skip: dict(step, micro_steps, ranks)
        self._bad_ranks = set()  # the ranks whose loss was not finite in the group in progress
        self.items = weighting.ItemCount(device)  # ctx.num_items: the token-weighted normalisation
        if plan.strategy in weighting.UNSUPPORTED:  # refused there (ctx.num_items's setter): no agreement to make
            self.items.weighted = False
        self._after = []  # hooks the body registered in this micro-step
        self._group_bad = False
        self.scale = 1.0  # the loss scale of the micro-step in progress (its share of the group's samples)
        self._first = False  # the micro-step in progress opens its group (its gradients were set to None)
        self._last = False  # ... and closes it
        self._nulled = None  # the parameters whose gradients the group's zero_grad set to None (found once)

    @staticmethod
    def groups_per_epoch(steps_per_epoch: int, accumulate: int) -> int:
        return -(-steps_per_epoch // accumulate)

    def position(self, index: int, batches: int) -> tuple:
        """(first, last, size) of the group of the micro-step at ``index`` (0-based) of an epoch of ``batches``."""
        n = self.accumulate
        start = index - index % n
        size = max(1, min(n, batches - start))
        return index == start, index == start + size - 1, size

    def share(self, index: int, batches: int, samples=None) -> float:
        """The loss scale of micro-step ``index`` of an epoch of ``batches``: its share of its group's samples.

        ``samples``: what the epoch's ``batches`` hold in all (full ``--batch-size`` batches but the
        last); None (a stream) counts every batch the same, ``1 / group size``.
        """
        _, _, size = self.position(index, batches)
        full = self.plan.batch_size
        tail = None if samples is None else samples - (batches - 1) * full  # the last batch's samples
        if tail is None or not 0 < tail < full:
            return 1.0 / size
        start = index - index % self.accumulate
        counts = [tail if j == batches - 1 else full for j in range(start, start + size)]
        return counts[index - start] / sum(counts)

    def at_boundary(self, done: int, batches: int) -> bool:
        """True when ``done`` micro-steps of an epoch of ``batches`` end an optimizer step (or none ran)."""
        return done % self.accumulate == 0 or done >= batches

    def autocast(self):
        """The autocast context of the forward and the loss (nothing for fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss, num_items=None) -> None:
        """Back-propagate this micro-step's share of the loss (scaled for accumulation and fp16).

        ``num_items``: the body's ``ctx.num_items`` as a float64 0-d tensor (its loss is a sum over
        that many items): the sum is back-propagated unscaled, and the group's end divides the
        gradients by the global count (:class:`distnb.engine.train.weighting.ItemCount`).

        A body that ran backward itself (``loss.backward()``) is an error naming the fix: torch's own
        error says nothing of distnb, and with ``retain_graph=True`` the gradients were silently doubled.
        """
        if self._first and self._nulled and any(p.grad is not None for p in self._nulled):
            raise RuntimeError(BODY_BACKWARD)
        if num_items is not None:
            self.items.add(num_items)
            if self._last:  # the group's count is complete on this rank: its all-reduce overlaps the backward
                self.items.start(dist.get_world_size() if dist.is_initialized() else 1)
            scaled = loss
        else:
            self.items.missing()
            scaled = loss * self.scale if self.scale != 1.0 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        try:
            scaled.backward()
        except RuntimeError as exc:
            if "backward through the graph a second time" not in str(exc):
                raise
            if self._first and self._nulled:  # the check above found no gradients: not the body's own backward
                raise RuntimeError(GRAPH_FREED) from exc
            raise RuntimeError(f"{GRAPH_FREED}; or {BODY_BACKWARD}") from exc

    def scale_loss(self, loss):
        """The loss as :meth:`backward` would back-propagate it (for strategies that call backward themselves)."""
        scaled = loss * self.scale if self.scale != 1.0 else loss
        return self.scaler.scale(scaled) if self.scaler is not None else scaled

    def after_backward(self, fn) -> None:
        if not callable(fn):
            raise TypeError(f"ctx.after_backward takes a function of no arguments, got {type(fn).__name__}")
        self._after.append(fn)

    def micro_step(self, ns, code, ctx, index: int, batches: int):
        """One forward and backward (the strategy's step) of micro-step ``index`` of ``batches``; (loss, value)."""
        collectives.PROGRESS[0] += 1  # the rank moves on: a watchdog look at the same line is a new visit
        first, last, _ = self.position(index, batches)
        if first:
            self.optimizer.zero_grad(set_to_none=True)
            self._group_bad = False
            if self._nulled is None:  # an optimizer whose zero_grad leaves tensors (zeros) is not checked
                # the model's own parameters, which only backward fills (a parameter server's optimizer holds
                # server copies, which its exchange thread gives gradients at any time)
                params = list(self.strategy.module.parameters())
                self._nulled = [p for p in params if p.requires_grad] if all(p.grad is None for p in params) else []
        self._first, self._last = first, last
        self.scale = self.share(index, batches, getattr(ctx, "epoch_samples", None))
        self._after = []
        ctx._clear_items()  # the body sets ctx.num_items anew on every micro-step
        sync = contextlib.nullcontext() if last else self.strategy.no_sync()
        with sync:
            return self.strategy.step(ns, code, ctx)

    def finish_micro(self, index: int, batches: int, bad: bool) -> bool:
        """After micro-step ``index`` of ``batches``: the optimizer step at the group's end.

        ``bad``: its loss was not finite on some rank (``--nan skip``): the whole group is
        dropped on every rank. Returns True when an optimizer step was applied.
        """
        self._group_bad |= bool(bad)
        self._bad_ranks.update(bad or ())
        _, last, size = self.position(index, batches)
        if not last:
            return False
        self.groups_done += 1
        if self._group_bad:
            self.optimizer.zero_grad(set_to_none=True)
            self.items.drop_group()
            self.skipped_groups += 1
            micro = self.run.steps + 1  # this micro-step's number (the model's count; ctx.report adds it next)
            self.skipped.append(dict(step=self.groups_done, micro_steps=[micro - size + 1, micro],
                                     ranks=sorted(self._bad_ranks)))
            self._bad_ranks = set()
            return False
        self.optimizer_step()
        return True

    def optimizer_step(self) -> None:
        opt, scaler = self.optimizer, self.scaler
        if self.optimizer_steps == 0:
            self.strategy.check_grads()
        if scaler is not None:
            scaler.unscale_(opt)
            self._agree_on_inf()  # one tiny all-reduce: the scale stays the same on every rank, whatever the strategy
        self.items.finish_group([p for p in self.strategy.module.parameters() if p.requires_grad],
                                dist.get_world_size() if dist.is_initialized() else 1)
        for fn in self._after:
            fn()
        self._after = []
        if self.plan.clip_grad_norm is not None:
            params = [p for p in self.strategy.module.parameters() if p.requires_grad]  # this rank's part
            norm = total_norm(params, self.strategy.grads_partitioned, self.device)
            clip_(params, self.plan.clip_grad_norm, norm)
            self._norm_reading.offer(norm)  # read without waiting: last_norm
            self.grad_norms.add(self.run.optimizer_steps + 1, norm)  # read at the cell's end (History.points)
        self.lrs.add(self.run.optimizer_steps + 1, float(opt.param_groups[0]["lr"]))
        if scaler is not None:
            before = getattr(scaler, "_scale", None)  # the scale tensor (read as a tensor: no GPU sync per step)
            before = before.clone() if isinstance(before, torch.Tensor) else None
            scaler.step(opt)  # skipped (on every rank alike) when a gradient is inf/NaN: the scale then backs off
            scaler.update()
            if before is not None:
                self.scaler_skips = self.scaler_skips + (scaler._scale < before).int().sum()
        else:
            opt.step()
        if self.run.scheduler is not None:
            self.run.scheduler.step()
        self.optimizer_steps += 1
        self.run.optimizer_steps += 1

    def _agree_on_inf(self) -> None:
        """fp16: every rank skips the step (and backs off the scale) if any rank's gradients overflowed.

        Sharded gradients (fsdp, tensor) overflow on some ranks only; ddp's are the same on every rank
        after its all-reduce, and the flag keeps that a fact rather than an assumption. One all-reduce
        (max) of the scaler's found-inf flags per optimizer step, no host sync.
        """
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        for found in state["found_inf_per_device"].values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # group device: GradScaler's, the gradients' device

    @property
    def last_norm(self) -> float | None:
        """The pre-clip gradient norm of the newest optimizer step read so far (None: no clipping yet).

        On a GPU rank it may be a few steps old while the cell runs (it is read without waiting);
        exact once the GPU's queue ran (the cell's end synchronises it).
        """
        return self._norm_reading.poll()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


#: Words of torch's errors about a tensor's shape or size (a view, a matmul, a cat, a loss against its target)
_SHAPE_WORDS = ("shape", "size", "dimension")


def short_batch_note(exc: BaseException, batch, plan) -> None:
    """Add to ``exc``'s message, in place, that the step's batch was shorter than ``--batch-size`` when it failed on a
    shape: the epoch's last batch of a shard is (without ``--drop-last``), and code written for a full one
    (``x.view(32, -1)``) fails there only, after every full batch of the epoch trained, with torch's words alone."""
    text = str(exc) if exc.args and isinstance(exc.args[0], str) else ""
    if not text or "[distnb]" in text or plan.loop or plan.strategy == "pipeline" \
            or not any(w in text.lower() for w in _SHAPE_WORDS):
        return
    first = batch
    while isinstance(first, (tuple, list, dict)) and first:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    n = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else None
    if n is None or n >= plan.batch_size:
        return
    exc.args = (f"{exc.args[0]}\n[distnb] this step's batch held {n} samples, fewer than --batch-size "
                f"{plan.batch_size}: the last batch of an epoch is short unless --drop-last. Code written for a "
                "full batch (x.view(32, -1)) fails only there: use x.shape[0] (or -1), or pass --drop-last to "
                "train on full batches only",) + tuple(exc.args[1:])


def dict_batch_note(exc: BaseException, batch) -> None:
    """Add to ``exc``'s message, in place, that the batch is a dict when torch got a str where a tensor goes:
    ``x, y = batch`` on a dict batch (a ``--data`` dict of tensors, a Dataset of dicts) unpacks its keys."""
    text = str(exc) if exc.args and isinstance(exc.args[0], str) else ""
    if not isinstance(batch, dict) or not batch or "[distnb]" in text or not ("not str" in text or "'str'" in text):
        return
    keys = list(batch)[:4]
    take = ", ".join(f"batch[{k!r}]" for k in keys[:2])
    exc.args = (f"{exc.args[0]}\n[distnb] the batch is a dict (keys {', '.join(map(repr, keys))}"
                f"{', ...' if len(batch) > 4 else ''}), so `x, y = batch` gives its keys, which are strings: "
                f"take its values by key ({', '.join(['x', 'y'][:len(keys[:2])])} = {take})",) + tuple(exc.args[1:])
