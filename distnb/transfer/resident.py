"""Notebook tensors that live in the kernel's shared memory, so that moving them again copies nothing here.

A same-host transfer (:mod:`distnb.engine.transport.segments`) used to cost a full copy in the kernel every
time: the model's bytes into a ``/dev/shm`` segment on the way out, and the rank's bytes into the
model's tensors on the way back. Here the segment becomes the tensors' memory instead:

- **Sent once, then in place.** After a model (or a data set) is written into a segment and the
  ranks have read it, the notebook's tensors are re-pointed into that segment (:func:`adopt`:
  ``tensor.data`` set to a tensor on the segment's storage; the Python objects, their version
  counters, ``requires_grad`` and ``.grad`` stay). The segment is then *resident*
  (:meth:`~distnb.engine.transport.segments.Pool.keep`): never handed out again while a tensor lives on it.
  The next send of those tensors finds them there (:func:`in_place`) and sends only where they lie.
- **Weights back in place.** Rank 0 writes the trained state into its own outbox and the kernel
  reads each tensor from there into the model's memory, here the resident segment
  (:mod:`distnb.transfer.weights_back`): the kernel never holds the model twice.
- **Sent one tensor at a time.** The first send writes each tensor into the segment and re-points
  it at once (:func:`write_adopting`), so the model's old memory is freed tensor by tensor.

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

import ctypes
import ctypes.util


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
    its own (:func:`distnb.engine.transport.segments.tensor_at`: ``torch.save`` of it writes just its bytes)."""
    import torch

    from distnb.engine.transport import segments  # imports torch: the kernel loads it at first use

    moved = segments.tensor_at(owner, offset, t.dtype, t.shape)
    with torch.no_grad():
        t.data = moved


def in_place(pool, buffers):
    """A :class:`~distnb.engine.transport.wire.ShmRef` to ``buffers`` where they already lie, or None.

    ``buffers``: flat uint8 arrays (:func:`distnb.engine.transport.wire.to_buffer`). Only when every non-empty
    one lies in one resident segment of ``pool`` (whose file still exists) at a 64-byte offset.
    """
    from distnb.engine.transport import wire  # imports torch: the kernel loads it at first use

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


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``; elsewhere nothing).

    A freed tensor of up to 32 MiB goes back to glibc's heap, not to the system, once glibc has raised
    its mmap threshold (it does after the first large free): moving a model into a segment tensor by
    tensor would then hold the old memory as well as the new until the end, twice the model.
    """
    libc = _LIBC.get("libc", False)
    if libc is False:

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.malloc_trim  # noqa: B018 - only glibc has it
        except (OSError, AttributeError):
            libc = None
        _LIBC["libc"] = libc
    if libc is not None:
        libc.malloc_trim(0)


_LIBC: dict = {}


def write_adopting(pool, seg, buffers: list, tensors):
    """Write ``buffers`` into ``seg`` one at a time, re-pointing each of ``tensors`` (:func:`movable`) into the
    segment as soon as its bytes are there; returns ``(ShmRef, whether any moved)``.

    So the kernel never holds a model twice while sending it: each tensor's old memory is freed
    once its copy is written (``buffers[i]``, the list the caller passed, then views the segment,
    so nothing keeps the old memory alive). Moved tensors live in ``seg`` whatever the ranks do
    with it next: it is resident from the first move on.
    """
    import torch

    from distnb.engine.transport import wire  # imports torch: the kernel loads it at first use

    offsets, _ = wire.layout([len(b) for b in buffers])
    by_address = {t.data_ptr(): t for t in tensors}
    owner = None
    for i, off in enumerate(offsets):  # by index: no iterator's tuple keeps an old buffer alive
        b = buffers[i]
        n = len(b)
        if not n:
            continue
        seg.base[off:off + n].copy_(torch.from_numpy(b))
        t = by_address.get(b.__array_interface__["data"][0])
        if t is None or _nbytes(t) != n or off % t.element_size():
            continue
        if owner is None:
            owner = pool.keep(seg)
        _repoint(t, owner, off)
        buffers[i] = seg.base[off:off + n].numpy()  # the old bytes' last reference goes
        del b
        _trim_heap()
    return wire.ShmRef(seg.path, offsets, [len(x) for x in buffers]), owner is not None
