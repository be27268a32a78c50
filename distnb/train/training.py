"""A training cell in the kernel: its plan, what the ranks hold, what it must send first, its run.

A ``%%distrain`` cell's options become a :class:`~distnb.core.plan.TrainPlan` here
(:func:`make_plan`); then :func:`prepare` sends only what the ranks lack: the names the
body reads (:func:`body_pushes`), the model (:func:`ensure_model`, whose reuse decision is
:func:`distnb.core.plan.redistribution`, the same rule the ranks apply) and the data's shards
(:func:`ensure_data`). :class:`~distnb.train.holdings.Holdings` records all of it;
:func:`train_cell` runs the cell on the ranks (through :mod:`distnb.execute.execute`) and
:func:`weights_back` loads the trained weights into the kernel's model when it ends.
"""

from __future__ import annotations

import importlib.util
import time
import warnings

from distnb.cluster import worlds
from distnb.core import calls, options, weightfiles
from distnb.core.errors import Interrupted, PlanError, RankError
from distnb.core.carryover import carry_over, not_carried
from distnb.core.plan import LR_SCHEDULES, TrainPlan, redistribution
from distnb.core.tables import count
from distnb.core.tracebacks import body_name_hint, module_name_hint
from distnb.display import ProgressState, make_view, view_kind
from distnb.execute import presses
from distnb.execute.execute import restart_world
from distnb.train import bigmodels, carried, kernel_memory, loopcell, pretrained, record, results, runrecord
from distnb.train.homecoming import interrupted_weights, kept_weights, weights_back
from distnb.train.loopcell import clip_warnings
from distnb.train.meshes import carried_message
from distnb.train.rankfolders import check_folders
from distnb.train.resuming import first_step, newest_meta, newest_start, push_saved_names, start_sentence
from distnb.transfer import captured, data, modelcheck, resident, transfer, valsets
from distnb.transfer.transfer import _pool as transfer_pool
from distnb.transfer.transfer import fingerprint, free_names, model_change, outgoing, pack_named

#: How often ranks report for each progress view (seconds): the dashboard redraws live,
#: text progress prints per epoch (status and epoch-end messages are always sent at once).
REPORT_INTERVAL = {"widgets": 0.1, "text": 2.0, "none": 3600.0}
#: Names a training body gets from distnb, never pushed from the notebook.
RESERVED_NAMES = frozenset({"batch", "model", "optimizer", "ctx", "loss", "rank", "world_size", "local_rank",
                            "device"})


