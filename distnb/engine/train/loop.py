"""The training loop that runs on every rank for a ``%%distrain`` cell.

State that lives between cells is kept here per name: the model (unwrapped module,
its strategy wrapper, the optimizer, the epoch count) in ``RUNS``; each rank's data shard
(the tensor path) is :mod:`distnb.engine.train.shards`' ``SHARDS``, data sets loaded on the
ranks through a DataLoader are :mod:`distnb.engine.train.datasets`'s. The loop asks either for an epoch's
batches (``data.epoch(plan, epoch, skip, device)``) and ends its loader with the cell.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import torch

from distnb.core.plan import DEFAULT_LR, STRATEGIES, TrainPlan, optimizer_state_readable, redistribution
from distnb.engine import strategies
from distnb.engine.process import binding, cellfail, collectives, postmortem, precision_check, runtime, where
from distnb.engine.strategies import finetune
from distnb.engine.train import batchnorm, beforestep, checkpoint, datasets, epochrest, stepping
from distnb.engine.train.context import Context, StopRequest, _Stopped, agree_on_steps  # noqa: F401 - the cell's ctx and its stop
from distnb.engine.train.loopwatch import LoopWatch
from distnb.engine.train.shards import SHARDS
from distnb.engine.train.stepping import Stepper
from distnb.engine.train.tblog import Logger
from distnb.engine.train.validation import Validator
from distnb.engine.transport import report, wire
from distnb.engine.transport.report import LINGER as RELAY_LINGER
from distnb.engine.transport.report import Reporter, host_relay, publish_raw


class Run:
    """A model living on this rank between cells."""

    def __init__(self, module, steps: int = 0):
        self.module = module
        self.strategy = None  # a strategies.Strategy, rebuilt when the plan or process group changes
        self.generation = -1
        self.strategy_key = None
        self.optimizer = None
        self.optimizer_key = None
        self.epoch = 0
        self.epoch_step = 0  # steps done in the current (unfinished) epoch
        self.epoch_samples = 0  # positions of this rank's epoch order consumed: the sampler position
        self.epoch_data = None  # (data name, samples) that position is in: other data starts its epoch afresh
        self.epoch_trail = None  # the epoch's samples trained before a resize (engine/epochrest.py)
        self.steps = self.received_steps = steps  # the global step count of the weights it was received with
        self.plan_dict = None  # the plan it was last trained with (recorded in checkpoints)
        self.forwards = 0  # calls of the strategy wrapper, to catch bodies that bypass it
        self.optimizer_steps = 0
        self.scheduler = self.schedule_name = None  # --lr-schedule, live between cells
        self.schedule_total = 0
        self.scaler = None  # fp16's GradScaler (its scale carries on between cells)
        self.eager_step_time = None  # seconds per step of the last cell without --compile
        self.inherited = None  # a rank added by %dist scale: rank 0's optimizer state, until its next cell
        self.cell_first_epoch = 0  # the epoch the last cell started at (--on-failure shrink counts from it)
        self.weights_stay = False  # built on meta in the notebook: no weights go back (engine/materialize.py)
        self.said = ""  # what building its strategy printed before the cell (engine/materialize.py)

    def count_forward(self, module, args):
        self.forwards += 1


RUNS: dict[str, Run] = {}


def _drop_wrappers(ns):
    for run in RUNS.values():
        if run.strategy is not None:
            run.strategy.close()
        run.strategy = None
        run.generation = -1


runtime.RELEASE_HOOKS.append(_drop_wrappers)


def _mesh_info() -> dict:
    """``%dist status``: this rank's coordinates in the mesh of each live model on a named mesh.

    ``{"mesh": "dp=0 tp=1 of 2x2 (net)"}``; models on the same mesh share one entry (names
    comma-separated), entries for different meshes are joined by ``; ``; ``{}`` when none is.
    """
    places = {}
    for name, run in sorted(RUNS.items()):
        where = run.strategy.mesh_coordinates() if run.strategy is not None else None
        if where:
            coords = " ".join(f"{k}={v}" for k, v in where.items() if k != "shape")
            places.setdefault(f"{coords} of {where['shape']}" if "shape" in where else coords, []).append(name)
    return {"mesh": "; ".join(f"{place} ({', '.join(names)})" for place, names in places.items())} if places else {}


runtime.INFO_HOOKS.append(_mesh_info)


def _set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


def _given_lr(optimizer, lr) -> str:
    """Set a cell's ``--lr`` on the live ``optimizer`` (None: keep its own); returns the note ("" if unchanged)."""
    if lr is None or all(g["lr"] == lr for g in optimizer.param_groups):
        return ""
    _set_lr(optimizer, lr)
    return f"lr set to {lr:g}"


