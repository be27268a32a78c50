"""Data sets in the kernel: scattered to the ranks as shards, gathered back, and how batches are cut.

The kernel materialises a notebook data set once as columns of tensors
(:func:`distnb.transfer.columns_of`), deals them out with the seeded assignment of
:mod:`distnb.engine.shard` (disjoint, covering) and writes each shard once (shared memory
on one host). What the ranks hold is recorded in ``session.holdings.data`` so a training
cell scatters again only when the data, the seed or the number of shards changed.
"""

from __future__ import annotations

import contextlib

from . import calls
from .display.tables import count
from .errors import PlanError


def scatter(session, name: str, obj, seed: int, num_shards: int) -> list:
    """Send each rank its shard of ``obj`` under ``name`` (rank ``r`` gets shard ``r % num_shards``).

    Returns
    -------
    list of int
        Samples per rank.

    Raises
    ------
    PlanError
        If ``obj`` is not a data set, or has fewer samples than ``num_shards``.
    """
    from .engine import shard as sharding
    from .transfer import columns_of, fingerprint, outgoing_rows

    cluster = session.cluster
    structure, columns, n = columns_of(obj, name)
    if n < num_shards:
        raise PlanError(f"{name} has {n} samples, fewer than world_size={cluster.world_size}")
    shards = sharding.assign(n, num_shards, seed)
    ars = []
    with contextlib.ExitStack() as files:  # each shard written once (shared memory on one host)
        for index, idx in enumerate(shards):
            ranks = range(index, cluster.world_size, num_shards)
            descs, sent = files.enter_context(outgoing_rows(cluster, columns, idx, ranks))
            for rank in ranks:
                ars.append(cluster.apply(rank, calls.install_shard, name, n, num_shards, seed, index, structure,
                                         descs, *sent))
        sizes = cluster.wait_all(ars, timeout=cluster.spec.timeout, what=f"scatter {name}")
    session.holdings.data[name] = dict(fingerprint=fingerprint(obj), seed=seed, num_samples=n, shards=shards,
                                       structure=structure, num_shards=num_shards)
    return sizes


def reassemble(values: list, info: dict):
    """The shards pulled from the ranks (``values``, by rank) put back in the original sample order.

    Returns a tensor, tuple or dict like the scattered original, or ``values`` unchanged when
    the ranks no longer hold tensors of the shards' lengths.
    """
    import torch

    values = values[:info["num_shards"]]  # ranks beyond hold copies of the same shards
    kind = info["structure"][0]
    cols_by_rank = [[v] if kind == "tensor" else list(v.values()) if kind == "dict" else list(v) for v in values]
    columns = []
    for j in range(len(cols_by_rank[0])):
        parts = [cols[j] for cols in cols_by_rank]
        if not all(isinstance(p, torch.Tensor) and len(p) == len(i) for p, i in zip(parts, info["shards"])):
            return values
        out = parts[0].new_empty((info["num_samples"],) + tuple(parts[0].shape[1:]))
        for p, idx in zip(parts, info["shards"]):
            out[idx] = p
        columns.append(out)
    if kind == "tensor":
        return columns[0]
    if kind == "dict":
        return dict(zip(info["structure"][1], columns))
    return tuple(columns)


def describe_cut(plan, info: dict, num_shards: int, world_size: int) -> str:
    """One sentence: how ``plan.data`` is cut into shards and batches (pad or drop, steps per epoch)."""
    from .engine import shard as sharding

    n, w = info["num_samples"], num_shards
    if num_shards == 1 and world_size > 1:
        steps = sharding.steps_per_epoch(n, 1, plan.batch_size, plan.drop_last)
        return (f"{plan.data}: {count(n, 'sample')}, the whole set on every rank (--strategy {plan.strategy} "
                f"trains all ranks on the same batches); {count(steps, 'step')}/epoch of {plan.batch_size}")
    per = sharding.samples_per_epoch(n, w, plan.drop_last)
    steps = sharding.steps_per_epoch(n, w, plan.batch_size, plan.drop_last)
    lens = [sharding.shard_length(n, w, r) for r in range(w)]
    if plan.drop_last:
        how = f"drop: each rank uses {per} of its {min(lens)}-{max(lens)} samples, full batches only"
    elif min(lens) < per:
        how = f"pad: ranks with {min(lens)} samples repeat {per - min(lens)} so all visit {per}"
    else:
        how = f"every rank visits {per} samples"
    return (f"{plan.data}: {count(n, 'sample')} in {count(w, 'shard')}; {how}; {count(steps, 'step')}/epoch of "
            f"{plan.batch_size} per rank")


def describe_validation(name: str, info: dict, num_shards: int, batch_size: int) -> str:
    """One sentence: how the validation set ``name`` is cut (every sample counted once, masked padding)."""
    from .engine import shard as sharding

    n = info["num_samples"]
    lens = [sharding.shard_length(n, num_shards, r) for r in range(num_shards)]
    forwards = -(-max(lens) // batch_size)
    pad = ("; shorter shards end with a masked pad sample (counted in no sum)" if min(lens) < max(lens)
           and -(-min(lens) // batch_size) < forwards else "")
    where = f"in {count(num_shards, 'shard')}" if num_shards > 1 else "on every rank (the same batches)"
    return (f"validation set {name}: {count(n, 'sample')} {where}, each counted once; "
            f"{count(forwards, 'forward')} of up to {batch_size} per rank{pad}")
