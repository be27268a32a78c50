"""Sharding arithmetic: which samples each rank holds and in which order it visits them.

The scheme follows ``torch.utils.data.DistributedSampler`` (pad to equal length by
repeating samples, or drop the tail) with one difference: shards are assigned once
(a seeded permutation dealt round-robin, so each rank can hold only its own shard)
and each epoch reshuffles *within* the shard with a generator seeded by
``(seed, epoch, rank)``. Same seed, same order; a new epoch, a new order.
"""

from __future__ import annotations

import math

import torch


def mix(*keys: int) -> int:
    """One seed in [0, 2**63 - 1) from integer ``keys`` (seed, epoch, rank, ...): same keys, same seed."""
    value = 0
    for k in keys:
        value = (value * 1_000_003 + int(k)) % (2**63 - 1)
    return value


def _generator(*keys: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(mix(*keys))
    return g


def check_sizes(num_samples: int, world_size: int, batch_size: int, drop_last: bool) -> None:
    """Raise ValueError when the data cannot give every rank at least one step."""
    if num_samples <= 0:
        raise ValueError("the data set is empty (0 samples)")
    if num_samples < world_size:
        raise ValueError(
            f"the data set has {num_samples} samples, fewer than world_size={world_size}: "
            "every rank needs at least one sample"
        )
    if drop_last and num_samples // world_size < batch_size:
        raise ValueError(
            f"with drop_last each rank has {num_samples // world_size} samples, fewer than "
            f"batch_size={batch_size}: no full batch (lower --batch-size or drop --drop-last)"
        )


def assign(num_samples: int, world_size: int, seed: int) -> list[torch.Tensor]:
    """Split ``range(num_samples)`` into ``world_size`` disjoint, covering shards.

    Returns
    -------
    list of torch.Tensor
        ``world_size`` int64 index tensors; shard ``r`` has
        ``ceil((num_samples - r) / world_size)`` indices.
    """
    perm = torch.randperm(num_samples, generator=_generator(seed, 0x5EED))
    return [perm[r::world_size] for r in range(world_size)]


def shard_index(rank: int, world_size: int, num_shards: int) -> int:
    """The data shard that rank ``rank`` trains on, when ``num_shards`` shards serve ``world_size`` ranks.

    The ranks of one shard are consecutive: ``world_size // num_shards`` of them per shard, as
    a device mesh lays out its data-parallel dimension outermost (``--mesh DPxTP``: ranks
    ``d * TP .. d * TP + TP - 1`` form tensor-parallel group ``d`` and read shard ``d``, the
    layout of torchtitan's world mesh). With one shard per rank it is the rank; with one shard
    (model parallelism: every rank the same batches) it is 0.

    Raises
    ------
    ValueError
        If ``num_shards`` does not divide ``world_size``.
    """
    if num_shards < 1 or world_size % num_shards:
        raise ValueError(f"{num_shards} data shards do not divide world_size {world_size}")
    return rank // (world_size // num_shards)


def shard_ranks(index: int, world_size: int, num_shards: int) -> range:
    """The ranks that train on shard ``index`` (the inverse of :func:`shard_index`)."""
    per = world_size // num_shards
    return range(index * per, (index + 1) * per)


def shard_length(num_samples: int, world_size: int, rank: int) -> int:
    """Number of samples rank ``rank`` holds (as dealt by :func:`assign`)."""
    return max(0, math.ceil((num_samples - rank) / world_size))


def samples_per_epoch(num_samples: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank visits per epoch: ceil(n / W) padded, floor(n / W) dropped."""
    return num_samples // world_size if drop_last else math.ceil(num_samples / world_size)


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Steps per epoch, identical on every rank so DDP never waits on a missing batch."""
    per_rank = samples_per_epoch(num_samples, world_size, drop_last)
    return per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)


def epoch_order(num_samples: int, world_size: int, rank: int, seed: int, epoch: int,
                drop_last: bool) -> torch.Tensor:
    """Positions *within rank's shard* to visit in ``epoch``, padded or cut to equal length.

    Returns
    -------
    torch.Tensor
        int64 tensor of length :func:`samples_per_epoch`.
    """
    length = shard_length(num_samples, world_size, rank)
    order = torch.randperm(length, generator=_generator(seed, epoch, rank))
    want = samples_per_epoch(num_samples, world_size, drop_last)
    if want <= length:
        return order[:want]
    reps = math.ceil(want / length)
    return order.repeat(reps)[:want]


def batches(order: torch.Tensor, batch_size: int, drop_last: bool):
    """Yield consecutive index slices of ``order``, the last one partial unless drop_last."""
    n = len(order)
    stop = (n // batch_size) * batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield order[start:start + batch_size]


def global_batches(num_samples: int, world_size: int, seed: int, epoch: int, batch_size: int, drop_last: bool):
    """Yield, per step of ``epoch``, the data-set indices all ranks together train on.

    The union of the ranks' batches, rank 0's first: what a single process must train on to
    match ``world_size`` DDP ranks with per-rank ``batch_size`` (the reference for parity).
    """
    parts = assign(num_samples, world_size, seed)
    per_rank = [list(batches(epoch_order(num_samples, world_size, r, seed, epoch, drop_last), batch_size, drop_last))
                for r in range(world_size)]
    for step in range(len(per_rank[0])):
        yield torch.cat([parts[r][per_rank[r][step]] for r in range(world_size)])
