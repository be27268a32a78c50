"""The rest of an epoch that a resize left in the middle: exactly the samples not trained yet.

A mid-epoch position is a count (``Run.epoch_samples``): the positions of each data shard's epoch
order that were trained. Once the shards are cut again for another number of data-parallel ranks
(``%dist scale``, a rank lost, a checkpoint resumed on another world), the same count means other
samples: some would be trained twice and as many never. So when the data-parallel size changes in
the middle of an epoch, the position becomes a *trail* (``Run.epoch_trail``): the epoch, its data,
the seed and ``--drop-last`` it was cut with, and its segments so far, each ``[num_shards, taken]``:
the segment was laid out over ``num_shards`` data shards and each shard trained the first ``taken``
positions of its part. The first segment's layout is the epoch's usual one
(:func:`distnb.engine.transport.shard.assign`, then :func:`~distnb.engine.transport.shard.epoch_order`); the samples no
segment took are the *rest*, shuffled with the seed and dealt round-robin over the data shards of
the next segment. Every shard then trains its part of the rest in the same number of steps: full
``--batch-size`` batches but the last, which holds the remainder (at most one sample more than a
full batch, where the rest does not split evenly; ``--drop-last`` drops what does not fill the
shortest part's batches; a rest with fewer samples than shards repeats some, to give each shard one).
The interrupted epoch and its rest thus train every sample once (the epoch's own padding aside);
the next epoch is laid out for the new world as usual.

Tensor data the kernel scattered hold only their own shard's rows, so the kernel sends each rank
the rows of its part of the rest (:func:`install_rest`, :mod:`distnb.elastic.midepoch`); a map-style
Dataset indexes them itself. What cannot be laid out by sample index (a set made by
``make(rank, world_size)``, tensor rows the ranks lack) keeps the count, converted by samples
trained (``s`` positions on each of ``W`` shards: ``floor(s * W / N)`` on each of ``N``), and the
cell says so. A stream has no index either: an epoch interrupted in it counts as done (as without
a resize; ``loop._settle_position``), and the next cell starts a new pass.

Idea: the sampler state of a resumable loader carries what each rank consumed, not a count
(torchdata's ``StatefulDataLoader``; MosaicML Streaming resumes an epoch on another number of
ranks from the sample partition and what the old ranks took).
"""

from __future__ import annotations

import copy
import math

import torch

from distnb.engine.train.datasets import seed_epoch
from distnb.engine.transport import shard as sharding

#: A key of the rest's shuffle (beside the seed, the epoch and the number of segments before it).
_REST_KEY = 0x2E57
#: Tensor rows of a rest the kernel sent, by (data name, :func:`rows_key`): columns (restrows.install_rest).
ROWS: dict = {}


def new_trail(data: tuple, epoch: int, seed: int, drop_last: bool) -> dict:
    """An empty trail for ``epoch`` of ``data`` (``(name, num_samples)``), cut with ``seed`` and ``drop_last``."""
    return dict(data=list(data), epoch=int(epoch), seed=int(seed), drop_last=bool(drop_last), segments=[])


def layout(num_samples: int, trail: dict, num_shards: int) -> list:
    """Each data shard's part (data-set indices, int64, in visit order) of the segment after ``trail``'s."""
    segments = trail["segments"]
    if not segments:
        parts = sharding.assign(num_samples, num_shards, trail["seed"])
        return [parts[i][sharding.epoch_order(num_samples, num_shards, i, trail["seed"], trail["epoch"],
                                              trail["drop_last"])] for i in range(num_shards)]
    rest = rest_of(num_samples, trail)
    if 0 < len(rest) < num_shards:  # one sample each at least: some are repeated
        rest = rest.repeat(math.ceil(num_shards / len(rest)))[:num_shards]
    return [rest[i::num_shards] for i in range(num_shards)]


def rest_of(num_samples: int, trail: dict) -> torch.Tensor:
    """The data-set indices no segment of ``trail`` trained (int64), shuffled with its seed and epoch."""
    taken = torch.zeros(num_samples, dtype=torch.bool)
    segments = trail["segments"]
    for k, (num_shards, count) in enumerate(segments):
        for part in layout(num_samples, dict(trail, segments=segments[:k]), num_shards):
            taken[part[:count]] = True
    left = (~taken).nonzero().flatten()
    g = torch.Generator()
    g.manual_seed(sharding.mix(trail["seed"], trail["epoch"], _REST_KEY, len(segments)))
    return left[torch.randperm(len(left), generator=g)]


