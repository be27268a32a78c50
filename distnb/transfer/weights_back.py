"""Weights back into the kernel's own tensors, in place, one tensor at a time.

Rank 0 writes the trained state into its outbox (:mod:`distnb.engine.transport.stateout`): a segment of
its shared-memory pool when it shares ``/dev/shm`` with the kernel, else one array in the reply.
From a segment, each tensor's bytes are read with ``os.preadv`` straight into the memory of the
notebook model's tensor: no mapping of the rank's segment (whose pages would count in the
kernel's memory as they are read), no temporary. A tensor of another dtype or device, or not
contiguous, goes through a temporary of its own size, converted by ``copy_``. So the kernel
holds the model, plus at most its largest tensor, at every moment of weights back.

Before, the kernel offered rank 0 a second model-sized segment of its own pool, re-pointed the
model into it and kept the first for the next cell: twice the model after every cell (the 1 GiB
model of issue 34 left the kernel at 3.3 GiB).

The state comes in parts (:func:`stream_into`): the kernel asks the ranks for the keys of one part
(at most :data:`PART_BYTES`, or one larger tensor alone), reads it in, then asks for the next
(:func:`distnb.engine.train.stateparts.pull_part`). So rank 0's outbox holds one part, not the model.

Each tensor written is marked changed for autograd (``torch.autograd.graph.increment_version``,
as ``copy_`` would), so change detection (:func:`distnb.transfer.transfer.fingerprint`) and saved tensors
see the new weights.
"""

from __future__ import annotations

import ctypes
import os

from distnb.core import calls

#: Bytes of one part of a state streamed back (a tensor larger than this comes alone): the 64 MiB the
#: kernel's bound (model x 1.1 + 64 MiB, issue 34) allows beside the model, and what rank 0 holds of it.
PART_BYTES = 64 << 20


