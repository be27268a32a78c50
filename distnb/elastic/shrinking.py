"""``%dist start --on-failure shrink``: a training cell whose engine died goes on on the survivors.

When an engine dies during a ``%%distrain`` cell (killed, crashed, out of memory), the other
ranks' collectives fail and the cell's failure path reports it (:mod:`distnb.execute.execute`). With
``--on-failure shrink`` the training cell (:func:`distnb.train.training.train_cell`) then hands the
failure here instead of raising it: the dead ranks are dropped, the survivors keep their order
and are numbered again from 0, the process group is formed again at the smaller world
(:func:`distnb.engine.elastic.resize`), and the cell trains what was left of its epochs there.

- ddp: every replica holds the last completed optimizer step (a step whose gradient
  all-reduce failed was applied on no rank), so training goes on from it; to be sure they are
  identical, rank 0 broadcasts its state to the others (:func:`distnb.engine.elastic.share`).
- fsdp, tensor, pipeline, ps: the dead rank's shards are gone; the kernel sends the model again
  and it resumes from the newest checkpoint in ``--checkpoint-dir`` (resharded by DCP, its
  sampler position converted); without ``--checkpoint-dir`` the cell fails as with ``stop``.
  fsdp+tensor goes on on the mesh of the same tensor-parallel size (:func:`distnb.train.meshes.refit`:
  ``--mesh 3x1`` on 2 survivors is ``2x1``); when that size does not divide the survivors the
  cell fails saying so (``%dist scale`` to a size that works, then run it again).

Tensor data sets are dealt again into the new world's shards, so the dead rank's samples are
trained by the survivors. The cell ends by saying what was lost: the rank, where it last reported
being (epoch, step) and how it died, the steps that were not kept (ddp: none that completed; a resume: those
after the checkpoint), and the samples re-assigned. The TrainResult is the part trained after
the shrink; ``result.lost`` holds the report as a dict.
"""

from __future__ import annotations

from distnb.core import calls
from distnb.core.errors import ClusterError, RankError, position
from distnb.core.plan import STRATEGIES, TrainPlan
from distnb.core.tables import count
from distnb.elastic import scaling
from distnb.train import meshes
from distnb.train.results import _lost_steps, summary
from distnb.train.resuming import newest_meta


def train_cell(session, code, model, data, run, given):
    """:func:`distnb.train.training.train_cell` after ``%dist scale --keep-global-batch``'s batch rule; with
    ``--on-failure shrink``, an engine death during it makes the cell go on on the survivors (:func:`go_on`)."""
    from distnb.train import training  # loads psutil: at first use, not when this module is imported

    try:
        fitted = scaling.batch_for_world(session, dict(given), model if isinstance(model, str) else None)
        result = training.train_cell(session, code, model, data, run, fitted)  # (a retry fits the cell's own again)
        plan = getattr(result, "plan", None)  # (a background run's handle has none)
        if plan is not None:
            session.holdings.last_plans[plan.model] = (plan, False)
        return result
    except RankError as exc:
        if getattr(exc, "plan", None) is not None:  # its --checkpoint-dir: where a lost rank's shards may be
            session.holdings.last_plans[exc.plan.model] = (exc.plan, True)
        dead = dead_to_drop(session, exc)
        if not dead or getattr(exc, "plan", None) is None:
            raise
        return go_on(session, exc.plan, dead, exc, lambda epochs, changes=None: train_cell(
            session, code, model, data, run, dict(rest_of(given, epochs), **(changes or {}))))
    finally:
        session.holdings.batch_world.pop(None, None)  # the cell's rewrite: recorded for %dist export by now


def dead_to_drop(session, exc) -> dict:
    """{rank: how it died} when ``exc`` is an engine death ``--on-failure shrink`` goes on after; else {}."""
    if getattr(session, "on_failure", "stop") != "shrink" or not isinstance(exc, RankError) or not session.running:
        return {}
    dead = session.cluster.dead_ranks()
    if not dead or len(dead) >= session.world_size or session.cluster.launcher != "local":
        return {}
    return dead


