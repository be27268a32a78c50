"""The tensor path's data on a rank: the shard of a data set the kernel shipped (:class:`Shard`).

:func:`install_shard` receives this rank's columns and binds them in the engine; :data:`SHARDS` keeps
each by name between cells for the training loop (:mod:`distnb.engine.train.loop`) and validation. Data
sets loaded on the ranks through a DataLoader are :mod:`distnb.engine.train.datasets`'s.
"""

from __future__ import annotations

import torch

from distnb.engine.train import datasets
from distnb.engine.transport import hostcopy, wire
from distnb.engine.transport import shard as sharding


class Shard:
    """This rank's part of a data set: columns of equal first dimension.

    ``structure`` is ``("tensor",)`` for one tensor, ``("tuple", k)`` for a k-tuple and
    ``("dict", keys)`` for a dict of tensors; a batch has the same structure. A Dataset of
    k-tuples (``("tuple", k, "TensorDataset")``) has k-tuple batches and is bound on the rank as
    a TensorDataset of the shard's columns.
    ``num_shards`` is the data-parallel size the set was cut for (world_size, or 1 when
    every rank trains on the same batches) and ``index`` the shard this rank holds.

    Before an epoch's first batch in a cell, :meth:`epoch` seeds this rank's ``torch``, ``random``
    and ``numpy`` from ``(--seed, epoch, index)`` exactly as a Dataset loaded with ``--workers 0``
    does (:func:`distnb.engine.train.datasets.seed_epoch`): the ranks of one shard (every rank of
    ``tensor`` or ``pipeline``, a tensor-parallel group) draw the same dropout masks, and tensors
    train to the weights of the same data as a Dataset.
    """

    def __init__(self, num_samples, num_shards, seed, index, structure, columns):
        self.num_samples, self.num_shards, self.seed, self.index = num_samples, num_shards, seed, index
        self.structure, self.columns = tuple(structure), columns
        self._seeded = None  # the epoch this cell last seeded for (a Dataset's loader: _Indexed.epoch)

    def __len__(self):
        return len(self.columns[0])

    def batch(self, idx, device):
        cols = [hostcopy.rows(c, idx, device) for c in self.columns]  # pinned, non-blocking on a GPU
        kind = self.structure[0]
        if kind == "tensor":
            return cols[0]
        if kind == "dict":
            return dict(zip(self.structure[1], cols))
        return tuple(cols)

    def as_value(self):
        """The shard as the user gave it: tensor, tuple of tensors or dict, or a TensorDataset of its columns
        for a Dataset (``("tuple", k, "TensorDataset")``)."""
        if self.structure[2:] == ("TensorDataset",):
            return torch.utils.data.TensorDataset(*self.columns)
        return self.batch(slice(None), torch.device("cpu"))

    def steps_per_epoch(self, plan) -> int:
        sharding.check_sizes(self.num_samples, self.num_shards, plan.batch_size, plan.drop_last)
        return sharding.steps_per_epoch(self.num_samples, self.num_shards, plan.batch_size, plan.drop_last)

    def epoch_length(self, plan) -> int:
        return sharding.samples_per_epoch(self.num_samples, self.num_shards, plan.drop_last)

    def epoch(self, plan, epoch, skip, device):
        """Yield ``(samples, batch)`` per step of ``epoch``, starting ``skip`` samples in."""
        order = sharding.epoch_order(self.num_samples, self.num_shards, self.index, plan.seed, epoch, plan.drop_last)
        for idx in sharding.batches(order[skip:], plan.batch_size, plan.drop_last):
            if epoch != self._seeded:  # the epoch's first batch in this cell (or its first after a resume)
                self._seeded = epoch
                datasets.seed_epoch(plan.seed, epoch, self.index)
            yield len(idx), self.batch(idx, device)

    def close(self):
        """The cell ended (the shard is plain tensors: nothing to end); the next cell seeds its first epoch."""
        self._seeded = None


#: This rank's data shards (the tensor path), by name.
SHARDS: dict[str, Shard] = {}


def install_shard(ns, name, num_samples, num_shards, seed, index, structure, descs, *buffers):
    """Receive shard ``index`` (of ``num_shards``) of a data set and bind it to ``name`` in the engine.

    From shared memory the shard is mapped copy-on-write, not copied (it is read, not written).
    """
    columns = wire.receive(descs, buffers, mapped=True)
    old = datasets.SOURCES.pop(name, None)  # a data set of that name loaded on the ranks before
    if old is not None:
        old.close()
    SHARDS[name] = Shard(num_samples, num_shards, seed, index, structure, columns)
    ns[name] = SHARDS[name].as_value()
    return len(SHARDS[name])