def cut(lengths: list, index: int, skip: int, batch_size: int, drop_last: bool) -> list:
    """Positions (int64 slices of ``arange``) of shard ``index``'s batches, ``skip`` positions in.

    Every shard runs as many steps as the shortest part allows: full batches but the last, which
    takes the remainder (``drop_last``: full batches only).
    """
    left = [max(0, n - skip) for n in lengths]
    shortest = min(left)
    steps = shortest // batch_size if drop_last else -(-shortest // batch_size)
    positions = torch.arange(skip, lengths[index])
    out = [positions[j * batch_size:(j + 1) * batch_size] for j in range(max(0, steps - 1))]
    if steps:
        last = positions[(steps - 1) * batch_size:]
        out.append(last[:batch_size] if drop_last else last)
    return out


def active(run):
    """``run``'s trail when its position is in one (its epoch and data), else None."""
    trail = getattr(run, "epoch_trail", None)
    if trail and trail["epoch"] == run.epoch and tuple(trail["data"]) == tuple(run.epoch_data or ()):
        return trail
    return None


def exact_for(data) -> bool:
    """Whether ``data`` (a ``shards.Shard`` or ``datasets.Source``) visits samples by data-set index (a map-style
    set)."""
    return getattr(data, "kind", "dataset") == "dataset" and getattr(data, "num_samples", None) is not None


def carry(run, before: int, after: int, exact: bool = True, plan: dict | None = None) -> None:
    """``run``'s mid-epoch position from ``before`` data-parallel shards to ``after`` (a resize).

    ``exact``: the data is laid out by sample index (see the module's docstring); else the count is
    converted by samples trained. ``plan``: the plan (a dict) the position was trained with (default
    ``run.plan_dict``): its seed and ``--drop-last`` laid the epoch out. A resize undone before any step
    (a failed grow) gives the position back.
    """
    if before == after:
        return
    trail = active(run)
    if not exact or not run.epoch_data or run.epoch_data[1] is None:
        if run.epoch_samples:
            run.epoch_samples = run.epoch_samples * before // after
            run.epoch_step = math.ceil(run.epoch_samples / ((plan or run.plan_dict or {}).get("batch_size") or 1))
        return
    if run.epoch_samples:
        if trail is None:
            plan = plan or run.plan_dict or {}
            trail = new_trail(run.epoch_data, run.epoch, plan.get("seed", 0), plan.get("drop_last", False))
        trail["segments"].append([before, run.epoch_samples])
        run.epoch_samples = 0
    elif trail is not None and trail["segments"] and trail["segments"][-1][0] == after:
        run.epoch_samples = trail["segments"].pop()[1]  # nothing trained since: the position as it was
    run.epoch_trail = trail if trail is not None and trail["segments"] else None


def for_epoch(run, data, plan, skip: int):
    """This rank's batches of the rest of ``run``'s epoch: ``(skip, rest)``, ``rest`` None for the usual epoch.

    ``rest`` is ``(positions, part, rows)``: the positions of each batch in this rank's part
    (:func:`cut`), the part's data-set indices, and for tensor data the part's rows the kernel sent
    (None for a Dataset). When the part cannot be laid out by index here, the trail's count is
    converted and returned as ``skip``, with ``rest`` None.
    """
    trail = active(run)
    if trail is None:
        return skip, None
    num_shards, index = data.num_shards, data.index
    rows = _rows(plan.data, trail, num_shards) if hasattr(data, "columns") else None
    if not exact_for(data) or (hasattr(data, "columns") and rows is None):
        return sum(w * t for w, t in trail["segments"]) // num_shards + skip, None
    parts = layout(data.num_samples, trail, num_shards)
    positions = cut([len(p) for p in parts], index, skip, plan.batch_size, plan.drop_last)
    return skip, (positions, parts[index], rows)