def go_on(session, plan, dead: dict, failure: RankError, retry):
    """Drop the ``dead`` ranks, form the smaller world, and train the rest of the cell with ``retry(epochs)``.

    Parameters
    ----------
    plan : TrainPlan
        The cell's plan (its ``epochs``, ``strategy``, ``checkpoint_dir``).
    dead : dict
        Rank -> how its engine died (:meth:`distnb.cluster.cluster.Cluster.dead_ranks`).
    failure : RankError
        The cell's error, raised (with what happened added) when the cell cannot go on.
    retry : callable
        ``retry(epochs, changes)`` runs the cell again with ``epochs`` epochs (and the options
        ``changes``: an fsdp+tensor ``--mesh`` for the smaller world) and returns its TrainResult.

    Returns
    -------
    TrainResult
        Of the part trained after the shrink, with ``lost`` (dict: ranks, where, world_size,
        steps_lost, samples_reassigned, resumed_from). ``where`` maps each lost rank to the
        ``(epoch, step)`` it last reported (its last progress message, as its RankError says it:
        ``last reported at epoch E, step S``; messages come every 0.1 s with the dashboard, 2 s with
        text progress, only at epoch ends with none, so the rank may have got further before its
        engine died), ``(None, None)`` if it reported none.

    Raises
    ------
    RankError
        ``failure``, when a sharded model has no checkpoint to go on from, or an fsdp+tensor
        model's tensor-parallel size does not divide the survivors (the world is smaller by
        then and usable).
    ClusterError
        The smaller world could not be formed: run ``%dist restart``.
    """
    cluster = session.cluster
    old = cluster.world_size
    # the same source as the RankError's "last reported at epoch E, step S": the dead rank's last progress message
    where = {f["rank"]: (f.get("epoch"), f.get("step")) for f in failure.failures if f["rank"] in dead}
    said = {r: f"{cluster.describe(r)}: {how}" for r, how in dead.items()}
    reassigned = _samples_of(session, plan.data, sorted(dead), old)
    try:
        positions = _drop(session, dead)
    except Exception as exc:
        raise ClusterError(f"{failure}\n--on-failure shrink: the world without ranks {sorted(dead)} could not be "
                           f"formed ({str(exc).splitlines()[0]}); run %dist restart") from None
    n = session.world_size
    epoch, _, steps, first = positions.get(plan.model, (None, 0, 0, 0))
    resumed, changes = None, {}
    if STRATEGIES[plan.strategy][1]:  # sharded in place: the newest checkpoint, if any
        meta = newest_meta(plan.checkpoint_dir)
        if meta is None:
            _cannot_go_on(failure, dead, f"--on-failure shrink: the world is now {count(n, 'rank')} and usable, but "
                          f"--strategy {plan.strategy} keeps no copy of the lost shards: give --checkpoint-dir to go "
                          "on from the newest checkpoint")
        changes = _mesh_for(session, plan, old, n, failure, dead)
        resumed, epoch = meta, meta["epoch"] + _finished(session, plan, meta)
    left = plan.epochs - ((epoch if epoch is not None else first) - first)
    lost = dict(ranks=said, where=where, world_size=(old, n), samples_reassigned=reassigned,
                steps_lost=(steps - resumed["steps"]) if resumed else 0,
                resumed_from=resumed["path"] if resumed else None)
    _say(lost, n, left)
    result = retry(max(1, left), changes)
    result.lost = lost
    print(f"distnb: {summary(lost)}")
    return result


def _finished(session, plan, meta: dict) -> int:
    """1 when checkpoint ``meta`` was saved at its epoch's last step (the resume starts the next epoch), else 0.

    As the ranks decide it (:func:`distnb.engine.train.loop._train`): an epoch whose samples per
    rank are all trained (or, with ``--drop-last``, all but less than a batch) is done. Known
    for tensor data sets the kernel scattered; 0 for others.
    """
    from distnb.engine import strategies  # loads numpy, torch: at first use, not when this module is imported
    from distnb.engine.transport import shard  # loads numpy, torch: at first use, not when this module is imported

    info = session.holdings.data.get(plan.data) or {}
    if "num_samples" not in info or not meta.get("epoch_samples"):
        return 0
    try:
        saved = TrainPlan.from_dict(dict(meta["plan"], model=plan.model))
        dp = strategies.data_parallel_size(saved, meta.get("world_size") or session.world_size)
    except Exception:  # a plan this version cannot read: as saved
        return 0
    left = shard.samples_per_epoch(info["num_samples"], dp, plan.drop_last) - meta["epoch_samples"]
    return int(left <= 0 or (plan.drop_last and left < plan.batch_size))