def _optimizer(ns, run, plan):
    """The live optimizer, kept (with its state) unless --optimizer names a different one.

    Returns (optimizer, note): note says what changed ("" when nothing did).
    """
    if run.optimizer is not None and plan.optimizer in (None, run.optimizer_key):
        return run.optimizer, _given_lr(run.optimizer, plan.lr)
    name = plan.optimizer or "sgd"
    params = finetune.trainable(run.strategy.parameters(), run.module)  # frozen weights (LoRA's) get no state
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
    run.scheduler = run.schedule_name = None  # a schedule drives the optimizer it was made for
    return run.optimizer, note


def _steps(ns, code, ctx):
    """The micro-steps and optimizer steps of a step body (engine/stepping.py)."""
    stepper = ctx.stepper
    for _ in ctx.epochs():
        for batch in ctx.loader:
            ns["batch"] = _STEP["batch"] = batch
            at, batches = ctx.epoch_done, ctx.epoch_batches  # this epoch's micro-step, of how many
            loss, value = stepper.micro_step(ns, code, ctx, at, batches)
            bad = ctx.plan.nan == "skip" and ctx.any_nonfinite(loss, value)
            stepper.finish_micro(at, batches, bad)  # a non-finite loss drops its whole group, on every rank
            ctx.report(loss, value=value, skipped=bad)
            _STEP["batch"] = None  # a failure loading the next batch is not this one's


#: The batch of the step running now (None between steps: while the next batch loads), for the failure notes.
_STEP: dict = {"batch": None}


def _run_body(ns, code, ctx, plan):
    if plan.loop:
        with LoopWatch(ctx):  # the body's own optimizer steps; the epoch count only through ctx.epochs()
            exec(code, ns)
        agree_on_steps(ctx.micro_steps, "at the end of the --loop body")  # ranks that left ctx.epochs() early
        if ctx.micro_steps == 0:
            raise ValueError("the --loop body ran no step: drive it with `for epoch in ctx.epochs():` / "
                             "`for batch in ctx.loader:` and call `ctx.report(loss)` after each step")
    else:
        _steps(ns, code, ctx)


def train(ns, plan_dict, code_text, outbox=None):
    """Run one ``%%distrain`` cell on this rank; returns this rank's figures (dict).

    Above ``plan.relay_above`` ranks, progress goes through the host's relay
    (:func:`distnb.engine.transport.report.host_relay`), closed when the cell ends, however it ends.
    ``outbox``: a kernel segment to write the trained state into (:func:`distnb.engine.transport.wire.offer`).
    """
    cellfail.begin()
    wire.offer(outbox)
    plan = TrainPlan.from_dict(plan_dict)
    st = runtime.STATE
    relay = host_relay(st.world_size, st.local_rank or 0, st.node_rank, plan.relay_above)
    try:
        return _train(ns, plan, code_text, relay)
    finally:
        if relay is not None:
            relay.close(linger=RELAY_LINGER if relay.leader else 0.0)


def notes(*parts: str) -> str:
    """The notes a cell says of how it starts, one a line (:func:`distnb.display.text.start_notes` prints each on
    its own); the empty ones left out. Each is a clause of its own: run together they read as one."""
    return "\n".join(p for p in parts if p)


