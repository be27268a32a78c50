"""Where a training cell's weights go when it ends: back into the notebook's own object, or, when they
cannot come back (a meta model, a process group an interrupt broke), said plainly."""

from __future__ import annotations

from distnb.train import bigmodels
from distnb.transfer.transfer import fingerprint, load_state_into
from distnb.transfer.weights_back import stream_into


def weights_back(session, name, model_obj, best_effort=False, packed=None, replicated=False):
    """Load rank 0's weights into ``model_obj``: ``packed`` from its training result (ps), else streamed in
    parts (:func:`~distnb.transfer.weights_back.stream_into`).

    ``replicated``: every rank holds the whole model (ddp), so with another rank dead rank 0 alone gives
    them (the last step every rank completed), which ``%dist restart`` then sends to the fresh world.
    Returns None, or with ``best_effort`` the exception that kept the weights on the ranks (the caller says so).
    """

    cluster = session.cluster
    if bigmodels.on_meta(model_obj):  # built on meta in the notebook: its weights stay on the ranks
        return
    try:
        dead = cluster.dead_ranks() if packed is None and replicated else {}
        if packed is not None:  # a strategy that sends its state with the result (ps)
            load_state_into(model_obj, *packed)  # in place, one tensor at a time
        elif dead and 0 not in dead:
            stream_into(cluster, name, model_obj, [0])
        else:  # every rank, part by part: sharded strategies assemble each part with collectives
            stream_into(cluster, name, model_obj, range(session.world_size))
        session.holdings.models[name] = fingerprint(model_obj)
    except Exception as exc:
        if not best_effort:
            raise
        return exc
    return None


def interrupted_weights(plan, model_obj, lost) -> str:
    """What became of a model whose ranks an interrupt stopped where they were (``lost``: why its weights could
    not come back, or None): never a claim that the notebook holds what it does not."""
    name = plan.model
    if bigmodels.on_meta(model_obj):
        return (f"{name} was built on the meta device, so its trained weights were only on the ranks, and the "
                f"interrupt broke the process group that holds them: the next cell initialises {name} afresh "
                "(save with --checkpoint-dir to resume from the last checkpoint)")
    if lost is not None:
        return (f"{name}'s weights could not be brought back from the ranks ({type(lost).__name__}: "
                f"{str(lost)[:160]}): the notebook's {name} is as it was before this cell, this cell's steps are "
                f"lost, and the next cell sends {name} to every rank again, with a fresh optimizer (with "
                "--checkpoint-dir, the last checkpoint keeps them)")
    return (f"the next cell sends {name} to every rank again from rank 0's weights (now the notebook's), with a "
            "fresh optimizer")


def kept_weights(name, model_obj, placed_anew: bool = False) -> str:
    """What a training cell whose ranks kept their process group after failing (before any step: the RankError's
    ``group_kept``, :mod:`distnb.engine.train.beforestep`) says about model ``name``.

    Its weights are kept, bit for bit. ``placed_anew``: the cell had placed the model again before the failure
    (another strategy, or a meta model's weights carried into a new placement), which started its optimizer
    state and epoch count afresh, as any such placement does: they are not kept, and the message says so."""
    where = (f"the ranks hold {name} with the weights it started this cell with (it is on the meta device in the "
             "notebook, so they are on the ranks only)" if bigmodels.on_meta(model_obj)
             else f"{name}'s weights are as they were before this cell, in the notebook and on the ranks")
    if not placed_anew:
        return (f"Nothing was lost: every rank stopped before any step, with no collective half-done, so their "
                f"process group was kept, {where}, and so are its optimizer state and epoch count")
    return (f"No weight was lost: every rank stopped before any step, with no collective half-done, so their "
            f"process group was kept, and {where}. Its optimizer state and epoch count were not kept: this cell "
            f"had placed {name} anew (as it said when it started), so its next cell starts them afresh")