def _cannot_go_on(failure: RankError, dead: dict, note: str):
    """Raise ``failure`` with ``note`` (why the cell cannot go on on the survivors) added to the dead ranks' errors."""
    for f in failure.failures:
        if f["rank"] in dead:
            f["evalue"] = f"{str(f['evalue']).split('; run %dist restart')[0]}; {note}"
    raise RankError(failure.failures, context=failure.context) from None


def _mesh_for(session, plan, old: int, n: int, failure: RankError, dead: dict) -> dict:
    """fsdp+tensor: ``{"mesh": DPxTP}`` for the ``n`` survivors, the tensor-parallel size kept (else {}).

    The model's carried ``--mesh`` is rewritten too. When ``TP`` does not divide ``n`` the cell
    cannot go on: ``failure`` is raised, saying why and what to do.
    """

    if plan.strategy != meshes.STRATEGY:
        return {}
    try:
        mesh = meshes.refit(plan.mesh, old, n, f"--on-failure shrink: {plan.model}")
    except Exception as exc:
        _cannot_go_on(failure, dead, f"the world is now {count(n, 'rank')} and usable, but {exc}; %dist scale to "
                      f"one of them, then run the cell again (it resumes from the newest checkpoint in "
                      f"{plan.checkpoint_dir})")
    carried = session.holdings.carried.get(plan.model)
    if carried is not None:
        carried["mesh"] = mesh
    print(f"distnb: --on-failure shrink: {plan.model} goes on on --mesh {mesh} (the tensor-parallel size kept)")
    return {"mesh": mesh}


def rest_of(given: dict, epochs: int) -> dict:
    """The options that train the rest of a cell: its own, with ``epochs`` left and what would start afresh dropped.

    ``--reset``, ``--lr`` and ``--lr-schedule`` (with ``--warmup-steps``) took effect when the cell
    began; given again they would reset the model, the learning rate or the schedule mid-cell.
    """
    rest = {k: v for k, v in given.items() if k not in ("reset", "lr", "lr_schedule", "warmup_steps")}
    rest["epochs"] = epochs
    return rest


def _say(lost: dict, n: int, left: int) -> None:
    for rank, text in sorted(lost["ranks"].items()):
        epoch, step = lost["where"].get(rank, (None, None))
        at = f"; {position(dict(epoch=epoch, step=step, reported=True))}" if None not in (epoch, step) else ""
        print(f"distnb: --on-failure shrink: {text}{at}; going on on {count(n, 'surviving rank')} "
              f"({count(left, 'epoch')} left)")


def _samples_of(session, name: str, dead: list, old: int) -> int:
    """Samples of the cell's tensor data set ``name`` that the ``dead`` ranks held, now dealt to the survivors
    (the other sets the ranks held are dealt again too, :func:`distnb.elastic.scaling._reassign_data`, but the cell's
    message is about its own data)."""
    from distnb.engine.transport import shard  # loads numpy, torch: at first use, not when this module is imported

    info = session.holdings.data.get(name) or {}
    if "structure" not in info or info["num_shards"] != old:
        return 0
    return sum(shard.shard_length(info["num_samples"], old, r) for r in dead)


def _drop(session, dead: dict) -> dict:
    """The world without ``dead``: survivors numbered again in order, the group re-formed, rank 0's state shared.

    Returns the positions :func:`distnb.engine.elastic.share` reports (model -> (epoch, epoch_samples,
    steps, the epoch the cell started at)).
    """
    cluster = session.cluster
    old = cluster.world_size
    keep = [r for r in range(old) if r not in dead]
    cluster.remove_ranks(dead)  # reap what is left of them; the survivors numbered again
    cluster.form_group(len(keep), old)
    held = session.holdings
    held.generation += 1  # sharded models are sent again (and resume from their checkpoint)
    infos = cluster.wait_all(cluster.apply_all(calls.share, sorted(held.names), 1, False), timeout=cluster.spec.timeout + 60,
                             what="sharing rank 0's state with the survivors")
    scaling._reassign_data(session, old, len(keep))
    cluster.rewatch()
    return infos[0]["positions"]
