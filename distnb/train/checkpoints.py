"""``%dist save`` and ``%dist load`` in the kernel: checkpoints of the ranks' live model.

The ranks write and read with torch.distributed.checkpoint (:mod:`distnb.engine.train.checkpoint`:
model, optimizer, epoch and sampler position, in ``DIRECTORY/step_<global step>``); the
kernel checks the names, sends the model distributed as the checkpoint was saved, and loads
the restored weights into the notebook's model.
"""

from __future__ import annotations

import dataclasses
import os

from distnb.core import calls, weightfiles
from distnb.core.errors import PlanError
from distnb.core.options import check_path
from distnb.core.carryover import carry_over
from distnb.core.plan import TrainPlan
from distnb.core.tables import count
from distnb.execute.execute import run_on_ranks
from distnb.train import homecoming, meshes, pretrained, record, training
from distnb.train.resuming import push_saved_names


def save(session, name: str, model_obj, directory: str, quiet: bool = False) -> dict:
    """Checkpoint model ``name`` on every rank under ``directory``; its metadata (see Session.save)."""
    directory = check_path("directory", directory)
    if name not in session.holdings.models:
        raise PlanError(f"{name} is not on the ranks (train it with %%distrain, or %dist load weights into it, "
                        "first)")
    directory = os.path.abspath(os.path.expanduser(directory))  # every rank checked it can write it: session_save
    meta = run_on_ranks(session, calls.save_checkpoint, name, directory, what=f"saving {name}", may_keep=True)[0]
    if not quiet:
        print(f"distnb: saved {name} to {meta['path']} (epoch {meta['epoch']}, step {meta['epoch_step']} of it, "
              f"{meta['steps']} steps in all) in {meta['seconds']:.2f} s")
    return meta


def trained_model(session, model=None, directory=None) -> tuple:
    """``(name, object)`` of ``model`` (a notebook name or the object), or of the model the ranks got last: the
    one ``%dist load`` filled since the last training cell, else that cell's model.

    That model may have been given as the object itself (``train(code, model=MLP())``): it has no
    notebook name then, and the session keeps it under the name the cell used (``_distnb_model``).
    ``directory`` is checked first, when given (``save(123)`` names the directory).
    """
    if directory is not None:
        check_path("directory", directory)
    if model is not None:
        return session._named(model, "model")
    loaded = session.holdings.loaded
    if loaded is not None and loaded in session.ns:
        return loaded, session.ns[loaded]
    if session.last_result is None:
        raise PlanError("no model has been trained or loaded in this session; name one (--model NAME, model= in "
                        "Python)")
    name = session.last_result.plan.model
    if name not in session.ns and name in session._bound:  # the last cell was given the object, not a name
        return name, session._bound[name]
    return name, session._lookup(name, "--model")


def model_to_load(session, directory: str, model=None) -> tuple:
    """``(name, object)`` of the notebook model that ``%dist load DIRECTORY`` restores into.

    ``model`` if given; else the model of the session's last training cell; else (no cell has
    trained since the cluster started: after ``%dist restart``, say) the model the checkpoint was
    saved from, when the notebook defines it under the same name.

    Raises
    ------
    PlanError
        No complete checkpoint in ``directory``, or no model named and none known to the kernel
        (the message names the fix: the ``--model`` option, the ``model=`` keyword in Python).
    """
    import torch

    if model is not None or session.last_result is not None:
        return trained_model(session, model)
    if not pretrained.is_checkpoint(check_path("directory", directory)):
        raise PlanError(f"%dist load {directory}: weights files carry no model name: name the notebook model to load "
                        "them into with --model NAME (model=NAME in Python)")
    saved = _meta(directory)["plan"].get("model")
    if isinstance(session.ns.get(saved), torch.nn.Module):
        return saved, session.ns[saved]
    why = (f"is a {type(session.ns[saved]).__name__}, not a torch.nn.Module" if saved in session.ns
           else "is not defined in the notebook")
    raise PlanError(f"no training cell has run since the cluster started, and {saved} (the model the checkpoint in "
                    f"{directory} was saved from) {why}: name the notebook model to load it into with --model NAME "
                    "(model=NAME in Python)")


def _meta(directory: str) -> dict:
    """The checkpoint's metadata (the newest complete one under ``directory``), or a PlanError saying there is none."""
    from distnb.engine.train import checkpoint  # loads numpy, torch: at first use, not when this module is imported

    directory = check_path("directory", directory)
    try:
        return checkpoint.read_meta(os.path.abspath(os.path.expanduser(directory)))
    except FileNotFoundError as exc:
        raise PlanError(str(exc)) from None


