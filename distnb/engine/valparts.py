"""A validation set each rank builds itself: ``--val-data make`` with ``make(rank, world_size)``, as ``--data`` takes.

Each rank calls the notebook function with its data shard and the number of shards (the rank and
``world_size`` under ddp and fsdp; the ranks of one shard, a tensor-parallel group, build the same
part), reads the part it returns (tensors, a tuple or dict of them, a ``TensorDataset``, any map-style
``Dataset`` or ``IterableDataset``, whose samples are collated with ``default_collate``) into columns,
and holds it as its validation shard (:class:`distnb.engine.train.shards.Shard`). The parts may differ in
length, and may be empty: the ranks agree (one ``all_gather_object``) on the longest, so that every
rank runs the same number of forwards (:class:`distnb.engine.train.validation.Validator` pads a shorter
or empty part with a masked sample counted in no sum), and on each column's trailing shape and dtype,
so that an empty part's pad sample has the others' shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate

from distnb.engine.process import runtime
from distnb.engine.train.shards import SHARDS, Shard
from distnb.engine.transport import shard as sharding


def columns(part, name: str):
    """``(structure, columns)`` of a part as :class:`~distnb.engine.train.shards.Shard` holds it; ``(None, [])``
    if empty.

    Raises
    ------
    TypeError
        For a part that is not a data set, naming the rank and what ``make`` returned.
    """
    rank = runtime.STATE.rank
    if isinstance(part, TensorDataset):
        return ("tuple", len(part.tensors), "TensorDataset"), list(part.tensors)
    if isinstance(part, torch.Tensor):
        return ("tensor",), [part]
    if isinstance(part, dict) and part and all(isinstance(v, torch.Tensor) for v in part.values()):
        return ("dict", tuple(part)), list(part.values())
    if isinstance(part, (tuple, list)) and part and all(isinstance(v, torch.Tensor) for v in part) and \
            len({len(v) for v in part}) == 1:
        return ("tuple", len(part)), list(part)
    if isinstance(part, IterableDataset):
        samples = list(part)
    elif isinstance(part, (Dataset, list, tuple)) and hasattr(part, "__len__"):
        samples = [part[i] for i in range(len(part))]
    else:
        raise TypeError(f"rank {rank}: --val-data {name}(rank, world_size) returned a {type(part).__name__}, not a "
                        "data set (tensors, a tuple or dict of tensors, a TensorDataset, a Dataset or an "
                        "IterableDataset)")
    if not samples:
        return None, []
    batch = default_collate(samples)
    if isinstance(batch, torch.Tensor):
        return ("tensor",), [batch]
    if isinstance(batch, dict):
        return ("dict", tuple(batch)), list(batch.values())
    return ("tuple", len(batch), "TensorDataset"), list(batch)


def build_val_part(ns, name, num_shards, seed):
    """Call ``ns[name](shard, num_shards)`` on this rank and hold the part as ``name``'s validation shard.

    Every rank calls it (one ``all_gather_object`` of each part's length and column layout).

    Returns
    -------
    int
        The samples this rank's part holds.

    Raises
    ------
    RuntimeError
        When the ranks' parts differ in layout (names each rank's), or every part is empty.
    """
    st = runtime.STATE
    index = sharding.shard_index(st.rank, st.world_size, num_shards)
    fn = ns.get(name)
    if not callable(fn):
        raise NameError(f"rank {st.rank}: --val-data {name} is not a function here")
    structure, cols = columns(fn(index, num_shards), name)
    layout = None if structure is None else (structure, [(tuple(c.shape[1:]), str(c.dtype)) for c in cols])
    mine = (len(cols[0]) if cols else 0, layout)
    everyone = [None] * st.world_size
    dist.all_gather_object(everyone, mine)
    layouts = {repr(lay) for _, lay in everyone if lay is not None}
    if not layouts:
        raise RuntimeError(f"--val-data {name}: every rank's part is empty (make(rank, world_size) returned no sample)")
    if len(layouts) > 1:
        each = "; ".join(f"rank {r}: {lay}" for r, (_, lay) in enumerate(everyone) if lay is not None)
        raise RuntimeError(f"--val-data {name}: the parts differ in their columns' shapes or dtypes ({each}); every "
                           "part must hold samples of one layout")
    if structure is None:  # an empty part: columns of 0 rows with the others' shapes, for the masked pad sample
        structure, specs = next(lay for _, lay in everyone if lay is not None)
        cols = [torch.zeros((0, *shape), dtype=getattr(torch, dtype.replace("torch.", ""))) for shape, dtype in specs]
    firsts = [everyone[r][0] for r in range(0, st.world_size, st.world_size // num_shards)]  # one rank per shard
    held = Shard(sum(firsts), num_shards, seed, index, structure, cols)
    held.longest = max(firsts)
    SHARDS[name] = held
    return len(cols[0])