def _settle_position(run, plan, data, note: str) -> str:
    """Where this cell's first epoch starts: the position the last cell stopped at, in the same data.

    A position in other data (another name or size) starts the epoch at its beginning, and the
    note says so; a position at (or, with ``--drop-last``, past the last full batch of) the epoch's
    end counts the epoch as done.
    """
    data_key = (plan.data, getattr(data, "num_samples", None))
    if (run.epoch_samples or epochrest.active(run)) and run.epoch_data not in (None, data_key):
        run.epoch_step = run.epoch_samples = 0
        note = notes(note, f"epoch {run.epoch} had stopped partway through other data ({run.epoch_data[0]}); it "
                     f"starts again at the beginning of {plan.data}")
    run.epoch_data = data_key
    if _trained_through(run, plan, epochrest.segment_length(run, data, plan) or 0):  # after its last batch: done
        run.epoch, run.epoch_step, run.epoch_samples = run.epoch + 1, 0, 0
    return notes(note, epochrest.note(run, data, plan))


def _trained_through(run, plan, length: int) -> bool:
    """Whether ``run`` stands after the last batch of its epoch of ``length`` samples (its end not run yet)."""
    left = length - run.epoch_samples
    return bool(run.epoch_samples or epochrest.active(run)) and (left <= 0 or (plan.drop_last and left < plan.batch_size))


def _where(run, plan, data) -> dict:
    """Where the cell stopped: ``epoch``, ``step`` (of it); ``last_step`` when that was the epoch's last step,
    its end not run (a --loop body's stop there): the next cell starts the next epoch."""
    length = epochrest.segment_length(run, data, plan)
    if length is not None and _trained_through(run, plan, length):
        return dict(epoch=run.epoch, step=run.epoch_step, last_step=True)
    return dict(epoch=run.epoch, step=run.epoch_step)