def make_plan(session, model_name, model_obj, data_name, given: dict, quiet=False) -> TrainPlan:
    """The TrainPlan of a cell: ``given`` options plus those that carry over from the model's last cell.

    What carries over is :func:`distnb.core.carryover.carry_over`'s rule; the cell says so for the options
    of how the model is distributed (unless ``quiet``).

    Raises PlanError for a bad option, a model that is not a Module, a bad ``--optimizer``
    name or a strategy that cannot run the model on this world.
    """
    import torch

    from distnb.engine import strategies  # loads numpy, torch: at first use, not when this module is imported

    held = session.holdings
    given = options.without_left_out(TrainPlan, given)  # strategy=None: carried (the Python default), ddp at first
    dropped = carry_over(held.replaced(model_name, model_obj), given)
    if dropped and not quiet:
        print(f"distnb: {model_name} is a new object: the options its old object's cells carried "
              f"({carried.flags(dropped)}) start from their defaults")
    kept = carry_over(held.carried.get(model_name), given)
    refused = not_carried(held.carried.get(model_name), given)
    if refused and not quiet:
        print(f"distnb: --strategy {given['strategy']} cannot take {carried.flags(refused)} from {model_name}'s last "
              f"cell: this cell uses {_defaults_of(refused)}")
    if given.get("lr") is None and given.get("optimizer") is None:
        # the ranks keep their live optimizer anyway; one made new (the model sent again after a
        # restart, a strategy switch, --reset or a changed model) is the one the user chose last
        given["lr_if_new"] = held.lr_of.get(model_name)
    try:
        plan = TrainPlan(model=model_name, data=data_name, **dict(given, **kept))
    except PlanError as exc:
        involved = {k: v for k, v in kept.items() if carried.flags({k: v}).split(" ")[0] in str(exc)
                    or (k == "strategy" and f"--strategy {v}" in str(exc))}
        if not involved:
            raise
        raise PlanError(f"{exc}; {carried.flags(involved)} carried over from {model_name}'s last cell: "
                        "give the options this cell needs") from None
    held.settings[model_name] = carried.cell_sentence(model_name, kept, dropped)  # the dashboard's header says it
    if not quiet:
        _say_carried(model_name, kept)
    if not isinstance(model_obj, torch.nn.Module):
        raise PlanError(f"--model {model_name} is a {type(model_obj).__name__}, not a torch.nn.Module")
    modelcheck.check_initialized(model_name, model_obj)
    if not plan.builtin_optimizer:
        if plan.optimizer not in session.ns:
            raise PlanError(f"--optimizer {plan.optimizer!r} is neither sgd, adam, adamw nor a name defined in "
                            "the notebook (a function params -> torch.optim.Optimizer)")
        if not callable(session.ns[plan.optimizer]):
            raise PlanError(f"--optimizer {plan.optimizer} must be callable: f(params) -> Optimizer")
    try:
        strategies.check(plan, model_obj, session.world_size, ns=session.ns)
    except strategies.StrategyError as exc:
        raise PlanError(f"--strategy {plan.strategy}: {exc}") from None
    except PlanError as exc:
        if "mesh" not in kept or not str(exc).startswith(f"--mesh {plan.mesh} "):
            raise

        raise PlanError(carried_message(model_name, plan.mesh, session.world_size)) from None
    check_step_options(session, plan, model_obj)
    return newest_start(session, plan, model_obj)


def _defaults_of(names) -> str:
    """``--precision fp32, --no-compile``: the defaults of the options ``names``, as a cell would give them."""

    shown = []
    for f, opt in options.declared(TrainPlan):
        if f.name in names:
            flag = options.flags_of(f, opt)[0]
            shown.append(("--no-" + flag[2:]) if f.default is False else f"{flag} {f.default}")
    return ", ".join(shown)


def _say_carried(model_name, kept) -> None:
    """One line naming the options a cell kept from the model's last cell (those not at their default)."""
    shown = carried.flags(carried.non_default(kept))
    if shown:
        print(f"distnb: {shown}, as in {model_name}'s last cell (name another to change it)")


def _is_data_set(obj) -> bool:
    import numpy as np
    import torch

    if isinstance(obj, (torch.Tensor, np.ndarray, torch.utils.data.TensorDataset)):
        return True
    if isinstance(obj, (tuple, list, dict)):
        return transfer.is_columns(obj) or data.is_sample_list(obj)
    return isinstance(obj, torch.utils.data.Dataset) and hasattr(obj, "__len__")


def check_step_options(session, plan, model_obj) -> None:
    """Kernel side: the step, validation and logging options against the cluster and the notebook.

    Raises PlanError, naming the option, before anything is sent.
    """

    from distnb.engine.train import batchnorm  # loads numpy, torch: at first use, not when this module is imported

    on_cpu = session.cluster.spec.device_type != "cuda"
    if on_cpu and (plan.sync_bn or batchnorm.holds_sync_batchnorm(model_obj)):
        what = "--sync-bn" if plan.sync_bn else f"--model {plan.model} holds torch.nn.SyncBatchNorm layers, which"
        raise PlanError(f"{what} needs GPU ranks: torch's SyncBatchNorm runs on CUDA only, and these ranks compute "
                        "on CPU (use plain BatchNorm: each rank normalises over its own batch)")
    ns = session.ns
    if plan.val_data is not None:
        if plan.val_data not in ns:
            raise PlanError(f"--val-data {plan.val_data!r} is not defined in the notebook; define it in a cell first")
        if not _is_data_set(ns[plan.val_data]) and not valsets.accepted(ns[plan.val_data]):
            raise PlanError(f"--val-data {plan.val_data} is a {type(ns[plan.val_data]).__name__}, not a data set "
                            f"({valsets.WHAT})")
    for flag, name in (("--metric", plan.metric), ("--lr-schedule", None if plan.lr_schedule in LR_SCHEDULES
                                                   else plan.lr_schedule)):
        if name is None:
            continue
        if name not in ns:
            raise PlanError(f"{flag} {name!r} is not defined in the notebook"
                            + (f" (nor one of {', '.join(LR_SCHEDULES)})" if flag == "--lr-schedule" else ""))
        if not callable(ns[name]):
            raise PlanError(f"{flag} {name} is a {type(ns[name]).__name__}, not callable: "
                            + ("metric(output, target) -> per-sample scores" if flag == "--metric"
                               else "f(optimizer, total_steps) -> LRScheduler"))
    if plan.log_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise PlanError("--log-dir writes TensorBoard event files and needs the tensorboard package (pip install "
                        "tensorboard)")
    check_folders(session, plan)  # every rank can write --checkpoint-dir and --log-dir, or a PlanError says who


