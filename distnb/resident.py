"""Notebook tensors that live in the kernel's shared memory, so that moving them again copies nothing here.

A same-host transfer (:mod:`distnb.engine.segments`) used to cost a full copy in the kernel every
time: the model's bytes into a ``/dev/shm`` segment on the way out, and the rank's bytes into the
model's tensors on the way back. Here the segment becomes the tensors' memory instead:

- **Sent once, then in place.** After a model (or a data set) is written into a segment and the
  ranks have read it, the notebook's tensors are re-pointed into that segment (:func:`adopt`:
  ``tensor.data`` set to a tensor on the segment's storage; the Python objects, their version
  counters, ``requires_grad`` and ``.grad`` stay). The segment is then *resident*
  (:meth:`~distnb.engine.segments.Pool.keep`): never handed out again while a tensor lives on it.
  The next send of those tensors finds them there (:func:`in_place`) and sends only where they lie.
- **Weights back into the kernel's own memory.** Before a training cell, the kernel offers rank 0
  a free segment of the model's size (:class:`distnb.transfer.Offer`); rank 0 writes the trained state into it (its
  one copy) and the kernel re-points the model's tensors into it: no copy here. The segment the
  model used before is free once no tensor uses it, and is offered next time: both sides write
  into pages they touched before, the warm copy rate rather than the first-touch one.

Nothing a user can see changes. A tensor moves only when nothing else can notice it: a plain CPU
tensor (or ``Parameter``), contiguous, that alone uses all of its storage, which torch allocated
(a ``torch.from_numpy`` or ``torch.frombuffer`` tensor shares memory with something else and
stays where it is), and that no other tensor references (``w = net.fc.weight.detach()`` keeps
``net.fc.weight`` where it is, so ``w`` goes on seeing the trained weights). A tensor that cannot
move is copied, as before.

Idea: the same as PyTorch's ``Tensor.share_memory_()``, which moves a tensor's storage into
shared memory in place for ``torch.multiprocessing``; here the memory is distnb's own pooled
segments, so that they are reused from transfer to transfer.
"""

from __future__ import annotations


def _users(storage) -> int:
    """How many tensors (and storage objects) use ``storage``, this call's own reference not counted."""
    import torch

    try:
        return torch._C._storage_Use_Count(storage._cdata) - 1
    except (AttributeError, RuntimeError):  # not in this torch: nothing moves
        return 1 << 30


def _plain(t) -> bool:
    import torch

    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and t.layout == torch.strided and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and t.numel() > 0)


def movable(tensors, pool) -> list:
    """The distinct tensors of ``tensors`` that can be re-pointed into a segment unnoticed (see the module).

    A tensor qualifies when it alone uses all of a storage that torch allocated and that was never
    handed to numpy (``resizable()``: ``torch.from_numpy``, ``torch.frombuffer`` and ``.numpy()``
    make it False, and a numpy array may still share that memory), or when it lies in one of
    ``pool``'s resident segments on a storage used by ``tensors`` only (their bytes disjoint).
    Decide before sending: packing a tensor exports it to numpy.
    """
    import torch

    seen, groups = set(), {}
    for t in tensors:
        if id(t) in seen or not isinstance(t, torch.Tensor) or not _plain(t):
            continue
        seen.add(id(t))
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    out = []
    for group in groups.values():
        storage = group[0].untyped_storage()
        if _users(storage) != len(group):
            continue
        if len(group) == 1 and storage.resizable() and group[0].storage_offset() == 0 \
                and storage.nbytes() == group[0].numel() * group[0].element_size():
            out.append(group[0])
        elif all(pool.ours(t.data_ptr(), _nbytes(t)) for t in group) and _disjoint(group):
            out.extend(group)
    return out


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _disjoint(group) -> bool:
    spans = sorted((t.data_ptr(), t.data_ptr() + _nbytes(t)) for t in group)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _repoint(t, owner, offset: int) -> None:
    """``t``'s data becomes the bytes at ``offset`` of ``owner`` (same object, dtype and shape), on a storage of
    its own (:func:`distnb.engine.segments.tensor_at`: ``torch.save`` of it writes just its bytes)."""
    import torch

    from .engine import segments

    moved = segments.tensor_at(owner, offset, t.dtype, t.shape)
    with torch.no_grad():
        t.data = moved


def in_place(pool, buffers):
    """A :class:`~distnb.engine.wire.ShmRef` to ``buffers`` where they already lie, or None.

    ``buffers``: flat uint8 arrays (:func:`distnb.engine.wire.to_buffer`). Only when every non-empty
    one lies in one resident segment of ``pool`` (whose file still exists) at a 64-byte offset.
    """
    from .engine import wire

    where, offsets, sizes = None, [], []
    for b in buffers:
        n = len(b)
        if not n:
            offsets.append(0)
            sizes.append(0)
            continue
        found = pool.holding(b.__array_interface__["data"][0], n)
        if found is None or (where is not None and found[0] is not where) or found[1] % 64:
            return None
        where = found[0]
        offsets.append(found[1])
        sizes.append(n)
    return None if where is None else wire.ShmRef(where.path, offsets, sizes)


def adopt(pool, seg, buffers, ref, tensors) -> bool:
    """After a send: re-point ``tensors`` (:func:`movable`, decided before packing) whose bytes were
    written into ``seg`` (at ``ref``).

    ``buffers`` are what was written (in ``ref``'s order). Returns whether any tensor moved: then
    ``seg`` is resident; else the caller releases it.
    """
    placed = {b.__array_interface__["data"][0]: (off, n) for b, off, n in zip(buffers, ref.offsets, ref.sizes) if n}
    todo = [(t, placed[t.data_ptr()][0]) for t in tensors if placed.get(t.data_ptr(), (0, -1))[1] == _nbytes(t)]
    if not todo:
        return False
    owner = pool.keep(seg)
    for t, offset in todo:
        _repoint(t, owner, offset)
    return True


def adopt_state(pool, targets: dict, keys, descs, ref) -> set:
    """Weights back: re-point the movable tensors of ``targets`` (a ``state_dict(keep_vars=True)``) into
    the kernel segment ``ref`` points at (the rank wrote the state there). Returns the keys moved.

    A key whose target has another dtype or shape, or cannot move, is left to the caller to copy.
    """
    seg = pool.busy.get(ref.path)
    if seg is None:
        return set()
    can = {id(t) for t in movable(targets.values(), pool)}
    todo, done = [], set()
    for key, desc, off, n in zip(keys, descs, ref.offsets, ref.sizes):
        t = targets.get(key)
        if t is None or id(t) not in can or str(t.dtype).removeprefix("torch.") != desc[0] \
                or tuple(t.shape) != tuple(desc[1]) or n != _nbytes(t) or off % t.element_size():
            continue
        if id(t) not in done:
            todo.append((t, off))
            done.add(id(t))
    if not todo:
        return set()
    owner = pool.keep(seg)
    for t, off in todo:
        _repoint(t, owner, off)
    return {k for k in keys if id(targets.get(k)) in done}