def _train(ns, plan, code_text, relay):
    postmortem.drop(ns)  # the next cell releases the frames the last failure kept
    runtime.own_names(ns)  # a body's `rank = ...` last cell: the body reads this rank's again
    st = runtime.STATE
    if st.broken:
        raise RuntimeError(f"rank {st.rank}: the process group is broken; the kernel must re-form it")
    run = RUNS.get(plan.model)
    data = datasets.SOURCES.get(plan.data) or SHARDS.get(plan.data)
    if run is None or data is None or (plan.val_data is not None and plan.val_data not in SHARDS):
        raise RuntimeError(f"rank {st.rank}: model {plan.model!r} or data {plan.data!r} "
                           f"{'' if plan.val_data is None else f'or {plan.val_data!r} '}was not sent")
    steps = data.steps_per_epoch(plan)
    reporter = Reporter(st.rank, steps * plan.epochs, plan.epochs, interval=plan.report_interval,
                        publish=None if relay is None else relay.send)
    code = runtime.compile_cell(code_text, "distrain")
    stop = StopRequest().__enter__()
    first = ctx = None  # the body's first forward, watched (a failure before it may keep the group: beforestep.py)
    try:
        note, resumed = _prepare(ns, plan, run)
        note = _settle_position(run, plan, data, note)
        run.cell_first_epoch = run.epoch
        run.plan_dict = plan.to_dict()
        reporter.extra.update(run.strategy.holdings())
        ctx = Context(plan, run, data, reporter, stop=stop)
        reporter.total = steps * plan.epochs - math.ceil(ctx.skip / plan.batch_size)
        continued = dict(epoch=run.epoch, samples=ctx.skip) if ctx.skip else None
        note = notes(note, _cell_extras(ns, plan, run, ctx, code, steps))
        ns.update(model=run.strategy.model, optimizer=run.optimizer, ctx=ctx)
        run.module.train()
        start = dict(note=note, resumed=resumed, continued=continued)
        if any(start.values()):  # in every message: the kernel prints it before the epoch lines, whichever it reads first
            reporter.extra["start"] = start
        reporter.set_status("running")
        started = _clock()
        watchdog = where.Watchdog(publish_raw, ddp_backward=plan.strategy == "ddp")
        watchdog.start()
        try:
            with collectives.checked(off=plan.unchecked, timeout=st.timeout, training=True), \
                    beforestep.FirstForward() as first:  # a skipped call: a hang, not an abort
                _run_body(ns, code, ctx, plan)
        except _Stopped:
            pass
        finally:
            watchdog.stop()
            if ctx.logger is not None:
                ctx.logger.close()
        seconds, cpu_seconds = _clock(started)
        restored = ctx.validator.restore_best() if plan.restore_best and not ctx.interrupted else False
        ctx.final_checkpoint()  # a resume never goes back behind this cell's last step (the restored best, if any)
    except BaseException as caught:
        keep = beforestep.may_keep(caught, first, ctx.micro_steps if ctx is not None else 0)
        cellfail.raise_failure(caught, ns, reporter, lambda exc: _annotate(exc, ns, plan), keep)
    finally:
        stop.__exit__()
        data.close()  # DataLoader workers end with the cell, however it ends
        sys.stdout.flush()
    reporter.extra["train_seconds"] = seconds  # the dashboard's final samples/s is the TrainResult's
    carried = _last_word(reporter, relay, "interrupted" if ctx.interrupted else "done")
    # the kernel streams the weights back in parts after the reply (engine/stateparts.py); ps drains here, once
    state = None if run.weights_stay or run.strategy.streams_state else run.strategy.full_state()
    # the mean over the cell's last epoch; with none finished, over the steps trained (its loss_steps; 0: an epoch's)
    last, loss_steps = (ctx.local_losses[-1], 0) if ctx.local_losses else ctx.steps_mean()
    return dict(rank=st.rank, steps=ctx.micro_steps, samples=reporter.samples, seconds=seconds, cpu_seconds=cpu_seconds,
                samples_per_s=reporter.samples / seconds if seconds > 0 else 0.0,
                final_loss=last, final_loss_steps=loss_steps, epoch_losses=list(ctx.epoch_losses),
                first_epoch=run.epoch - len(ctx.epoch_losses), next_epoch=run.epoch,
                stopped_early=ctx.stopped_early, steps_per_epoch=steps, global_steps=run.steps, note=note,
                interrupted=ctx.interrupted,
                where=_where(run, plan, data), holdings=run.strategy.holdings(), state=state,
                resumed=resumed, continued=continued, checkpoints=ctx.checkpoints, skipped_steps=ctx.skipped_steps,
                iterated_epochs=ctx.iterated_epochs, progress_message=carried,
                **_step_figures(plan, run, ctx, restored), **report.peak_row(st.device))


def _annotate(exc, ns, plan) -> None:
    """distnb's diagnosis added to a failed cell's error in place, where it knows one."""
    if "find_unused_parameters=True" in str(exc) and not plan.find_unused_parameters and exc.args:
        exc.args = ("[distnb] some parameters got no gradient: run the cell with --find-unused-parameters "
                    f"(torch's message follows)\n{exc.args[0]}",) + exc.args[1:]  # the fix first, not after torch's text
    datasets.explain(exc)  # a DataLoader worker that died, a full /dev/shm
    batch, _STEP["batch"] = _STEP["batch"], None  # the failing step's (not an earlier step's, cell's)
    stepping.short_batch_note(exc, batch, plan)  # a shape error on an epoch's short last batch
    stepping.dict_batch_note(exc, batch)  # x, y = batch on a dict batch: its keys


def _last_word(reporter, relay, status: str):
    """The rank's final progress message: returned for the reply to carry (:meth:`Reporter.final_message`), or
    published (None returned) where a host's relay waits for it or a job's sink prints it."""
    if relay is None and report.SINK is None:
        return reporter.final_message(status)
    reporter.set_status(status)
    return None


