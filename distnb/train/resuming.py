"""Which start a training cell's ``--checkpoint-dir`` gives a model the ranks receive fresh, and its sentence.

The kernel decides from the newest checkpoint's metadata before anything is sent
(:func:`newest_start`); the ranks resume as :func:`distnb.engine.train.loop._prepare` does; the
cell's "sent" line says which start it took (:func:`start_sentence`).
"""

from __future__ import annotations

import dataclasses
import os

from distnb.core.errors import PlanError
from distnb.core.plan import DEFAULT_LR, LR_SCHEDULES, optimizer_state_readable


def newest_meta(directory: str | None) -> dict | None:
    """The metadata (``distnb.json``, with its ``path``) of the newest complete checkpoint under ``directory``
    (a ``--checkpoint-dir``, already absolute), or None when there is none (imports torch only then)."""
    if not directory or not os.path.isdir(directory):
        return None
    from distnb.engine.train import checkpoint  # loads numpy, torch: at first use, not when this module is imported

    newest = checkpoint.latest(directory)
    return checkpoint.read_meta(newest) if newest is not None else None


def first_step(plan, steps: int) -> int:
    """The global step count a model sent fresh starts from: ``steps`` (the kernel's count for its weights),
    or the step of ``--checkpoint-dir``'s newest checkpoint when that is further on.

    So a folder's checkpoints are numbered in the order they were written: a cell that starts again
    (``--reset``, a new model) into a folder of older checkpoints writes ``step_*`` after them, where
    it wrote ``step_2`` below a ``step_12`` (which the next resume then took, and which pruning kept
    over the one just written). A resume sets the count from the checkpoint anyway.
    """
    meta = newest_meta(plan.checkpoint_dir)
    return steps if meta is None else max(steps, meta["steps"])


def newest_start(session, plan, model_obj=None):
    """``plan`` with ``resume=False`` when the notebook's weights are newer than the newest checkpoint.

    A model the ranks receive fresh (after ``%dist restart``, say) resumes from
    ``--checkpoint-dir``'s newest checkpoint unless the weights the notebook holds are further
    on (in global steps, which go on from the kernel's count: :func:`distnb.engine.train.install.install_model`);
    at the same step the checkpoint wins, as it also holds the optimizer, the schedule and the
    sampler position. Records ``session.holdings.resume_steps`` for :func:`start_sentence`.
    """
    meta = None if plan.reset else newest_meta(plan.checkpoint_dir)
    if meta is None:
        return plan
    mine = session.holdings.steps_of(plan.model, model_obj)  # None for a new object under the name
    session.holdings.resume_steps = (mine, meta["steps"], meta["optimizer"])
    return dataclasses.replace(plan, resume=False) if mine is not None and mine > meta["steps"] else plan


def push_saved_names(session, meta: dict, plan=None) -> None:
    """Push to the ranks the notebook functions checkpoint ``meta`` was made with, which they rebuild it by.

    Its ``--lr-schedule`` (a notebook ``f(optimizer, total_steps)``; not when ``plan``, the resuming
    cell, names a schedule of its own) and its ``--optimizer`` (a notebook ``f(params)``), looked up in
    the notebook by name: ranks started since (``%dist restart``) hold neither, and the resume failed
    on every rank ("--lr-schedule 'sched' is not a function on this rank").

    Raises
    ------
    PlanError
        The notebook does not define one of them now (or it is not callable): naming it and the fix,
        before anything is sent.
    """
    saved_schedule = (meta.get("scheduler") or {}).get("name")
    wanted = []
    if saved_schedule and saved_schedule not in LR_SCHEDULES and (plan is None or plan.lr_schedule is None):
        wanted.append(("--lr-schedule", saved_schedule, "or give --lr-schedule to start a new schedule instead"))
    if meta.get("optimizer") and meta["optimizer"] not in DEFAULT_LR:
        wanted.append(("--optimizer", meta["optimizer"], "or --reset to start from the notebook's weights with a "
                       "fresh optimizer"))
    for flag, name, other in wanted:
        value = session.ns.get(name)
        if not callable(value):
            now = "does not define now" if name not in session.ns else f"holds as a {type(value).__name__} now"
            raise PlanError(f"the checkpoint {meta['path']} goes on with {flag} {name}, a notebook function, which "
                            f"the notebook {now}: define it again (the same function) to resume with it, {other}")
        session.push(name)


def _schedule_clause(plan, saved) -> str:
    """What a resumed cell's ``--lr-schedule`` does to the checkpoint's live schedule ``saved`` (its record), or ""."""
    if plan.lr_schedule is None or not saved:
        return ""
    at = (saved.get("state") or {}).get("last_epoch")
    where = f" at step {at} of {saved['total']}" if at is not None else ""
    return (f"; this cell's --lr-schedule {plan.lr_schedule} starts a new schedule over its own steps in place of the "
            f"checkpoint's --lr-schedule {saved['name']}{where} (leave --lr-schedule and --warmup-steps out to go on "
            "with it, as the run before would have)")


def start_sentence(plan, resume_steps) -> str:
    """How a model just sent to the ranks starts (``resume_steps``: :func:`newest_start`'s record).

    A resume into another ``--optimizer`` than the checkpoint was saved with takes the weights
    and the position (epoch, sampler, step count) and a fresh optimizer of that kind, as naming
    another ``--optimizer`` does for a live model: the saved state (an SGD's momentum, Adam's
    moments) belongs to the optimizer that made it, and its lr schedule goes with it.
    """
    mine, saved, saved_optimizer = resume_steps
    optimizer = plan.optimizer or "sgd"
    if not plan.reset and plan.resume and newest_meta(plan.checkpoint_dir) is not None:
        newer = "" if mine is None else f"; the notebook's weights are at step {mine}"
        then = f"it resumes from the newest checkpoint in --checkpoint-dir (step {saved}{newer})"
        meta = newest_meta(plan.checkpoint_dir)
        saved_strategy = meta["plan"]["strategy"]
        if not optimizer_state_readable(saved_strategy, plan.strategy):
            then += (f" with a fresh {plan.optimizer or saved_optimizer} optimizer: --strategy {plan.strategy} cannot "
                     f"read the optimizer state --strategy {saved_strategy} saved (its weights and position resume; "
                     f"--strategy {saved_strategy} resumes the optimizer too)")
        elif plan.optimizer not in (None, saved_optimizer):
            then += (f" with a fresh {optimizer} optimizer: the checkpoint's optimizer state is {saved_optimizer}'s "
                     f"(--optimizer {saved_optimizer} resumes it too; --reset starts from the notebook's weights)")
        return then + _schedule_clause(plan, meta.get("scheduler"))
    if not plan.resume:
        return (f"the notebook's weights (step {mine}) are newer than the newest checkpoint in --checkpoint-dir "
                f"(step {saved}), so training goes on from them with a fresh {optimizer} optimizer")
    return f"fresh {optimizer} optimizer, epoch 0"
