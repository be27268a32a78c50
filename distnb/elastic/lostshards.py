"""``%dist scale`` after a rank was lost: what of the live models the survivors can go on with, and saying so.

A model sharded in place (``fsdp``, ``tensor``, ``fsdp+tensor``, ``pipeline``, ``ps``) held part of its
weights and optimizer state on the lost rank only: the survivors cannot save it (a DCP save needs every
rank) nor rebuild it. So a scale that drops a dead rank resumes each such model from the newest
checkpoint of its last cell's ``--checkpoint-dir`` (resharded onto the new world by DCP, with its
optimizer, lr schedule and position), saying that the lost shards exist only there and which steps are
trained again; a model with no checkpoint is refused before anything changes, with that reason and
the ways on. A replicated (``ddp``) model is kept whole by every survivor, and the scale says what it
kept (model, optimizer, lr schedule, epoch and position), as a grow says what it broadcast.

Idea: torchelastic restarts every worker from the last checkpoint after a membership change; here only
the sharded models need one, the replicated ones go on from the survivors' memory.
"""

from __future__ import annotations

from distnb.core.errors import ClusterError, ranks_named
from distnb.core.plan import STRATEGIES
from distnb.core.tables import count
from distnb.train.resuming import newest_meta


def _live(session) -> dict:
    """{name: (strategy, notebook object)} of the models distributed to the ranks (the notebook's name still bound)."""
    return {name: (key[0], session.ns[name]) for name, (key, _) in session.holdings.distributed.items()
            if session.ns.get(name) is not None}


def resume_points(session, n: int) -> dict:
    """{name: (model, checkpoint metadata)} of the sharded models a dead rank held shards of (a scale to ``n``).

    Each resumes from the newest checkpoint of its last cell's ``--checkpoint-dir`` when that is at least
    as far on as the notebook's weights. Without one, a model whose last cell ended well goes on from the
    notebook's weights (that cell brought them back) with a fresh optimizer, as the scale says.

    Raises
    ------
    ClusterError
        The last cell of a sharded model failed (its trained state was on the ranks only) and no checkpoint
        holds it: the lost shards exist nowhere (nothing changed).
    """
    dead = session.cluster.dead_ranks()
    if not dead:
        return {}
    held = session.holdings
    points, refused = {}, []
    for name, (strategy, obj) in _live(session).items():
        if not STRATEGIES[strategy][1]:
            continue  # replicated: every survivor holds it whole
        if held.distributed[name][1] != held.generation:
            continue  # sharded over an earlier world (re-formed since): the ranks hold none of it, its next cell resends it
        plan, failed = held.last_plans.get(name, (None, False))
        directory = getattr(plan, "checkpoint_dir", None)
        meta = newest_meta(directory)
        if meta is not None and meta["steps"] >= held.trained_steps.get(name, 0):
            points[name] = (obj, meta)
        elif failed:
            refused.append(f"{name} (--strategy {strategy}; " + (f"{directory} holds no checkpoint of it)"
                                                                  if directory else "its last cell had no "
                                                                  "--checkpoint-dir)"))
    if refused:
        lost = ranks_named(sorted(dead))
        one = len(refused) == 1
        raise ClusterError(
            f"%dist scale {n}: {lost} died, and {'; '.join(refused)} {'was' if one else 'were'} sharded over the "
            f"ranks when its last cell failed: {lost}'s shards (weights and optimizer state) were lost with its "
            f"engine and exist in no checkpoint, so the survivors cannot go on with {'it' if one else 'them'}; "
            f"nothing changed. Run %dist restart -n {n} (session.restart(n={n})) for a fresh world: the next cell "
            "sends the model again from the notebook's weights (those its last cell that ended well brought back) "
            "with a fresh optimizer (or delete it from the notebook to scale anyway). Train sharded models with "
            "--checkpoint-dir to resume them after a lost rank")
    return points


def say(session, out: dict, points: dict) -> None:
    """What a scale that dropped ranks kept of each live model, and what a resume from a checkpoint cost."""
    old, n = out["world_size"]
    if n >= old:
        return
    kept = [name for name, (strategy, _) in _live(session).items() if not STRATEGIES[strategy][1]]
    if kept:
        print(f"distnb: {ranks_named(range(n))} kept {', '.join(sorted(kept))} ({'each its ' if len(kept) > 1 else ''}"
              "model, optimizer, lr schedule, epoch and sampler position: every ddp replica held it whole)")
    for name, (_, meta) in sorted(points.items()):
        if name not in out["resharded"]:
            continue
        print(f"distnb: {name} ({meta['plan'].get('strategy')}): the lost rank's shards existed only in the checkpoint "
              f"{meta['path']}, so {name} resumed from it onto {count(n, 'rank')} (model, optimizer, lr schedule, "
              f"epoch {meta['epoch']} and sampler position, step {meta['epoch_step']} of it); what was trained after "
              f"its global step {meta['steps']} is trained again")
