"""``%dist scale N``: grow or shrink the running world, keeping what the ranks hold.

Growing starts ``N - W`` engines beside the running ones (forked from the engine template,
like ``%dist start``'s; over ssh, on the hosts that run the fewest engines), ranked after them;
shrinking stops the highest ranks (each leaves the process group and exits, on its host). The
cluster does the engine work (:class:`distnb.cluster.engines.Engines`: ``add_engines``, ``add_ranks``,
``form_group``, ``remove_ranks``, ``rewatch``); mpiexec and batch-job worlds cannot be resized
(a PlanError saying why, and ``%dist restart -n N``). Then the process group is formed again at ``N`` ranks on a
fresh port (:func:`distnb.engine.elastic.resize` on the ranks that stay, ``setup`` on the
added ones) and rank 0 broadcasts to the added ranks what the others hold: each ddp model
with its optimizer state, lr schedule, loss scale, epoch, global step and sampler position,
the names pushed earlier and the names ``%%dist`` cells defined on the ranks that the added
ranks lack (:func:`distnb.engine.elastic.share`, over torch.distributed, not through the
kernel). fsdp, tensor and fsdp+tensor models are saved with DCP by the old world and loaded
resharded by the new one (fsdp+tensor on the mesh of the same tensor-parallel size,
:mod:`distnb.train.meshes`). Tensor data sets the kernel scattered are dealt again into ``N``
shards (the same seeded assignment, :mod:`distnb.engine.transport.shard`); data sets loaded on the
ranks, and pipeline and ps models, are sent again by the next training cell, which says so.

The global batch (``data-parallel ranks x --batch-size x --accumulate``) changes with the
world unless ``keep_global_batch``: then the batch options of the following cells of the models
live at the scale are read as written for the world before it, and each such cell trains the
per-rank batch (or accumulation) that keeps that global batch, and says so (:func:`batch_for_world`);
a later scale without the flag (the same size too) ends it. An epoch left in the middle goes on with
exactly the samples it has not trained (:mod:`distnb.engine.train.epochrest`, :mod:`distnb.elastic.midepoch`).

Faults: a world with a dead rank that would stay is refused before any engine starts (naming
the rank, how it died, and ``%dist restart -n N`` or a scale that drops it); an engine that does
not start (or dies before the new group forms) is stopped and the old world is formed again, its
state intact, and so it is after an interrupt (one line, :class:`~distnb.core.errors.Interrupted`); a
rank lost while the group re-forms is reported with how it died and ``%dist restart`` starts a
fresh world.

Idea: torchelastic and Horovod Elastic re-form the group and broadcast rank 0's state to the
workers that join, but restart every worker process to do it; here the engines that stay keep
their Python state.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

from distnb.cluster import startup
from distnb.cluster.recovery import dead_rank_fix
from distnb.core import calls
from distnb.core.errors import ClusterError, Interrupted, PlanError, RankError
from distnb.core.plan import STRATEGIES, TrainPlan
from distnb.core.tables import count
from distnb.elastic import keepbatch, lostshards, midepoch
from distnb.train import meshes
from distnb.transfer import data
from distnb.transfer.transfer import fingerprint

#: Called with the pids of the engines a grow started, once they registered (tests kill one here).
ON_ENGINES_STARTED: list = []


def scale(session, n, keep_global_batch: bool = False, quiet: bool = False) -> dict:
    """Grow or shrink the running world to ``n`` ranks, keeping the ranks' state (``%dist scale N``).

    Parameters
    ----------
    n : int
        The new world size (ranks), at least 1 and at most what the launcher can place (local
        CPU engines: 16 per core; GPU engines: one per visible GPU; ssh: per host
        ``--engines-per-node``, else 16 per core or one per GPU of that host).
    keep_global_batch : bool
        Keep the global batch (samples per optimizer step over all ranks) of the models live now: their
        following cells' ``--batch-size`` (or ``--accumulate``) is scaled for the new world, and each
        cell it changes says so; a model made later trains its batch as written. Without it the per-rank
        batch stays and the global batch changes (the scale says so), and an earlier keeping ends.
    quiet : bool
        Print nothing.

    Returns
    -------
    dict
        ``world_size`` (before, after), ``seconds`` (float, s), ``added``/``removed`` (ranks), ``models``/``names``
        (carried to the added ranks), ``defined`` (names ``%%dist`` cells defined on the ranks, carried),
        ``unpicklable`` ({name: why} of those that could not be sent), ``bytes`` (tensor bytes broadcast),
        ``resharded`` (fsdp, tensor and fsdp+tensor models resharded through a DCP checkpoint), ``meshes``
        (fsdp+tensor model -> its ``--mesh`` on the new world: the tensor-parallel size kept, ``DP = N / TP``,
        ``distnb.train.meshes``), ``global_batch`` (before, after) or None when no model has been trained,
        ``unconfirmed`` (removed ssh engines whose exit their host did not confirm; normally empty), ``resumed``
        (sharded model -> the checkpoint it resumed from, its shards on a dead rank lost: ``distnb.elastic.lostshards``),
        ``binding`` (``--cpu-bind``: what changed, ``""``: nothing).

    Raises
    ------
    PlanError
        ``n`` below 1 or beyond what the launcher can place, a launcher other than ``local`` and ``ssh`` (mpiexec's
        world and a batch job's allocation are fixed), a global batch ``keep_global_batch`` cannot split evenly
        over ``n`` ranks, or a live fsdp+tensor model whose tensor-parallel size does not divide ``n``. Nothing changed.
    BusyError
        A background training run is going on.
    ClusterError
        A rank the new world (its own size too) keeps is dead (nothing changed, no engine started), a dead rank held
        shards of a live sharded model that has no checkpoint to resume from (nothing changed), the added engines
        did not start (over ssh: naming the host) or form the group (the old world is formed again
        and usable), or a rank died while the group re-formed (then run ``%dist restart``).
    Interrupted
        Interrupted: the engines it started are stopped, the old world is formed again (one line).
    """
    session._check_running()
    cluster = session.cluster
    old = cluster.world_size
    _check(cluster, n)  # and that no rank it keeps is dead (before any engine starts or stops; the same size too)
    if n == old:
        return _same_size(session, n, keep_global_batch, quiet)
    batches = _global_batches(session, old, n, keep_global_batch)
    t0 = time.perf_counter()
    held = session.holdings
    mesh_before = _meshes(held)
    points = lostshards.resume_points(session, n)  # a dead rank's shards: its newest checkpoint, or refused
    saved = dict(points) if cluster.dead_ranks() else _save_sharded(session, n)  # sharded: a DCP checkpoint
    was_bound = startup.bound_here(cluster)
    try:
        if n > old:
            shared = _grow(session, n)
        else:
            shared = _shrink(session, n)
    finally:  # the group was re-formed (at n, or at old after a failed grow): ddp wrappers are rebuilt
        held.generation += 1
        resharded = _load_sharded(session, saved)
        meshes.carry(held, old, session.world_size)  # fsdp+tensor: the tensor-parallel size kept, DP = N / TP
    ended = keepbatch.after_scale(session, old, keep_global_batch)
    dealt = _reassign_data(session, old, n)
    out = dict(world_size=(old, n), seconds=time.perf_counter() - t0, added=list(range(old, n)),
               removed=list(range(n, old)), models=shared.get("models", []), names=shared.get("names", []),
               defined=shared.get("defined", []), unpicklable=shared.get("unpicklable", {}),
               bytes=shared.get("bytes", 0), resharded=resharded, global_batch=batches and batches[:2],
               meshes={m: v for m, v in _meshes(held).items() if v != mesh_before.get(m)},
               unconfirmed=shared.get("unconfirmed", []), binding=startup.rebinding_note(session.cluster, was_bound),
               resumed={m: points[m][1]["path"] for m in resharded if m in points})
    if not quiet:
        _say(session, out, dealt, batches, keep_global_batch, points, ended)
    return out


def _same_size(session, n: int, keep: bool, quiet: bool) -> dict:
    """``%dist scale N`` at the world's own size: nothing changes, but without the flag ``--keep-global-batch`` ends."""
    ended = [] if keep else keepbatch.end(session)  # a scale without the flag ends it, as documented
    if not quiet:
        print(f"distnb: the world already has {count(n, 'rank')}; nothing changed" + keepbatch.ended_note(ended))
    return dict(world_size=(n, n), seconds=0.0, added=[], removed=[], models=[], names=[], defined=[],
                unpicklable={}, bytes=0, resharded=[], global_batch=None, meshes={}, binding="", resumed={})


def _check(cluster, n) -> None:
    """A PlanError unless ``n`` ranks can be placed by this cluster's launcher, a ClusterError when a rank that
    a world of ``n`` keeps is dead (:func:`_check_alive`; the world's own size keeps every rank, so a scale that
    would change nothing says so too); nothing changes."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PlanError(f"%dist scale N: N is the new number of ranks, a whole number of at least 1; got {n!r}")
    cluster.check_resizable(n)
    _check_alive(cluster, n, cluster.world_size)


def _check_alive(cluster, n: int, old: int) -> None:
    """A ClusterError (nothing changed, no engine started) when a rank the world of ``n`` keeps has a dead engine.

    Growing, and a scale to the world's own size, keep every rank; shrinking keeps ranks below ``n`` (a dead
    rank it drops is only dropped).
    """
    dead = {r: how for r, how in cluster.dead_ranks().items() if r < min(n, old)}
    if not dead:
        return
    what = "; ".join(cluster.death_message(r, how) for r, how in sorted(dead.items()))
    grow = "grow" if n > old else f"go on at {count(n, 'rank')}" if n == old else f"shrink to {count(n, 'rank')}"
    raise ClusterError(f"%dist scale {n}: {what}, so the world cannot {grow}; nothing changed (no engine "
                       f"was started). {dead_rank_fix(dead, old, n)}")


# the global batch ---------------------------------------------------------------------------
def _fit(total: int, dp: int, batch: int, accumulate: int):
    """(batch, accumulate) with ``dp * batch * accumulate == total``: the batch scaled first, else the accumulation."""
    if total % (dp * accumulate) == 0:
        return total // (dp * accumulate), accumulate
    if total % (dp * batch) == 0:
        return batch, total // (dp * batch)
    return None


def _dp(plan, world: int) -> int:
    from distnb.engine import strategies  # loads numpy, torch: at first use, not when this module is imported

    return strategies.data_parallel_size(plan, world)


def _dp_at(layout: dict, world: int, at: int) -> int:
    """Data-parallel ranks of ``layout`` (``strategy``, ``mesh`` as given for ``world`` ranks) on ``at`` ranks."""

    strategy = layout.get("strategy") or "ddp"
    probe = dataclasses.replace(TrainPlan(model="_", data="_"), strategy=strategy)
    if strategy == meshes.STRATEGY:
        probe = dataclasses.replace(probe, mesh=meshes.refit(layout.get("mesh"), world, at, "--keep-global-batch"))
    return _dp(probe, at)


def _global_batches(session, old: int, n: int, keep: bool):
    """(global batch before, after, per-rank batch after, accumulate after) of the last cell's model, or None.

    Raises PlanError when ``keep`` cannot split the global batch evenly over the new world.
    """
    result = session.last_result
    if result is None:
        return None
    plan = result.plan
    try:  # fsdp+tensor: the --mesh refitted to each world (it may be of a world before an earlier scale)
        total = _dp(meshes.plan_at(plan, old, old), old) * plan.batch_size * plan.accumulate
        dp = _dp(meshes.plan_at(plan, old, n), n)
    except PlanError:  # a mesh that cannot follow: refused below if its model is live, else no global batch to say
        return None
    if not keep:
        return total, dp * plan.batch_size * plan.accumulate, plan.batch_size, plan.accumulate
    fitted = _fit(total, dp, plan.batch_size, plan.accumulate)
    if fitted is None:
        raise PlanError(f"--keep-global-batch: the global batch {total} ({_product(_dp(plan, old), plan)}) cannot "
                        f"be split evenly over {count(dp, 'data-parallel rank')} (as --batch-size or --accumulate); "
                        f"scale to a world size that divides {total}, or leave --keep-global-batch out (the global "
                        f"batch becomes {dp * plan.batch_size * plan.accumulate}); nothing changed")
    return (total, total) + fitted


def _product(dp: int, plan, batch=None, accumulate=None) -> str:
    batch = plan.batch_size if batch is None else batch
    accumulate = plan.accumulate if accumulate is None else accumulate
    return f"{dp} x {batch} per rank" + (f" x {accumulate} micro-steps" if accumulate > 1 else "")


def batch_for_world(session, given: dict, model: str | None = None) -> dict:
    """A cell's options with ``--batch-size``/``--accumulate`` scaled after ``%dist scale --keep-global-batch``.

    Only for a model live when the world was scaled (the same notebook object, :mod:`distnb.elastic.keepbatch`):
    its cell's values are read as written for the world it had then; the returned ones give the
    same global batch on the running world, and the cell says so (a brand-new model's are as
    written). ``model``: the cell's ``--model`` name, whose carried ``--strategy``/``--mesh`` count
    when the cell does not give them (an fsdp+tensor mesh keeps its tensor-parallel size: DP = ranks / TP).
    A rewrite is also left under ``holdings.batch_world[None]`` for ``%dist export`` to say.

    Raises PlanError when that global batch cannot be split evenly over this world.
    """
    held = session.holdings
    held.batch_world.pop(None, None)
    if model not in keepbatch.kept_models(session):
        return given
    ref = held.batch_world[model][0]
    world = session.world_size
    if ref == world:
        return given

    fields = {f.name: f.default for f in dataclasses.fields(TrainPlan)}
    batch = given.get("batch_size") or fields["batch_size"]
    accumulate = given.get("accumulate") or fields["accumulate"]
    layout = dict(session.holdings.carried.get(model) or {}) if isinstance(model, str) else {}
    layout.update({k: given[k] for k in ("strategy", "mesh") if given.get(k) is not None})
    total, dp = _dp_at(layout, world, ref) * batch * accumulate, _dp_at(layout, world, world)
    fitted = _fit(total, dp, batch, accumulate)
    if fitted is None:
        raise PlanError(f"--keep-global-batch (from %dist scale): the global batch {total} (--batch-size {batch} "
                        f"x --accumulate {accumulate} on {count(ref, 'rank')}) cannot be split evenly over "
                        f"{count(world, 'rank')}; pick a --batch-size that can, or %dist scale {world} again "
                        "without --keep-global-batch")
    if fitted != (batch, accumulate):
        said = (f"--keep-global-batch (from %dist scale): global batch {total} kept on {count(world, 'rank')} "
                f"as --batch-size {fitted[0]}" + (f" --accumulate {fitted[1]}" if fitted[1] > 1 else "")
                + f" (this cell's --batch-size {batch}" + (f" --accumulate {accumulate}" if accumulate > 1 else "")
                + f" is for {count(ref, 'rank')})")
        print(f"distnb: {said}")
        held.batch_world[None] = dict(model=model, written=[batch, accumulate], trained=list(fitted), world=world,
                                      written_for=ref, global_batch=total, note=said)
    return dict(given, batch_size=fitted[0], accumulate=fitted[1])


# growing and shrinking ----------------------------------------------------------------------
def _grow(session, n: int) -> dict:
    """Start ``n - W`` engines, form the group of ``n`` and share the state; on failure the old world is back."""
    cluster = session.cluster
    old, before = cluster.world_size, cluster.snapshot()
    new_ids = []
    try:
        new_ids = cluster.add_engines(n - old)
        for hook in ON_ENGINES_STARTED:
            hook([cluster.where[e]["pid"] for e in new_ids])
        cluster.add_ranks(new_ids)
        cluster.form_group(n, old)
        infos = cluster.wait_all(cluster.apply_all(calls.share, sorted(session.holdings.names), old),
                                 timeout=cluster.spec.timeout + 60, what="sharing the state with the added ranks")
    except BaseException as exc:
        raise _grow_failed(cluster, n, before, new_ids, exc) from None
    cluster.rewatch()
    return infos[0]


def _grow_failed(cluster, n: int, before: tuple, new_ids: list, exc: BaseException) -> BaseException:
    """The old world formed again after a failed or interrupted grow; the error that says so (to raise).

    An interrupt (Ctrl-C, the interrupt button) is an :class:`~distnb.core.errors.Interrupted` of one
    line, as an interrupted ``%dist start`` is; pressed again during the rollback, it says to restart.
    """
    old = len(before[0])
    try:
        why = _rollback(cluster, before, new_ids) if new_ids else \
            f"the world of {count(old, 'rank')} is as it was (its state intact)"
    except BaseException as again:
        if not _is_interrupt(again):
            raise
        cluster.restore(before)
        why = (f"interrupted again while the old world of {count(old, 'rank')} was formed again: run %dist restart "
               f"-n {old} (session.restart(n={old})) for a fresh world")
        exc = exc if _is_interrupt(exc) else again
    if _is_interrupt(exc):
        stopped = ("the added engine was stopped" if len(new_ids) == 1 else f"the {len(new_ids)} added engines were "
                   "stopped") if new_ids else "the engines being started were stopped"
        return Interrupted(f"%dist scale {n} interrupted: {stopped}; {why}")
    cause = str(exc).split("\n")[0] if not isinstance(exc, RankError) else _rank_cause(exc)
    return ClusterError(f"%dist scale {n}: the added engines did not join ({cause}); "
                        + (f"they were stopped and {why}" if new_ids else why))


def _is_interrupt(exc: BaseException) -> bool:
    from distnb.execute.execute import (  # loads psutil: at first use, not when this module is imported
        _is_interrupt as interrupt,  # the RuntimeError a Ctrl-C in a Condition's `with` becomes
    )

    return interrupt(exc)


def _rank_cause(exc: RankError) -> str:
    first = exc.failures[0]
    return f"rank {first['rank']}: {first['ename']}: {str(first['evalue']).splitlines()[0] if first['evalue'] else ''}"


def _rollback(cluster, before: tuple, new_ids: list) -> str:
    """After a failed grow: the added engines stopped, the old world formed again. Returns how the old world is.

    ``before``: the cluster's :meth:`~distnb.cluster.engines.Engines.snapshot` before the grow.
    """
    cluster.stop_engines(new_ids)
    cluster.restore(before)
    old = cluster.world_size
    try:
        cluster.check_alive()
        cluster.form_group(old, old)
    except Exception as exc:
        return (f"the old world of {count(old, 'rank')} could not be formed again ({str(exc).splitlines()[0]}): "
                "run %dist restart")
    return f"the world of {count(old, 'rank')} is as it was (its state intact)"


def _shrink(session, n: int) -> dict:
    """Stop ranks ``n`` and above (each leaves the group and exits, on its host), then form the group of the first ``n``."""
    cluster = session.cluster
    old = cluster.world_size
    gone = f"rank {n}" if old - n == 1 else f"ranks {n}-{old - 1}"
    try:
        left = cluster.remove_ranks(range(n, old))
    except BaseException as exc:
        if not _is_interrupt(exc):
            raise
        raise Interrupted(f"%dist scale {n} interrupted while stopping {gone} (some may be gone): run %dist "
                          f"restart -n {n} (session.restart(n={n})) for a fresh world") from None
    try:
        cluster.form_group(n, old)
    except BaseException as exc:
        if _is_interrupt(exc):
            raise Interrupted(f"%dist scale {n} interrupted: {gone} stopped, but the group of {count(n, 'rank')} was "
                              f"not formed; run %dist restart -n {n} (session.restart(n={n}))") from None
        if not isinstance(exc, Exception):
            raise
        raise ClusterError(f"%dist scale {n}: {gone} stopped, but the group of {count(n, 'rank')} did "
                           f"not form ({str(exc).splitlines()[0]}); run %dist restart -n {n}") from None
    cluster.rewatch()
    if left:  # said even when quiet: something may still run there
        print(f"distnb: warning: could not confirm that {', '.join(left)} exited (its host did not answer over "
              "ssh); it left the process group, but check that host")
    return {"unconfirmed": left}


# sharded models: a DCP reshard -------------------------------------------------------------
#: Strategies whose live state reaches the new world through a DCP checkpoint (DTensor layouts DCP reshards).
RESHARDED = ("fsdp", "tensor", "fsdp+tensor")


def _meshes(held) -> dict:
    """fsdp+tensor model -> the ``--mesh`` its next cell carries."""
    return {m: v.get("mesh") for m, v in held.carried.items() if v.get("strategy") == meshes.STRATEGY}


def _refused(exc: PlanError, name: str) -> str:
    return (f"{exc}; nothing changed (to scale anyway, delete {name} from the notebook or train it with another "
            "--strategy first)")


def _save_sharded(session, n: int) -> dict:
    """Checkpoint each live sharded model (:data:`RESHARDED`) on the old world (DCP, a temporary folder).

    Returns {name: (model, meta)} and ``"_folder"``.

    Raises PlanError (nothing changed) for a model that its strategy cannot lay out on ``n`` ranks
    (fsdp+tensor: on the mesh of the same tensor-parallel size, :func:`distnb.train.meshes.refit`).
    """

    from distnb.engine import strategies  # loads numpy, torch: at first use, not when this module is imported
    from distnb.train import checkpoints  # loads psutil: at first use, not when this module is imported

    held = session.holdings
    todo = {}
    for name, (key, generation) in held.distributed.items():
        obj = session.ns.get(name)
        if key[0] in RESHARDED and generation == held.generation and obj is not None and \
                held.models.get(name) == fingerprint(obj):
            todo[name] = obj
    if not todo:
        return {}
    folder = tempfile.mkdtemp(prefix="distnb-scale-")
    saved = {}
    try:
        for name, obj in todo.items():
            meta = checkpoints.save(session, name, obj, os.path.join(folder, name), quiet=True)
            plan = TrainPlan.from_dict(dict(meta["plan"], model=name))
            try:
                plan = meshes.plan_at(plan, session.world_size, n)
            except PlanError as exc:
                raise PlanError(_refused(exc, name)) from None
            try:
                strategies.check(plan, obj, n, ns=session.ns)
            except strategies.StrategyError as exc:
                raise PlanError(f"%dist scale {n}: {name} (--strategy {plan.strategy}) cannot be laid out on "
                                f"{count(n, 'rank')}: {exc}; nothing changed (to scale anyway, delete {name} from "
                                "the notebook or train it with another --strategy first)") from None
            saved[name] = (obj, meta)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    saved["_folder"] = folder
    return saved


def _load_sharded(session, saved: dict) -> list:
    """Load each checkpoint of :func:`_save_sharded` on the world there is now (resharded by DCP); the names loaded.

    The notebook's model gives the structure (its weights are the same, the last trained ones); the
    checkpoint gives the sharded weights, the optimizer, the schedule and the position (converted
    to the new world's shards). A model that cannot be loaded is sent again by its next cell.
    """

    from distnb.train import checkpoints  # loads psutil: at first use, not when this module is imported

    folder = saved.pop("_folder", None)
    loaded = []
    try:
        if not saved or not session.running:  # (saved: its own DCP checkpoints, or a lost rank's newest ones)
            return loaded
        n = session.world_size
        for name, (obj, meta) in saved.items():
            try:  # the sampler position is converted to this world by the load (engine/checkpoint.py)
                changes = meshes.plan_changes(meta["plan"], meta["world_size"], n, name)  # fsdp+tensor: --mesh
                checkpoints.load(session, name, obj, meta["path"], quiet=True, changes=changes)
            except Exception as exc:
                print(f"distnb: {name} could not be resharded onto {count(n, 'rank')} ({str(exc).splitlines()[0]}); "
                      "its next cell sends it again from the notebook's weights (a fresh optimizer)")
                continue
            loaded.append(name)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return loaded


# data and what the cell says --------------------------------------------------------------
def _reassign_data(session, old: int, n: int) -> list:
    """Deal the kernel's scattered tensor sets again into the new world's shards; the others are dropped.

    A set cut into ``old`` shards (one per data-parallel rank) is cut into ``n``; one every rank
    holds whole stays whole. Data sets loaded on the ranks (or changed in the notebook) are
    forgotten, so the next training cell sends or loads them on every rank. Returns the names
    dealt again.
    """

    held = session.holdings
    dealt = []
    for name, info in list(held.data.items()):
        obj = session.ns.get(name)
        if "structure" not in info or obj is None or data.held_fingerprint(obj) != info["fingerprint"]:
            held.data.pop(name)
            continue
        num_shards = n if info["num_shards"] == old else info["num_shards"]
        layout = info.get("layout")
        data.scatter(session, name, obj, info["seed"], num_shards)
        if layout is not None:
            held.data[name]["layout"] = layout
        dealt.append(name)
    midepoch.send(session, dealt)  # an epoch left in the middle: each rank the rows of its part of the rest
    return dealt


def _listed(names: list, most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _say(session, out: dict, dealt: list, batches, keep: bool, points: dict, ended: list) -> None:
    """What the scale did; ``points``: the lost shards' checkpoints (lostshards.py), ``ended``: a keeping ended."""
    _say_scaled(session, out, dealt, batches, keep)
    lostshards.say(session, out, points)
    if ended:
        print(f"distnb: {keepbatch.ended_note(ended).strip('; ')}")


def _say_scaled(session, out: dict, dealt: list, batches, keep: bool) -> None:
    old, n = out["world_size"]
    grew = n > old
    gone = f"rank {n}" if n == old - 1 else f"ranks {n}-{old - 1}"
    how = f"{count(n - old, 'engine')} started" if grew else f"{gone} stopped"
    print(f"distnb: scaled the world from {count(old, 'rank')} to {n} in {out['seconds']:.1f} s ({how}; the "
          "process group re-formed)")
    if grew and (out["models"] or out["names"] or out["defined"]):
        models = out["models"]
        what = [f"{', '.join(models)} ({'each its ' if len(models) > 1 else ''}model, optimizer, lr schedule, epoch "
                "and sampler position)"] if models else []
        if out["names"]:
            what.append(f"{count(len(out['names']), 'pushed name')}")
        if out["defined"]:
            what.append(f"{count(len(out['defined']), 'name')} defined on the ranks ({_listed(out['defined'])})")
        print(f"distnb: rank 0 broadcast {', '.join(what)} to the added ranks over torch.distributed "
              f"({out['bytes'] / 2**20:.1f} MiB of tensors)")
    if out["unpicklable"]:
        why = "; ".join(f"{k} ({v})" for k, v in sorted(out["unpicklable"].items()))
        print(f"distnb: not on the added ranks, as they cannot be pickled: {why}; define them there with a %%dist "
              "cell")
    if dealt:
        print(f"distnb: {', '.join(dealt)} dealt again into the new world's shards")
    if out["binding"]:
        print(f"distnb: {out['binding']}")

    resharded = [m for m in out["resharded"] if m not in out["resumed"]]  # (resumed: said by lostshards.say)
    if resharded:
        print(f"distnb: {', '.join(resharded)} resharded onto {count(n, 'rank')} through a "
              "torch.distributed.checkpoint (DCP) written by the old world (model, optimizer, lr schedule, epoch "
              "and sampler position)")
    for model, mesh in out["meshes"].items():
        print(f"distnb: {model}: --mesh {mesh} from its next cell on (the tensor-parallel size kept, the "
              "data-parallel size set to N / TP)")
    sharded = [f"{m} ({key[0]})" for m, (key, _) in session.holdings.distributed.items()
               if STRATEGIES[key[0]][1] and m not in out["resharded"]]
    if sharded:
        print(f"distnb: {', '.join(sharded)}: sharded in place, so its next cell sends it again from the notebook's "
              "weights (its optimizer state restarts)")
    if batches is not None:
        total, after, batch, accumulate = batches
        plan = meshes.plan_at(session.last_result.plan, old, n)
        if keep:
            kept = _product(_dp(plan, n), plan, batch, accumulate)
            models = keepbatch.kept_models(session)
            print(f"distnb: --keep-global-batch: the global batch stays {total} ({kept}): the next cells of "
                  f"{', '.join(models) or 'the live models'} have their --batch-size and --accumulate scaled to keep "
                  "it (a new model's are as written; %dist scale without the flag ends it)")
        elif after == total:  # the data-parallel size did not change (pipeline, tensor): nothing to keep
            print(f"distnb: the global batch stays {total} ({_product(_dp(plan, n), plan)}): under --strategy "
                  f"{plan.strategy} the data-parallel size does not change with the world")
        else:
            keeps = (f"%dist scale {n} --keep-global-batch would have kept {total}"
                     if _fit(total, _dp(plan, n), batch, accumulate) is not None else
                     f"--keep-global-batch cannot keep {total}: it does not split evenly over {_dp(plan, n)} "
                     "data-parallel ranks")
            print(f"distnb: the global batch changes from {total} to {after} ({_product(_dp(plan, n), plan)}); {keeps}")