def _writable(t) -> memoryview:
    """A writable byte view of the contiguous CPU tensor ``t``'s memory (no ``.numpy()``: that would
    mark its storage shared with numpy and keep it from moving into a resident segment)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"the rank's state file ended {len(view) - done} bytes early")
        done += got


def _direct(t, desc: tuple) -> bool:
    """Whether the bytes of ``desc`` can be read straight into ``t``."""
    import torch  # the kernel imports torch only when it needs it
    return (t.device.type == "cpu" and str(t.dtype).removeprefix("torch.") == desc[0]
            and tuple(t.shape) == tuple(desc[1]) and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and type(t.untyped_storage()) is torch.UntypedStorage)


def parts(model, part_bytes: int):
    """``model``'s ``state_dict`` keys cut into parts in order: ``(list of key lists, largest part's bytes)``.

    Consecutive keys go together while their tensors add up to at most ``part_bytes``; a larger tensor is
    a part alone.
    """
    groups, current, size, largest = [], [], 0, 0
    for key, t in model.state_dict(keep_vars=True).items():
        n = t.numel() * t.element_size()
        if current and size + n > part_bytes:
            groups.append(current)
            largest = max(largest, size)
            current, size = [], 0
        current.append(key)
        size += n
    if current:
        groups.append(current)
        largest = max(largest, size)
    return groups, largest


def stream_into(cluster, name: str, model, ranks, part_bytes: int | None = None) -> None:
    """Bring the ranks' state of model ``name`` into the kernel's ``model`` in place, one part at a time.

    Parameters
    ----------
    cluster : distnb.cluster.cluster.Cluster
    name : str
        The model's name on the ranks.
    model : torch.nn.Module
        The notebook's model (not on meta): its tensors are written in place.
    ranks : sequence of int
        The ranks asked, rank 0 first: every rank (sharded strategies gather with collectives), or ``[0]``
        (a ddp replica whose peers died).
    part_bytes : int or None
        The most bytes of one part; None: :data:`PART_BYTES` (read at the call).

    Raises
    ------
    RuntimeError
        The ranks' keys or shapes are not the model's; a RankError when a rank fails.
    """
    groups, largest = parts(model, PART_BYTES if part_bytes is None else part_bytes)
    every = [k for g in groups for k in g]
    loaded = set()
    for i, keys in enumerate(groups):
        if loaded.issuperset(keys):  # a strategy that gave its whole state at the first part (ps)
            continue
        ars = [cluster.apply(r, calls.pull_part, name, keys, largest, every if i == 0 else None) for r in ranks]
        packed = cluster.wait_all(ars, timeout=cluster.spec.timeout, what="weights back")[0]
        load_into(model, *packed, part=True)
        loaded.update(packed[0])


def load_into(model, keys, descs, sizes, flat, part: bool = False) -> None:
    """Copy a state sent back by rank 0 into ``model``'s own tensors, one at a time.

    Parameters
    ----------
    model : torch.nn.Module
        The notebook's model; its tensors keep their identity (``Parameter`` objects, ``.grad``).
    keys, descs, sizes, flat
        What :func:`distnb.engine.transport.stateout.write_state` returned: ``flat`` a
        :class:`~distnb.engine.transport.wire.ShmRef` into rank 0's outbox, or a flat uint8 array.
    part : bool
        ``keys`` are a part of the model's state (:func:`stream_into`), not all of it.

    Raises
    ------
    RuntimeError
        From ``load_state_dict`` when the keys or a shape differ from the model's (torch's message); for a
        part, the key and both shapes.
    """
    import torch  # the kernel imports torch (and the wire format, which needs it) only when it needs it

    from distnb.engine.transport import wire  # imports torch: the kernel loads it at first use

    targets = model.state_dict(keep_vars=True)
    if part:
        for k, d in zip(keys, descs):
            if k not in targets or tuple(targets[k].shape) != tuple(d[1]):
                have = tuple(targets[k].shape) if k in targets else "no such key"
                raise RuntimeError(f"weights back: {k} has shape {tuple(d[1])} on the ranks, the notebook's model: "
                                   f"{have} (the cell changed the model's structure)")
    shapes_ok = (part or set(targets) == set(keys)) and \
        all(tuple(targets[k].shape) == tuple(d[1]) for k, d in zip(keys, descs))
    if not shapes_ok:  # let load_state_dict name the missing/unexpected keys or the shape
        with torch.no_grad():
            model.load_state_dict(wire.unflatten_state(keys, descs, sizes, flat))
        return
    if not isinstance(flat, wire.ShmRef):
        offsets = wire.layout(sizes)[0]
        _copy_each(targets, keys, descs, offsets, lambda off, n, d: wire.from_buffer(d[:2] + (False, False),
                                                                                    flat[off:off + n], copy=False))
        return
    fd = os.open(flat.path, os.O_RDONLY)
    try:
        def temporary(off, n, desc):
            got = torch.empty(n, dtype=torch.uint8)
            _read_exact(fd, _writable(got), off)
            return got.view(getattr(torch, desc[0])).view(tuple(desc[1]))

        _copy_each(targets, keys, descs, flat.offsets, temporary, fd=fd)
    finally:
        os.close(fd)


def _copy_each(targets, keys, descs, offsets, source, fd=None) -> None:
    """Each key's bytes into its target: read straight into it (``fd`` given), else ``copy_`` from ``source``."""
    import torch  # the kernel imports torch only when it needs it
    seen = set()
    with torch.no_grad():
        for key, desc, off in zip(keys, descs, offsets):
            t = targets[key]
            if t.numel() == 0 or (t.data_ptr(), t.dtype, tuple(t.shape)) in seen:  # tied weights: once
                continue
            seen.add((t.data_ptr(), t.dtype, tuple(t.shape)))
            n = t.numel() * torch.empty(0, dtype=getattr(torch, desc[0])).element_size()
            if fd is not None and _direct(t, desc):
                _read_exact(fd, _writable(t.detach()), off)
                torch.autograd.graph.increment_version(t)
            else:
                t.detach().copy_(source(off, n, desc))  # converts dtype and device; bumps the version