def load(session, name: str, model_obj, directory: str, quiet: bool = False, changes=None, strategy=None) -> dict:
    """Restore the checkpoint in ``directory`` into the ranks and ``model_obj``; its metadata (see Session.load).

    ``changes`` (TrainPlan fields) alter the saved plan for this world, e.g. ``{"mesh": "2x2"}``
    (:func:`distnb.train.meshes.plan_changes`): DCP reshards the saved DTensors onto that layout. Without
    them, an fsdp+tensor checkpoint of another world size is laid out on this one as ``%dist scale``
    does (its tensor-parallel size kept), or refused naming the sizes that fit, before anything is sent.
    ``strategy``: for weights files (:func:`load_files`); a checkpoint is restored with its own.
    """
    if not pretrained.is_checkpoint(check_path("directory", directory)):  # safetensors or a Hugging Face folder
        return load_files(session, name, model_obj, directory, quiet, strategy)
    meta = _meta(directory)
    saved = meta["plan"]["strategy"]
    if strategy not in (None, saved):
        raise PlanError(f"%dist load {directory} --strategy {strategy}: a checkpoint is restored as it was saved "
                        f"(--strategy {saved}, with its optimizer and position); for its weights alone under "
                        f"{strategy}, read them in a training cell: %%distrain --load {directory} --strategy "
                        f"{strategy} --model {name} ...")
    if changes is None:
        changes = meshes.plan_changes(meta["plan"], meta.get("world_size") or session.world_size,
                                      session.world_size, f"%dist load {directory}: {name}")
    plan = TrainPlan.from_dict(dict(meta["plan"], model=name, reset=True, checkpoint_dir=None, checkpoint_every=None,
                                    **(changes or {})))
    push_saved_names(session, meta)  # before the model is sent: the load's own error, nothing changed
    training.ensure_model(session, plan, model_obj, quiet=True)
    try:
        run_on_ranks(session, calls.restore, name, meta["path"], changes or None, what=f"loading {name}")
    except BaseException:  # nothing loaded: the next cell sends the notebook's model afresh, with its own options
        for held in (session.holdings.models, session.holdings.distributed):
            held.pop(name, None)
        raise
    session.holdings.remember(dataclasses.replace(plan, optimizer=meta["optimizer"], lr=None), model_obj)  # live now
    session.holdings.lr_of[name] = None
    session.holdings.trained_steps[name] = meta["steps"]
    session.holdings.loaded = name
    homecoming.weights_back(session, name, model_obj)
    record.loaded(name, model_obj, meta)  # the notebook's model agrees with the ranks': no "changed" claim
    if not quiet:
        on_meta = any(t.is_meta for t in model_obj.state_dict().values())  # a meta model gets no weights back
        where = (f"; the notebook's {name} stays on the meta device (%dist pull {name}.PARAM for one tensor)"
                 if on_meta else " and the kernel")
        print(f"distnb: loaded {meta['path']} into {name} on {count(session.world_size, 'rank')}{where} "
              f"(--strategy {plan.strategy}, epoch {meta['epoch']}, step {meta['epoch_step']} of it"
              + (f"; --mesh {plan.mesh}, saved on {meta['plan'].get('mesh') or meta.get('world_size')}"
                 if "mesh" in changes else "") + ")")
    return meta


def load_files(session, name: str, model_obj, path, quiet: bool = False, strategy=None) -> dict:
    """``%dist load PATH --model NAME`` for weights files: into the model distributed for ``strategy``, by default
    as the ranks hold it (the distribution its last cell or load left, as a training cell carries it over), or
    with ddp when it is new to them; then into the notebook's model unless it is on meta.

    Afterwards the model is live on the ranks as a trained one is (``%dist save``, ``%dist pull``, the next cell
    goes on from the loaded weights), with no optimizer until a training cell makes one.

    Returns ``{"path", "kind", "ranks"}`` (the ranks' rows of :func:`distnb.train.pretrained.load_on_ranks`).
    """
    held = session.holdings
    ref = held.objects.get(name)
    last = held.carried.get(name) if ref is not None and ref() is model_obj else None  # net = Net() again: afresh
    given = {} if strategy is None else {"strategy": strategy}
    plan = TrainPlan(model=name, data=name, **carry_over(last, given), **given)
    plan = TrainPlan.from_dict(dict(plan.to_dict(), load=weightfiles.absolute(path), checkpoint_dir=None,
                                    checkpoint_every=None))
    checked = pretrained.check(plan, model_obj)
    training.ensure_model(session, plan, model_obj, quiet=True)
    rows = pretrained.load_on_ranks(session, plan, checked, quiet)
    session.holdings.remember(plan, model_obj)
    session.holdings.loaded = name  # live on the ranks as a trained model: %dist save, pull, the next cell
    homecoming.weights_back(session, name, model_obj)  # nothing for a meta model: its weights stay on the ranks
    return dict(path=checked["found"]["path"], kind=checked["found"]["kind"], ranks=rows)