def body_warnings(code: str, plan) -> list:
    """Sentences about a step body that does something distnb's step undoes (e.g. clipping before backward)."""

    return [] if plan.loop else list(clip_warnings(code))


def prepare(session, plan, code, model_obj, data_obj, quiet) -> tuple:
    """Send what the ranks lack for ``plan``: named objects, the body's names, the model, the shards.

    What the kernel refuses alone (a name the notebook lacks, a body that is not Python, ``--load``'s files,
    a model to be sent that does not fit: :func:`distnb.train.bigmodels.check_before_sending`) is refused
    before anything is sent, so a refused cell leaves the ranks and
    :class:`~distnb.train.holdings.Holdings` as they were.

    Returns
    -------
    (num_shards, steps_per_epoch, sent) : tuple of int, int, bool
        ``sent``: the model was sent this cell (the ranks train it fresh, from the kernel's weights).
    """
    from distnb.engine import strategies  # loads numpy, torch: at first use, not when this module is imported

    schedule = None if plan.lr_schedule in LR_SCHEDULES else plan.lr_schedule
    named = [] if plan.builtin_optimizer else [plan.optimizer]
    for option, flag in ((plan.loss, "--loss"), (plan.tp_plan, "--tp-plan"), (plan.metric, "--metric"),
                         (plan.init, "--init"),
                         (schedule, "--lr-schedule"), (plan.collate, "--collate")):
        if option is not None:
            session._lookup(option, flag)
            named.append(option)
    val_obj = session.ns[plan.val_data] if plan.val_data is not None else None
    if not plan.data_on_ranks:
        data.path_of(plan, data_obj)  # a --data that cannot be sent fails here, before anything is sent
    body = body_pushes(session, code, exclude=(model_obj, data_obj, val_obj))
    loading = pretrained.check(plan, model_obj)  # --load: the index and headers, before anything is sent
    fp = fingerprint(model_obj)  # once: ensure_model decides with it too
    if sends_model(session.holdings, plan, fp):  # the fit check needs sizes only
        bigmodels.check_before_sending(session, plan, model_obj)
    for name in named:
        session.push(name)
    if body:  # recorded: each is sent again only when the notebook's object changes
        session.push(auto=True, **{k: v for k, (v, _) in body.items()})
        session.holdings.pushed.update({k: fp for k, (_, fp) in body.items()})
    num_shards = strategies.data_parallel_size(plan, session.world_size)
    if val_obj is not None and valsets.is_made_on_ranks(val_obj):  # make(rank, world_size): each rank its part
        valsets.build_on_ranks(session, plan, val_obj, num_shards, quiet)
    elif val_obj is not None:  # the same scatter as the training set (seeded, disjoint, covering shards); one that
        # cannot be cut into tensors fails here, before the model is sent
        ensure_data(session, plan, valsets.kernel_form(plan.val_data, val_obj), quiet, num_shards, silent=quiet,
                    name=plan.val_data)
    sent = ensure_model(session, plan, model_obj, quiet, checked=True, fp=fp)
    if loading is not None:
        pretrained.load_on_ranks(session, plan, loading, quiet)
    ensure_data(session, plan, data_obj, quiet or not sent, num_shards, silent=quiet)
    return num_shards, data.steps_of(plan, session.holdings.data[plan.data], num_shards), sent


