"""Rank side of weights back: a model's state written into one outbox, one tensor at a time.

Before, a state travelled in three steps: every tensor copied to a CPU temporary (``.to("cpu")``,
on a GPU a synchronous copy each), those temporaries copied again into a shared-memory segment or
concatenated into one array, and, for a sharded model, the whole unsharded state assembled first
(``get_model_state_dict(full_state_dict=True)``) or, for a pipeline, pickled through
``gather_object`` (on a GPU: ``world_size`` times the largest stage on rank 0's device). Rank 0
held the model two or three times over.

Here the layout of the outbox is decided from the tensors' descriptions first, and each tensor is
then copied once, from wherever it is (CPU, GPU, a DTensor's shards sent to rank 0 by :mod:`.gather`,
another pipeline stage received by ``recv``), straight into its place in the outbox. Rank 0 holds the
outbox plus one message (a DTensor) or one tensor; a GPU's copies are queued and synchronised once at the end.

After a training cell the kernel asks for the state in parts (:mod:`distnb.engine.train.stateparts`, ``keys``
of at most 64 MiB): the outbox then holds one part, and every part reuses one segment (:data:`_FLOOR`).

The outbox is a segment of the rank's shared-memory pool when the kernel shares ``/dev/shm``
(:func:`distnb.engine.transport.wire.probe_shm`), which the kernel then reads tensor by tensor into its own
model (:mod:`distnb.transfer.weights_back`), else one uint8 array sent as a message frame.

Idea: torch.distributed.checkpoint's ``_gather_state_dict``/``get_model_state_dict`` gather per
tensor as well; this only adds the place each tensor goes to.
"""

from __future__ import annotations

import os

import torch

from distnb.engine.transport import gather, segments, wire


def _full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor's ``full_tensor()`` (a collective: every rank calls it in the same order)."""
    full = getattr(t, "full_tensor", None)
    return full().detach() if full is not None else t.detach()


#: The smallest outbox segment asked of the pool (bytes): the largest part of a state the kernel streams in
#: parts (:func:`distnb.engine.train.stateparts.pull_part`), so every part reuses one segment.
_FLOOR = [0]


def select(state: dict, keys) -> dict:
    """The entries of ``state`` named in ``keys`` (None: all), in ``state``'s order (every rank's the same).

    Raises
    ------
    KeyError
        A key of ``keys`` the state lacks, named with this rank.
    """
    if keys is None:
        return state
    wanted = set(keys)
    missing = sorted(wanted - set(state))
    if missing:
        raise KeyError(f"rank {os.environ.get('RANK', '?')}: the model's state has no {', '.join(missing[:5])}")
    return {k: v for k, v in state.items() if k in wanted}


def _outbox(total: int):
    """(uint8 base tensor, path or None, segment, pool): where a state of ``total`` bytes is written."""
    shm = wire._SHM
    if shm["ok"]:
        pool = shm.get("outbox")
        if pool is None:
            pool = shm["outbox"] = segments.Pool(shm["owner"], f"r{os.environ.get('RANK', 'x')}")
        try:
            seg = pool.acquire(max(total, _FLOOR[0]))
        except OSError:  # /dev/shm full or gone: the message carries the bytes
            pass
        else:
            return seg.base, seg.path, seg, pool
    return torch.empty(total, dtype=torch.uint8), None, None, None


def flatten_state(state: dict):
    """A state_dict for one message: ``(keys, descriptions, byte sizes, bytes)`` (:func:`write_state`)."""
    return write_state(list(state.items()))


def write_state(entries, writer: bool = True, device=None):
    """Write ``entries`` (``(key, tensor)`` pairs, or ``(key, description, fetch)`` triples) into an outbox.

    Parameters
    ----------
    entries : list
        ``(key, tensor)``: the tensor is copied as is (a DTensor is gathered whole first, so every
        rank must call this with the same keys in the same order). ``(key, desc, fetch)``: ``fetch(dst)``
        fills ``dst`` (a CPU tensor of ``desc``'s dtype and shape, in the outbox), e.g. by ``recv``.
    writer : bool
        False on the ranks that only take part in the collectives (they return None).
    device : torch.device or None
        The default group's device, where a DTensor's pieces travel to the writer (:func:`.gather.gather_into`).

    Returns
    -------
    tuple or None
        ``(keys, descs, sizes, bytes)`` as :func:`distnb.engine.transport.wire.unflatten_state` and
        :func:`distnb.transfer.weights_back.load_into` read it: ``bytes`` is a :class:`~distnb.engine.transport.wire.ShmRef`
        into this rank's outbox segment, or one flat uint8 numpy array (offsets: :func:`wire.layout`).
    """
    entries = [e if len(e) == 3 else (e[0], wire.describe(e[1]), e[1]) for e in entries]  # a DTensor: its full shape
    keys = [e[0] for e in entries]
    descs = [e[1] for e in entries]
    sizes = [int(torch.Size(d[1]).numel()) * torch.empty(0, dtype=getattr(torch, d[0])).element_size() for d in descs]
    offsets, total = wire.layout(sizes)
    base = path = seg = pool = None
    if writer:
        base, path, seg, pool = _outbox(total)
    synced = False
    try:
        for (key, desc, src), off, n in zip(entries, offsets, sizes):
            if callable(src):
                src(wire._view(base, off, n, desc) if writer else None)
                continue
            if gather.supported(src):  # every rank sends its shard to the writer, which places it: no full copies
                gather.gather_into(src, wire._view(base, off, n, desc) if writer and n else None, device=device)
                continue
            full = _full(src)  # every rank: a DTensor's all-gather (placements gather.py does not place)
            if writer and n:
                dst = wire._view(base, off, n, desc)
                dst.copy_(full, non_blocking=full.device.type == "cuda")  # one copy, straight from the device
                synced = synced or full.device.type == "cuda"
            del full
        if synced:
            torch.cuda.synchronize()
    finally:
        if pool is not None:
            pool.release(seg)
    if not writer:
        return None
    if path is not None:
        return keys, descs, sizes, wire.ShmRef(path, offsets, sizes)
    return keys, descs, sizes, base.numpy()