def segment_length(run, data, plan):
    """Samples of this rank's epoch in the segment its position is in (None for a stream)."""
    skip, rest = for_epoch(run, data, plan, run.epoch_samples)
    length = data.epoch_length(plan)
    if rest is None:  # the usual epoch, or the rest by count (``skip`` positions in)
        return None if length is None else length - skip + run.epoch_samples
    return run.epoch_samples + sum(len(b) for b in rest[0])


def note(run, data, plan) -> str:
    """What the cell says of an epoch resumed from a trail ("" when there is none)."""
    trail = active(run)
    if trail is None:
        return ""
    worlds = " -> ".join(str(w) for w, _ in trail["segments"])
    if for_epoch(run, data, plan, run.epoch_samples)[1] is None:
        return (f"epoch {run.epoch} was left in the middle on {worlds} data-parallel ranks; {plan.data} cannot be "
                "laid out by sample index here (a make(rank, world_size) set, or tensor data sent again "
                "since), so its rest goes on by the count of samples trained (some may repeat or be missed)")
    left = sum(max(0, len(p) - run.epoch_samples) for p in layout(data.num_samples, trail, data.num_shards))
    return (f"epoch {run.epoch} was left in the middle on {worlds} data-parallel ranks: it goes on with exactly the "
            f"{left} samples it has not trained yet, dealt over {data.num_shards}")


def epoch_batches(run, data, plan, epoch: int, skip: int, device, steps_per_epoch: int):
    """(batches, samples, iterator) of this rank's ``epoch`` in a cell, ``skip`` positions in.

    ``batches``: how many (the same on every rank); ``samples``: what they hold (None for a stream,
    whose batches are at most ``steps_per_epoch``); ``iterator`` yields ``(samples, batch)``: the
    rest of an epoch a resize left (:func:`for_epoch`), else the data's usual epoch.
    """
    skip, rest = for_epoch(run, data, plan, skip)
    if rest is not None:
        return len(rest[0]), sum(len(b) for b in rest[0]), batches(data, plan, epoch, rest, device)
    length, size = data.epoch_length(plan), plan.batch_size
    if length is None:  # a stream: at most --steps-per-epoch, fewer if the streams end first
        count, samples = steps_per_epoch, None
    else:
        left = max(0, length - skip)
        count = left // size if plan.drop_last else -(-left // size)
        samples = min(left, count * size)
    return count, samples, data.epoch(plan, epoch, skip, device)


def batches(data, plan, epoch: int, rest, device):
    """Yield ``(samples, batch)`` for the ``rest`` of :func:`for_epoch` on ``data``."""
    positions, part, rows = rest
    if rows is not None:  # tensor rows: the rest's own, in the part's order
        view = _view(data, rows)
        for pos in positions:
            if epoch != data._seeded:  # as shards.Shard.epoch seeds the epoch's first batch in a cell
                data._seeded = epoch
                seed_epoch(plan.seed, epoch, data.index)
            yield len(pos), view.batch(pos, device)
        return
    yield from data.epoch(plan, epoch, 0, device, batches=[part[pos] for pos in positions])


def _view(shard, columns):
    view = copy.copy(shard)
    view.columns = columns
    return view


def rows_key(trail: dict, num_shards: int) -> tuple:
    """What a block of rest rows is for: the trail and the number of shards its part is laid out over."""
    return (tuple(trail["data"]), trail["epoch"], trail["seed"], trail["drop_last"],
            tuple(tuple(s) for s in trail["segments"]), num_shards)


def _rows(name: str, trail: dict, num_shards: int):
    return ROWS.get((name, rows_key(trail, num_shards)))


def keep_rows(name: str, key, columns) -> None:
    """Hold ``columns``: this rank's rows of the rest of an epoch of tensor data ``name`` (:func:`rows_key` ``key``).

    Rows held for ``name`` on another number of shards (an earlier world's) are dropped.
    """
    data, epoch, seed, drop_last, segments, num_shards = key
    key = (tuple(data), epoch, seed, drop_last, tuple(tuple(s) for s in segments), num_shards)
    for old in [k for k in ROWS if k[0] == name and k[1][-1] != num_shards]:
        del ROWS[old]
    ROWS[(name, key)] = columns
