"""Kernel side of ``--load PATH`` (``%%distrain --load``, ``%dist load``): check in the kernel, read on the ranks.

:func:`check` finds what PATH holds and holds it against the notebook's model before anything is sent
(:mod:`distnb.weightfiles`: the index and headers only); :func:`load_on_ranks` then has every rank read
the slices it holds (:func:`distnb.engine.pretrained.load_weights`).
"""

from __future__ import annotations

import time

from . import calls
from .display.tables import count
from .errors import PlanError
from .execute import run_on_ranks
from .weightfiles import absolute, find, is_checkpoint, match


def check(plan, model_obj) -> dict | None:
    """Before the model is sent: what ``plan.load`` holds, matched to ``model_obj`` (None without ``--load``).

    Returns ``{"found", "aliases", "note"}`` (:func:`find`, :func:`match`).

    Raises
    ------
    PlanError
        As :func:`find` and :func:`match`; ``--strategy ps``, whose servers hold the parameters in their
        own layout; ``--checkpoint-dir`` holding a checkpoint to resume from (it would replace the loaded
        weights).
    """
    if plan.load is None:
        return None
    if plan.strategy == "ps":
        raise PlanError("--load does not go with --strategy ps (its servers keep the parameters in their own "
                        "layout): load under ddp (%dist load PATH --model NAME), then train with --strategy ps")
    if plan.checkpoint_dir is not None and is_checkpoint(plan.checkpoint_dir) and not plan.reset:
        raise PlanError(f"--load {plan.load} and --checkpoint-dir {plan.checkpoint_dir}, which holds a checkpoint "
                        "to resume from: give one of them (or --reset to start from the loaded weights)")
    found = find(plan.load)
    return dict(found=found, **match(found, model_obj, plan.model))


def load_on_ranks(session, plan, checked: dict, quiet: bool = False) -> list:
    """Every rank reads its slices of ``checked`` (:func:`check`) into model ``plan.model``, sent just before.

    Returns the ranks' rows ``{"rank", "bytes"}``. On a failure the ranks' model counts as not held, so
    the next cell sends the notebook's model afresh.
    """
    found = checked["found"]
    if checked["note"] and not quiet:
        print(checked["note"])
    t0 = time.perf_counter()
    try:
        rows = run_on_ranks(session, calls.load_weights, plan.model, plan.to_dict(), found, checked["aliases"],
                            what=f"loading {found['path']}")
    except BaseException:  # half loaded: the next cell sends the notebook's model afresh
        for held in (session.holdings.models, session.holdings.distributed):
            held.pop(plan.model, None)
        raise
    if not quiet:
        largest = max(rows, key=lambda r: r["bytes"])
        print(f"distnb: loaded {found['path']} into {plan.model} on {count(session.world_size, 'rank')} "
              f"(--strategy {plan.strategy}; each rank read the slices it holds, at most "
              f"{largest['bytes'] / (1 << 20):.1f} MiB) in {time.perf_counter() - t0:.2f} s")
    return rows


def load_verb(session, name: str, model_obj, path, quiet: bool = False) -> dict:
    """``%dist load PATH --model NAME`` for weights files: into the model as the ranks hold it (its last cell's
    distribution), or sent with ddp when they do not hold it; then into the notebook's model unless it is on meta.

    Returns ``{"path", "kind", "ranks"}`` (the ranks' rows of :func:`load_on_ranks`).
    """
    from . import training  # training imports this module: the verb reaches back for sending and weights back
    from .plan import TrainPlan

    last = session.holdings.last_plans.get(name)
    plan = (last[0] if last else None) or TrainPlan(model=name, data=name)
    plan = TrainPlan.from_dict(dict(plan.to_dict(), load=absolute(path), checkpoint_dir=None, checkpoint_every=None))
    checked = check(plan, model_obj)
    training.ensure_model(session, plan, model_obj, quiet=True)
    rows = load_on_ranks(session, plan, checked, quiet)
    session.holdings.remember(plan, model_obj)
    training.weights_back(session, name, model_obj)  # nothing for a meta model: its weights stay on the ranks
    return dict(path=checked["found"]["path"], kind=checked["found"]["kind"], ranks=rows)