def body_pushes(session, code, exclude=()) -> dict:
    """The notebook names a training body reads whose objects the ranks lack: name -> (object, fingerprint).

    An object is sent again only when the kernel's changed (a re-run defining cell makes a new one), so the
    ranks always use the current definitions; ``exclude`` (the model, the data) never. Raises PlanError for
    a body that is not valid Python.
    """

    try:
        names = free_names(code)
    except SyntaxError as exc:
        raise PlanError(f"the cell body is not valid Python: {exc}") from None
    todo = {}
    for name in sorted(names - RESERVED_NAMES):
        if name not in session.ns:
            continue
        value = session.ns[name]
        if any(value is e for e in exclude):
            continue
        fp = fingerprint(value)
        if session.holdings.pushed.get(name) != fp:
            todo[name] = (value, fp)
    return todo


def sends_model(held, plan, fp) -> bool:
    """Whether the cell of ``plan`` sends its model (fingerprint ``fp``): ``--reset``, a model the ranks lack or hold
    another state of, or a distribution they cannot reuse (:func:`distnb.core.plan.redistribution`)."""

    verdict = redistribution(held.distributed.get(plan.model), plan.strategy_key(), held.generation)
    return plan.reset or verdict == "resend" or held.models.get(plan.model) != fp


def ensure_model(session, plan, model_obj, quiet, checked=False, fp=None) -> bool:
    """Send the model unless the ranks hold this state, distributed in a way that can be reused.

    The decision is :func:`sends_model` (:func:`distnb.core.plan.redistribution`, the rule the ranks apply: a
    strategy that shards the module in place cannot be re-distributed another way, nor survive a re-formed
    process group, so the model is sent again from the kernel's weights, the last trained ones). A model to be
    sent is checked first (:func:`distnb.train.bigmodels.check_before_sending`, unless ``checked``) and recorded
    in :attr:`~distnb.train.holdings.Holdings.distributed` once placed; a failed placement counts as not held
    (the next cell sends it afresh). ``fp``: the model's fingerprint, when the caller has just taken it (it walks
    every tensor and the classes' code). Returns whether it was sent.
    """

    held = session.holdings
    if captured.library_patches(model_obj):  # notebook code in a library class: the ranks never get it
        print(f"distnb: warning: {captured.library_patch_warning(plan.model, model_obj)}")
    fp = fingerprint(model_obj) if fp is None else fp
    key = plan.strategy_key()
    last = held.distributed.get(plan.model)
    if not sends_model(held, plan, fp):  # kept, or wrapped again on the ranks as the cell starts
        held.distributed[plan.model] = (key, held.generation)
        return False
    if not checked:
        bigmodels.check_before_sending(session, plan, model_obj)
    if not quiet and not bigmodels.on_meta(model_obj):  # a meta model: carry_or_reinit says what happens to it
        why = _why_sent_again(plan, model_obj, held, fp, last, redistribution(last, key, held.generation))
        if why:
            print(f"distnb: {why}")
    keep = resident.movable(model_obj.state_dict(keep_vars=True).values(), transfer_pool())  # before packing
    payload, descs, buffers = pack_named(plan.model, model_obj, " as --model")  # one that cannot go: before the calls
    carried = bigmodels.carry_or_reinit(session, plan, model_obj, fp, last)  # a meta model the ranks trained
    meta = None if plan.reset or not plan.resume else newest_meta(plan.checkpoint_dir)
    if meta is not None:  # the ranks resume from it: the notebook functions they rebuild it with
        push_saved_names(session, meta, plan)
    cluster = session.cluster
    try:
        with outgoing(cluster, buffers, keep=keep) as sent:  # shared memory on one host, else zero-copy frames
            steps = first_step(plan, held.steps_of(plan.model, model_obj) or 0)  # the ranks count on from there
            ars = bigmodels.send_calls(cluster, plan, model_obj, steps, payload, descs, sent)
            counts = cluster.wait_all(ars, timeout=cluster.spec.timeout + 60, what=f"sending {plan.model}")
    except BaseException:  # placed in part, or not: the next cell sends the notebook's model afresh
        for record_of in (held.models, held.distributed):
            record_of.pop(plan.model, None)
        raise
    del buffers, keep
    held.models[plan.model] = fingerprint(model_obj)  # the same state (a move keeps version counters)
    held.distributed[plan.model] = (key, held.generation)  # placed: how the ranks hold it now
    if not quiet:
        what = f"{type(model_obj).__name__}, {counts[0]:,} parameters{bigmodels.sent_note(model_obj, carried)}"
        print(f"distnb: sent {plan.model} ({what}) to "
              f"{count(session.world_size, 'rank')}; {start_sentence(plan, held.resume_steps)}")
    return True