def _cell_extras(ns, plan, run, ctx, code, steps) -> str:
    """The cell's lr schedule, validator and TensorBoard writer; returns a note ("" if none)."""

    ctx._code = code
    first = max(1, steps - math.ceil(ctx.skip / plan.batch_size))  # an epoch resumed in the middle: its rest
    total = Stepper.groups_per_epoch(first, plan.accumulate) + \
        (plan.epochs - 1) * Stepper.groups_per_epoch(steps, plan.accumulate)
    note = notes(stepping.prepare_schedule(plan, run, max(1, total), ns, lr_given=plan.lr is not None),
                 precision_check.precision_note(plan.precision, runtime.STATE.device))
    if plan.val_data is not None:
        ctx.validator = Validator(plan, run, SHARDS[plan.val_data], ns, runtime.STATE.device)
    if plan.log_dir is not None:

        ctx.logger = Logger(plan.log_dir, runtime.STATE.rank)
    return note


def _step_figures(plan, run, ctx, restored) -> dict:
    """The result's histories and step figures (engine/stepping.py, validation) of this rank."""
    stepper, validator = ctx.stepper, ctx.validator
    timing = ctx.step_timing()
    if not plan.compile and timing:
        run.eager_step_time = timing["step_seconds"]
    return dict(optimizer_steps=stepper.optimizer_steps, loss_history=ctx.loss_history.points(),
                lr_history=stepper.lrs.points(), grad_norm_history=stepper.grad_norms.points(),
                grad_norm=stepper.last_norm, lr=stepper.lr, stop_reason=ctx.stop_reason, loss_dtype=ctx.loss_dtype,
                val_history=list(validator.history) if validator else [], restored_best=restored,
                best_epoch=validator.best[1] if validator and validator.best else None,
                metric_name=validator.metric_name if validator else None, precision=plan.precision,
                compiled=plan.compile, eager_step_seconds=run.eager_step_time, **ctx.said(), **timing)


def _clock(since=None) -> tuple:
    """(wall s, this process's CPU s) now, once the GPU work this rank queued has run (CUDA ranks: the time
    of a step is the GPU's, not the queueing's); minus ``since``'s when given."""
    device = runtime.STATE.device
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize()
    now = (time.perf_counter(), time.process_time())
    return now if since is None else (now[0] - since[0], now[1] - since[1])


def _prepare(ns, plan, run):
    """Build (or keep) ``run``'s strategy and optimizer for ``plan``; resume from a checkpoint.

    Returns (note, resumed): what changed about the optimizer, and the checkpoint path
    resumed from (None). A model just received (no optimizer yet) with --checkpoint-dir
    holding a checkpoint resumes from its newest one, unless --reset: into the optimizer it was
    saved with, then as a live model would go on (a cell's ``--lr`` set on it; another
    ``--optimizer`` replaces it, keeping the weights and position).
    """
    fresh = run.optimizer is None and run.steps == run.received_steps  # as received: no step trained here
    distribute(ns, plan, run)
    if run.inherited is not None:  # a rank added by %dist scale: the optimizer and schedule rank 0 had
        stepping.adopt_optimizer(ns, run, plan, _optimizer)
    if not (fresh and plan.checkpoint_dir and not plan.reset and plan.resume and checkpoint.latest(plan.checkpoint_dir)):
        return _optimizer(ns, run, plan)[1], None
    meta = checkpoint.read_meta(plan.checkpoint_dir)
    position = (run.epoch, run.epoch_step, run.epoch_samples, run.steps, run.optimizer_steps)
    try:
        # the optimizer the checkpoint holds the state of (its lr and schedule come back with it) ...
        _optimizer(ns, run, dataclasses.replace(plan, optimizer=meta["optimizer"], lr=None, lr_if_new=None))
        # a checkpoint of a model loaded and not trained (its optimizer None) holds no optimizer state
        readable = meta["optimizer"] is not None and optimizer_state_readable(meta["plan"]["strategy"], plan.strategy)
        checkpoint.load(run, meta, ns, plan, optimizer_state=readable)
    except BaseException:  # as received again: the next cell resumes anew (it trained on without the schedule)
        run.optimizer = run.scheduler = run.schedule_name = None
        run.epoch, run.epoch_step, run.epoch_samples, run.steps, run.optimizer_steps = position
        raise
    if not readable:  # ... another strategy's layout: the weights and position, a fresh optimizer
        run.optimizer = None  # (its lr: the cell's, else the one the checkpoint's cell trained with)
        lr_if_new = plan.lr_if_new if plan.lr_if_new is not None else meta["plan"].get("lr")
        _optimizer(ns, run, dataclasses.replace(plan, optimizer=plan.optimizer or meta["optimizer"], lr_if_new=lr_if_new))
        return "", meta["path"]
    if plan.optimizer not in (None, meta["optimizer"]):  # ... replaced by another --optimizer, as in a live model
        _optimizer(ns, run, plan)  # (the kernel said so when it sent the model: no note here)
        return "", meta["path"]
    return _given_lr(run.optimizer, plan.lr), meta["path"]  # ... and a cell's --lr applies on top, as live


