"""A training cell started by another kernel, followed from the kernel that attached (issue 38).

The kernel that runs a training cell recorded it (:func:`distnb.train.runrecord.train_on_ranks`). A kernel
that attaches while the cell runs (:mod:`distnb.attaching`) follows it with the same
watcher as the kernel that sent it (:class:`distnb.execute.execute.Watch`: the dashboard, output, dead
ranks, the interrupt, ``%dist stop-training``), over :class:`Followed` results: each rank's
progress and printed output come from the IOPub messages of the original task (ipyparallel's
controller broadcasts a task's output to every client, keyed by its task id), and its end and
figures from :func:`distnb.engine.train.kept.kept_result`, queued on the rank behind the training
itself. The controller keeps no results database (issue 20), so the original task's reply itself
reaches only the kernel that sent it.
"""

from __future__ import annotations

import time

from distnb.cluster import worlds
from distnb.core import calls
from distnb.core.errors import Interrupted
from distnb.core.plan import RunOptions, TrainPlan
from distnb.display import ProgressState, make_view
from distnb.execute.execute import Watch
from distnb.train import results, training


class Followed:
    """One rank's training task sent by another kernel, as an ipyparallel AsyncResult would show it.

    Parameters
    ----------
    kept : ipyparallel.AsyncResult
        This kernel's :func:`~distnb.engine.train.kept.kept_result` call to the rank: ready when the
        training ended there, with its figures (or its error).
    metadata : dict
        The client's metadata of the original task (``client.metadata[msg_id]``): its ``stdout``,
        ``stderr`` and published ``data`` (the progress messages) as they arrive from now on.
    """

    def __init__(self, kept, metadata):
        self._kept = kept
        self._metadata = [metadata]  # read by distnb.execute.execute.metadata, as an AsyncResult's own

    @property
    def msg_ids(self):
        return self._kept.msg_ids

    def ready(self) -> bool:
        return self._kept.ready()

    def successful(self) -> bool:
        return self._kept.successful()

    def wait(self, timeout=-1):
        return self._kept.wait(timeout)

    def get(self, timeout=-1):
        return self._kept.get(timeout)

    def wait_for_output(self, timeout=-1) -> bool:
        """The original task's output goes on arriving on IOPub; what came by now is what is shown."""
        return True


def follow(session, record: dict, model_obj=None):
    """Follow the training cell in ``record`` (its ``run``) to its end from this kernel; its TrainResult.

    The weights go into ``model_obj`` (a notebook module of the same structure) at the end, if given.
    Runs in a :class:`~distnb.train.background.BackgroundRun` (see :func:`distnb.attaching.attach`).
    """
    run = record["run"]
    cluster = session.cluster
    plan = TrainPlan.from_dict(run["plan"])
    shown = run["progress"]
    state = ProgressState(cluster.world_size, shown["total_steps"], shown["epochs"],
                          hosts=[r["host"] for r in cluster.ranks], devices=[r["device"] for r in cluster.ranks],
                          strategy=run["strategy"], ranks_per_shard=shown["ranks_per_shard"],
                          settings=shown.get("settings") or "")
    view = make_view(state, shown.get("view") or "auto")
    view.show()
    kept = cluster.apply_all(calls.kept_result, run["token"])
    ars = [Followed(ar, cluster.client.metadata[msg_id]) for ar, msg_id in zip(kept, run["msg_ids"])]
    stopped = None
    try:
        rows = Watch(session, ars, "training", state, view, (0,)).wait()
    except Interrupted as exc:  # stopped (the interrupt, %dist stop-training): every rank after the same step
        if getattr(exc, "results", None) is None:
            raise
        rows, stopped = exc.results, exc  # what was trained goes into model_obj, as in the kernel that started it
    finally:
        writer = worlds.note_run(session, None)
        if writer is not None:  # %dist wait returns once the record says the cell ended
            writer.join(10.0)
    wall = time.time() - run["started"]
    num_shards = cluster.world_size // max(1, shown["ranks_per_shard"])
    if model_obj is not None:
        rows[0].setdefault("state", None)  # the ranks kept no copy of the weights: they are pulled from the live model
        return training.finish(session, plan, model_obj, rows, wall, num_shards, RunOptions(quiet=True), stopped)
    for row in rows:
        row.pop("state", None)
        row.update(row.pop("holdings", {}))
    result = results.TrainResult(rows, plan, wall, num_shards)
    session.holdings.trained_steps[plan.model] = rows[0]["global_steps"]
    return result