def _why_sent_again(plan, model_obj, held, fp, last, verdict):
    """The sentence that says why a model the ranks held is sent again, or None when it is new to them."""

    if plan.model not in held.models or plan.reset:
        return None
    if verdict == "resend" and last is not None and last[0][0] != plan.strategy:
        return (f"--strategy {plan.strategy} (the last cell used {last[0][0]}): {plan.model} is sent again from the "
                "notebook's weights and distributed anew; its optimizer state and epoch count start afresh")
    if held.models[plan.model] != fp:
        change = model_change(held.models[plan.model], fp, list(model_obj.state_dict().keys()))
        return (f"{plan.model} changed in the notebook since the last cell ({change}): the ranks get it again; its "
                "optimizer state and epoch count start afresh (leave the notebook's copy alone between cells to "
                "keep them)")
    if verdict == "resend":
        return (f"{plan.model} was sharded for --strategy {plan.strategy} on a process group that has been re-formed "
                "(or with other options): it is sent again from the notebook's weights; its optimizer state and epoch "
                "count start afresh")
    return None


def ensure_data(session, plan, data_obj, quiet, num_shards, silent=False, name=None) -> None:
    """Scatter ``data_obj`` (tensors: ``plan.data``, or the validation set ``name``), or have the ranks load
    it (a Dataset, ``make``, ``--data-on-ranks``: :func:`distnb.transfer.data.ensure_dataset`), unless the ranks
    hold it cut this way; say which path and how batches are cut when that changes (unless ``silent``)."""
    name = name or plan.data
    path, why = data.path_of(plan, data_obj) if name == plan.data else ("tensors", "the validation set")
    info = session.holdings.data.get(name)
    if path != "tensors":
        info, changed = data.ensure_dataset(session, plan, data_obj, path, why, num_shards)
        data.steps_of(plan, info, num_shards)  # the error before a line about 0 steps (see below)
        layout = (plan.batch_size, plan.drop_last, plan.workers, plan.steps_per_epoch)
        if (changed or info.get("layout") != layout) and not silent:
            print(f"distnb: {data.describe_loaded(plan, info, session.world_size)}")
        info["layout"] = layout
        return
    if info is None or "structure" not in info or info["fingerprint"] != data.held_fingerprint(data_obj) or \
            info["seed"] != plan.seed or info["num_shards"] != num_shards:
        try:
            data.scatter(session, name, data_obj, plan.seed, num_shards, allow_empty=name != plan.data)
        except PlanError as exc:
            if name == plan.data:
                raise
            raise PlanError(f"--val-data {name}: {exc}") from None
        info = session.holdings.data[name]
        quiet = False
    if name == plan.data:
        data.steps_of(plan, info, num_shards)  # no full batch with --drop-last: the error, not a line about 0 steps
    layout = (plan.batch_size, plan.drop_last)
    if info.get("layout") != layout:  # say how batches are cut whenever that changes
        info["layout"] = layout
        quiet = False
    if not (quiet or silent):
        if name == plan.data:
            print(f"distnb: {data.describe_cut(plan, info, num_shards, session.world_size)}; the tensor fast path "
                  f"({type(data_obj).__name__}: {why})")
        else:
            print(f"distnb: {data.describe_validation(name, info, num_shards, plan.batch_size)}")