def distribute(ns, plan, run) -> None:
    """Have ``run.module`` distributed for ``plan``: kept as it is when it already is (same distribution, same
    process group), else built anew (:func:`build_strategy`); what building said is printed here.

    Raises
    ------
    RuntimeError
        It is sharded in place for another distribution: the kernel must send it again.
    """
    st = runtime.STATE
    key = plan.strategy_key()
    last = None if run.strategy_key is None else (run.strategy_key, run.generation)
    verdict = redistribution(last, key, st.generation)
    if verdict == "resend":
        raise RuntimeError(f"rank {st.rank}: {plan.model} was distributed for --strategy "
                           f"{run.strategy_key[0]}; the kernel must send it again (--reset)")
    if verdict == "rebuild" or run.strategy is None:
        build_strategy(ns, plan, run)
    print(run.said, end="", flush=True)
    run.said = ""


def build_strategy(ns, plan, run, pending=None) -> None:
    """Distribute ``run.module`` for ``plan`` (``pending``: a structure to materialise, engine/materialize.py)."""
    st, key = runtime.STATE, plan.strategy_key()
    if run.strategy is not None:
        run.strategy.close()
    run.module = batchnorm.convert(run.module, plan.sync_bn)
    run.strategy = strategies.build(run.module, plan, st.device, ns, pending)
    binding.float_gloo()  # a mesh's new groups start gloo threads of their own (engine/binding.py)
    if run.strategy.wraps_model:
        run.strategy.model.register_forward_pre_hook(run.count_forward)
    if run.optimizer is not None and run.strategy_key is not None and run.strategy_key != key and \
            _param_ids(run.optimizer) != {id(p) for p in run.strategy.parameters() if p.requires_grad}:
        run.optimizer = None  # its parameters belong to the old distribution
        run.scheduler = run.schedule_name = None
    run.generation, run.strategy_key = st.generation, key
    _agree_with_rank0(run)  # every rank built it (DDP broadcast rank 0's weights): the same position too


