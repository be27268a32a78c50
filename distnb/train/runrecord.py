"""A training cell's tasks recorded as they start, for a kernel that attaches later (issue 38).

The kernel that runs a training cell sends it to every rank as :func:`distnb.engine.train.kept.train_kept`
under a fresh token (the ranks keep its result under it) and writes the cell into the world record
(:func:`distnb.cluster.worlds.note_run`): its source, strategy, model, the ipyparallel task ids and the client
session that sent them, and what its progress view needs. :mod:`distnb.train.following` follows it from
another kernel.
"""

from __future__ import annotations

import time
import uuid

from distnb.cluster import worlds
from distnb.core import calls
from distnb.execute.execute import Watch


def train_on_ranks(session, plan, code, state, view, show_ranks, run) -> list:
    """Run the training cell ``code`` on every rank, watched; the per-rank figures (rank order).

    ``run``: the cell's :class:`~distnb.core.plan.RunOptions`. The world record holds the cell from
    its start until it ended: a failed or interrupted cell's end is written here, a finished one's by
    :func:`distnb.train.training.train_cell` once the weights are back (one write per end).
    """
    token = uuid.uuid4().hex
    ars = session.cluster.apply_all(calls.train_kept, token, plan.to_dict(), code, None)
    bg = session._background
    run_record = dict(
        cell=code, strategy=plan.strategy, model=plan.model, data=plan.data,
        background=bool(bg is not None and bg.current_thread_is_runner()), started=time.time(),
        msg_ids=[ar.msg_ids[0] for ar in ars], session=session.cluster.client.session.session, token=token,
        plan=plan.to_dict(),
        progress=dict(total_steps=state.total_steps, epochs=state.epochs, ranks_per_shard=state.ranks_per_shard,
                      settings=state.settings, view=run.progress))
    worlds.note_run(session, run_record)  # written by a thread: an interrupt from here on finds the watcher
    try:
        return Watch(session, ars, "training", state, view, show_ranks).wait()
    except BaseException:  # the cell ended here: the record says so (a cell that ends well: training.train_cell)
        worlds.note_run(session, None)
        raise