def train_cell(session, code, model, data, run, given):
    """A foreground training cell: the plan, what the ranks lack, training watched, weights back.

    ``run``: the cell's :class:`~distnb.core.plan.RunOptions`; ``given``: its TrainPlan options. Returns
    the :class:`~distnb.train.results.TrainResult`; see :meth:`distnb.session.Session.train`.
    """


    t0 = time.perf_counter()
    peak_since_start = kernel_memory.reset()  # the kernel's peak over this cell (TrainResult.kernel_peak_memory)
    session.cluster.check_sendable()  # a dead rank is named before anything about the cell is said
    model_name, model_obj = session._named(model, "model")
    data_name, data_obj = (data, None) if given.get("data_on_ranks") else session._named(data, "data")
    if not isinstance(code, str):
        raise PlanError(f"code must be a string of Python source (the step body), got {type(code).__name__}")
    if not code.strip():
        raise PlanError("the training cell body is empty: write one step that sets `loss`, e.g. "
                        "`x, y = batch; loss = F.cross_entropy(model(x), y)`")
    if given.get("report_interval") is None:
        given["report_interval"] = REPORT_INTERVAL[view_kind(run.progress)]
    if given.get("load") is not None:  # absolute: the ranks' working folder may not be the kernel's
        given["load"] = weightfiles.absolute(given["load"])
    plan = make_plan(session, model_name, model_obj, data_name, given, quiet=run.quiet)
    for sentence in body_warnings(code, plan):
        warnings.warn(f"distnb: {sentence}", UserWarning, stacklevel=4)
    if plan.target_loss is not None and plan.val_data is not None and not run.quiet:
        print(f"distnb: --target-loss {plan.target_loss:g} watches the validation loss (--val-data "
              f"{plan.val_data}), not the training loss")
    num_shards, steps, sent = prepare(session, plan, code, model_obj, data_obj, run.quiet)
    cell = record.capture(session, plan, code, model_obj, data_obj, RESERVED_NAMES, sent)  # for %dist export
    state = ProgressState(session.world_size, steps * plan.epochs, plan.epochs,
                          hosts=[r["host"] for r in session.cluster.ranks],
                          devices=[r["device"] for r in session.cluster.ranks], strategy=plan.strategy,
                          ranks_per_shard=session.world_size // (num_shards or session.world_size),
                          settings=session.holdings.settings.get(plan.model, ""))
    view = make_view(state, run.progress)
    view.show()
    show = tuple(range(session.world_size)) if run.all_output else (0,)
    stopped = None
    # rank 0 writes the trained state into its own outbox; distnb.transfer.weights_back reads it into model_obj in place
    with presses.held():  # presses counted
        try:
            rows = runrecord.train_on_ranks(session, plan, code, state, view, show, run)  # recorded for attach
        except Interrupted as exc:  # every rank stopped after the same step: the result of what was trained
            if getattr(exc, "results", None) is None:  # stopped where they were: the replicas may be steps apart
                lost = weights_back(session, plan.model, model_obj, best_effort=True)
                held = session.holdings  # the next cell sends rank 0's weights to all
                held.gone[plan.model] = (held.models.pop(plan.model, None), bigmodels.INTERRUPTED)
                raise Interrupted(f"{exc}; {interrupted_weights(plan, model_obj, lost)}") from None
            rows, stopped = exc.results, exc
        except (RankError, KeyboardInterrupt) as exc:
            weights_back(session, plan.model, model_obj, best_effort=True, replicated=plan.strategy == "ddp")
            if getattr(exc, "restart_dead", None):  # --on-failure restart: once rank 0's weights are back
                restart_world(session, exc.failures, exc.restart_dead)
                exc.args = (exc._summary(),)
            if isinstance(exc, RankError) and not exc.hint:
                held = session.holdings.data.get(plan.data) or {}
                exc.add_hint(modelcheck.dtype_hint(exc, plan, model_obj, data_obj, held.get("sample") or "")
                             or body_name_hint(exc.failures, session.ns, RESERVED_NAMES)
                             or module_name_hint(exc.failures, session.ns, plan.model))
            if isinstance(exc, RankError) and exc.group_kept:  # failed before any step: the model is as it was
                exc.add_hint(". ".join(x for x in (kept_weights(plan.model, model_obj, sent), exc.hint) if x))
            if plan.builtin_optimizer and not refused(exc):  # the ranks took the plan: a built-in optimizer was not
                # what failed (a dead engine, the body, ...), and the model is placed as the plan says
                session.holdings.remember(plan, model_obj)
            exc.plan = plan  # what --on-failure shrink goes on with (distnb.elastic.shrinking)
            raise
        result = finish(session, plan, model_obj, rows, time.perf_counter() - t0, num_shards, run, stopped, given,
                        started_shown=state.start_shown, peak_since_start=peak_since_start)
        worlds.note_run(session, None)  # what the ranks hold now, for a kernel that attaches (presses still held)
    session.last_result = result
    session.holdings.loaded = None  # the model of this cell is the one %dist save takes by default now
    record.remember(cell, result, model_obj)
    background = session._background
    if stopped is not None and not (background is not None and background.current_thread_is_runner()):
        # the interrupt stops what runs after the cell too (Jupyter's queued cells, a script's next statement)
        raise Interrupted(f"{stopped}; {plan.model} holds what was trained, and the TrainResult is this error's "
                          ".result (and -o NAME's)", result=result)
    return result