def _agree_with_rank0(run) -> None:
    """Every rank takes rank 0's position (and, for ddp, optimizer state) when the ranks' counts differ.

    A failed cell can leave the ranks steps apart: one that raised at its next forward after an
    optimizer step the other never finished (DDP's unused-parameter error, its peer stopped in that
    step's all-reduce). The notebook gets rank 0's weights and the re-wrapped DDP broadcasts them;
    the ranks' own positions made the next cell run other numbers of steps on each, and gloo aborted
    an engine (SIGABRT) on the mismatched collectives. One small ``all_gather_object`` when nothing differs.
    """
    import torch.distributed as dist

    mine = (run.epoch, run.epoch_step, run.epoch_samples, run.steps, run.optimizer_steps)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if all(e == every[0] for e in every):
        return
    replicated = not STRATEGIES[run.strategy_key[0]][1]  # ddp: the same optimizer state belongs on every rank
    state = [None]
    if runtime.STATE.rank == 0:
        state = [(mine, run.optimizer.state_dict() if replicated and run.optimizer is not None else None,
                  run.scheduler.state_dict() if replicated and run.scheduler is not None else None,
                  run.scaler.state_dict() if replicated and run.scaler is not None else None)]
    dist.broadcast_object_list(state, src=0)
    counts, optimizer, scheduler, scaler = state[0]
    run.epoch, run.epoch_step, run.epoch_samples, run.steps, run.optimizer_steps = counts
    for held, value in ((run.optimizer, optimizer), (run.scheduler, scheduler), (run.scaler, scaler)):
        if held is not None and value is not None and runtime.STATE.rank != 0:
            held.load_state_dict(value)


def _param_ids(optimizer) -> set:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def ready_run(ns, name):
    """The Run of model ``name``, trained or loaded (``%dist load``), with its strategy built (re-made after a
    failed cell), for a save."""
    run = RUNS.get(name)
    if run is None:
        raise RuntimeError(f"rank {runtime.STATE.rank}: no model {name!r} on the ranks; train it first")
    plan = run.plan_dict
    if plan is None:  # sent and never distributed: a training cell or a load failed before it was
        raise RuntimeError(f"rank {runtime.STATE.rank}: {name} was sent but neither trained nor loaded on the "
                           f"ranks; nothing to save (run a %%distrain cell, or %dist load PATH --model {name})")
    if run.strategy is None:  # dropped with the process group after a failed cell
        if STRATEGIES[plan["strategy"]][1]:  # sharded in place: that copy went with the group
            raise RuntimeError(f"rank {runtime.STATE.rank}: the ranks' {plan['strategy']} copy of {name} was lost "
                               f"with the process group, re-formed after a failed cell; {weights_left(name, run)}")
        if run.optimizer is None:  # loaded, not trained: no optimizer to make (the next cell makes it)
            distribute(ns, TrainPlan.from_dict(plan), run)
        else:
            _prepare(ns, TrainPlan.from_dict(plan), run)  # the same distribution on the re-formed group
    return run


def weights_left(name, run) -> str:
    """Where model ``name``'s weights are, and the fix, once the ranks' sharded copy of it is lost."""
    if run.weights_stay:  # built on meta in the notebook: no copy came back to the kernel
        return (f"{name} is on the meta device in the notebook, so its trained weights were on the ranks only: load "
                f"its last checkpoint (%dist load DIR --model {name}) or train it again")
    return f"the notebook's {name} holds the weights its last finished cell brought back (train a cell, then save)"


def restore(ns, name, directory, changes=None):
    """``%dist load``: rebuild the strategy and optimizer the checkpoint was saved with and load it (a checkpoint
    of a model loaded and not trained, whose optimizer is None: the strategy and the weights, no optimizer).

    The model must have been sent (install.install_model) just before. ``changes`` (dict of TrainPlan
    fields) alters the saved plan for this world: ``{"mesh": "2x2"}`` for an fsdp+tensor model
    saved on ``1x2`` (:func:`distnb.train.meshes.refit`). Returns the checkpoint metadata.
    """
    meta = checkpoint.read_meta(directory)
    plan_dict = dict(meta["plan"], model=name, checkpoint_dir=None, checkpoint_every=None, reset=False,
                     optimizer=meta["optimizer"], **(changes or {}))
    plan = TrainPlan.from_dict(plan_dict)
    run = RUNS[name]
    if meta["optimizer"] is None:  # saved loaded, not trained: the weights only, the optimizer left to the next cell
        distribute(ns, plan, run)
    else:
        _prepare(ns, plan, run)
    run.plan_dict = plan.to_dict()
    checkpoint.load(run, meta, ns, plan)
    return meta
