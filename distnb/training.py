"""Training preparation in the kernel: what the ranks hold, and what a training cell must send first.

A ``%%distrain`` cell's options become a :class:`~distnb.plan.TrainPlan` here
(:func:`make_plan`); then :func:`prepare` sends only what the ranks lack: the names the
body reads (:func:`autopush`), the model (:func:`ensure_model`, whose reuse decision is
:func:`distnb.plan.redistribution`, the same rule the ranks apply) and the data's shards
(:func:`ensure_data`). :class:`Holdings` records all of it; :func:`weights_back` loads the
trained weights into the kernel's model when the cell ends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import calls, data
from .display.tables import count
from .errors import PlanError
from .plan import TrainPlan, redistribution

#: Names a training body gets from distnb, never pushed from the notebook.
RESERVED_NAMES = frozenset({"batch", "model", "optimizer", "ctx", "loss", "rank", "world_size", "local_rank",
                            "device"})


@dataclass
class Holdings:
    """What the kernel knows the ranks hold, so a cell sends only what changed.

    Attributes
    ----------
    models : dict
        Model name -> fingerprint of the kernel object the ranks hold.
    distributed : dict
        Model name -> (strategy key, generation) it was last distributed with.
    data : dict
        Data set name -> dict(fingerprint, seed, num_samples, shards, structure, num_shards, layout).
    pushed : dict
        Name -> fingerprint of what an automatic push sent.
    optimizer_of : dict
        Model name -> (optimizer, lr) the user chose last; survives restarts.
    generation : int
        Bumps whenever the process group is re-formed.
    """

    models: dict = field(default_factory=dict)
    distributed: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    pushed: dict = field(default_factory=dict)
    optimizer_of: dict = field(default_factory=dict)
    generation: int = 0

    def forget(self) -> None:
        """Drop what the ranks held (they are gone); the user's optimizer choices stay."""
        for held in (self.models, self.distributed, self.data, self.pushed):
            held.clear()

    def remember_optimizer(self, plan) -> None:
        """The optimizer and lr ``plan`` asked for become the model's choice for optimizers made new later."""
        if plan.optimizer is not None:
            known = self.optimizer_of.get(plan.model)
            same = known is not None and known[0] == plan.optimizer
            self.optimizer_of[plan.model] = (plan.optimizer, plan.lr if plan.lr is not None else
                                             known[1] if same else None)