def refused(exc) -> bool:
    """Whether the ranks refused a cell's plan (``exc``: how it failed): a ``StrategyError``, raised before any step
    for options that cannot run the model (a ``--tp-plan`` that changes what it computes, ...): nothing of it carries."""
    return isinstance(exc, RankError) and any(f.get("ename") == "StrategyError" for f in exc.failures)


def finish(session, plan, model_obj, rows, wall_seconds, num_shards, run, stopped=None, given=(), started_shown=False,
           peak_since_start=False):
    """A cell's end: weights back, the notes (``given``: its options), the TrainResult (``stopped``: the Interrupted).

    ``started_shown``: the progress printed the notes on the cell's start already (before its epoch lines).
    ``peak_since_start``: the kernel's peak memory was reset at the cell's start (:mod:`distnb.train.kernel_memory`).

    A run stopped by the interrupt button or ``%dist stop-training`` (every rank after the same
    step) still gives the result of what was trained, marked ``interrupted`` (the interrupt button's:
    :func:`train_cell` raises it as the Interrupted's ``.result``).
    """

    weights_back(session, plan.model, model_obj, packed=rows[0].pop("state"))
    if bigmodels.on_meta(model_obj) and not run.quiet:
        print(f"distnb: {bigmodels.stays_note(plan.model)}")
    for row in rows:
        row.pop("state", None)
        row.update(row.pop("holdings", {}))
    result = results.TrainResult(rows, plan, wall_seconds, num_shards)
    result.kernel_peak_memory, result.kernel_memory_kind = kernel_memory.peak(peak_since_start)  # weights back in
    params = list(model_obj.parameters())  # each shared (tied) parameter once
    result.set_param_counts(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))
    if stopped is not None:
        result.mark_interrupted(str(stopped))
    if not run.quiet:  # run: the cell's RunOptions
        for note in loopcell.notes(rows[0], plan, given, started=not started_shown) + result.step_notes:
            print(f"distnb: {note}")
        # stated once per session, by the first foreground cell that averages (a background run's end prints
        # with %dist wait or stop, whose own words come first)
        background = session._background is not None and session._background.current_thread_is_runner()
        if result.loss_convention and not background and not getattr(session, "loss_convention_said", False):
            session.loss_convention_said = True
            print(f"distnb: {result.loss_convention}")
    session.holdings.trained_steps[plan.model] = rows[0]["global_steps"]
    session.holdings.remember(plan, model_obj)  # what the ranks accepted carries over to the model's next cell
    return result