def has_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a complete checkpoint (imports torch.distributed.checkpoint only then)."""
    if not os.path.isdir(directory):
        return False
    from .engine import checkpoint

    return checkpoint.latest(directory) is not None


def make_plan(session, model_name, model_obj, data_name, given: dict) -> TrainPlan:
    """The TrainPlan of a cell: ``given`` options plus the optimizer the user chose for this model last.

    Raises PlanError for a bad option, a model that is not a Module, a bad ``--optimizer``
    name or a strategy that cannot run the model on this world.
    """
    import torch

    from .engine import strategies

    remembered = session.holdings.optimizer_of.get(model_name)
    if remembered is not None and given.get("optimizer") is None:
        # the ranks keep their live optimizer anyway; one made new (the model sent again after a
        # restart, a strategy switch, --reset or a changed model) is the one the user chose last
        given["optimizer"] = remembered[0]
        if given.get("lr") is None:
            given["lr_if_new"] = remembered[1]
    plan = TrainPlan(model=model_name, data=data_name, **given)
    if not isinstance(model_obj, torch.nn.Module):
        raise PlanError(f"--model {model_name} is a {type(model_obj).__name__}, not a torch.nn.Module")
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
    return plan


def prepare(session, plan, code, model_obj, data_obj, quiet) -> tuple:
    """Send what the ranks lack for ``plan``: named objects, the body's names, the model, the shards.

    Returns
    -------
    (num_shards, steps_per_epoch) : tuple of int
    """
    from .engine import strategies

    if not plan.builtin_optimizer:
        session.push(plan.optimizer)
    num_shards = strategies.data_parallel_size(plan, session.world_size)
    for option, flag in ((plan.loss, "--loss"), (plan.tp_plan, "--tp-plan"), (plan.collate, "--collate")):
        if option is not None:
            session._lookup(option, flag)
            session.push(option)
    autopush(session, code, exclude=(model_obj, data_obj))
    sent = ensure_model(session, plan, model_obj, quiet)
    ensure_data(session, plan, data_obj, quiet or not sent, num_shards, silent=quiet)
    return num_shards, data.steps_of(plan, session.holdings.data[plan.data], num_shards)


def autopush(session, code, exclude=()) -> None:
    """Push the notebook names a training body reads (modules, functions, classes, values).

    Re-sent only when the kernel's object changed (a re-run defining cell makes a new
    object), so the ranks always use the current definitions.
    """
    from .transfer import fingerprint, free_names

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
    if todo:
        session.push(auto=True, **{k: v for k, (v, _) in todo.items()})
        session.holdings.pushed.update({k: fp for k, (_, fp) in todo.items()})


def ensure_model(session, plan, model_obj, quiet) -> bool:
    """Send the model unless the ranks hold this state, distributed in a way that can be reused.

    The decision is :func:`distnb.plan.redistribution`: a strategy that shards the module in
    place (fsdp, tensor, pipeline, ps) cannot be re-distributed another way, nor survive a
    re-formed process group, so the model is then sent again from the kernel's weights
    (which are the last trained ones). Returns whether it was sent.
    """
    from .engine.wire import pack
    from .transfer import fingerprint, outgoing

    held = session.holdings
    fp = fingerprint(model_obj)
    key = plan.strategy_key()
    verdict = redistribution(held.distributed.get(plan.model), key, held.generation)
    held.distributed[plan.model] = (key, held.generation)
    if not plan.reset and verdict != "resend" and held.models.get(plan.model) == fp:
        return False
    cluster = session.cluster
    payload, descs, buffers = pack(model_obj)
    with outgoing(cluster, buffers) as sent:  # shared memory on one host, else zero-copy frames
        ars = cluster.apply_all(calls.install_model, plan.model, payload, descs, *sent)
        counts = cluster.wait_all(ars, timeout=cluster.spec.timeout + 60, what=f"sending {plan.model}")
    held.models[plan.model] = fp
    if not quiet:
        if plan.checkpoint_dir and not plan.reset and has_checkpoint(plan.checkpoint_dir):
            then = "it resumes from the newest checkpoint in --checkpoint-dir"
        else:
            then = f"fresh {plan.optimizer or 'sgd'} optimizer, epoch 0"
        print(f"distnb: sent {plan.model} ({type(model_obj).__name__}, {counts[0]:,} parameters) to "
              f"{count(session.world_size, 'rank')}; {then}")
    return True


def ensure_data(session, plan, data_obj, quiet, num_shards, silent=False) -> None:
    """Scatter ``data_obj`` (tensors), or have the ranks load it (a Dataset, ``make``, ``--data-on-ranks``:
    :func:`distnb.data.ensure_dataset`), unless the ranks hold it cut this way; say which path
    and how batches are cut when that changes (unless ``silent``)."""
    from .transfer import fingerprint

    path, why = data.path_of(plan, data_obj)
    info = session.holdings.data.get(plan.data)
    if path != "tensors":
        info, changed = data.ensure_dataset(session, plan, data_obj, path, why, num_shards)
        layout = (plan.batch_size, plan.drop_last, plan.workers, plan.steps_per_epoch)
        if (changed or info.get("layout") != layout) and not silent:
            print(f"distnb: {data.describe_loaded(plan, info, session.world_size)}")
        info["layout"] = layout
        return
    if info is None or "structure" not in info or info["fingerprint"] != fingerprint(data_obj) or \
            info["seed"] != plan.seed or info["num_shards"] != num_shards:
        data.scatter(session, plan.data, data_obj, plan.seed, num_shards)
        info = session.holdings.data[plan.data]
        quiet = False
    layout = (plan.batch_size, plan.drop_last)
    if info.get("layout") != layout:  # say how batches are cut whenever that changes
        info["layout"] = layout
        quiet = False
    if not (quiet or silent):
        print(f"distnb: {data.describe_cut(plan, info, num_shards, session.world_size)}; the tensor fast path "
              f"({type(data_obj).__name__}: {why})")


def weights_back(session, name, model_obj, best_effort=False, packed=None) -> None:
    """Load rank 0's weights (``packed`` from its training result, else fetched) into ``model_obj``."""
    from .transfer import fingerprint, load_state_into

    cluster = session.cluster
    try:
        if packed is None:  # every rank: sharded strategies assemble the state with collectives
            ars = cluster.apply_all(calls.pull_state, name)
            packed = cluster.wait_all(ars, timeout=cluster.spec.timeout, what="weights back")[0]
        keys, descs, sizes, flat = packed
        load_state_into(model_obj, keys, descs, sizes, flat)
        session.holdings.models[name] = fingerprint(model_obj)
    except Exception:
        if not best_effort:
            raise
