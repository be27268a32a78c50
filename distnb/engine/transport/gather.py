"""A DTensor gathered whole on one rank only, straight into its place, in bounded messages.

``DTensor.full_tensor()`` is an all-gather: every rank of the mesh allocates the whole tensor, and the
writer (rank 0, which copies it into the outbox the kernel reads) holds it beside the outbox. For the
weights coming back after a cell that is one full tensor on every rank plus the outbox part on rank 0
(at 0.25 GiB, a 64 MiB layer: rank 0's peak 1.22x torchrun's under tensor parallelism, issue 34).

Here every rank that holds a distinct piece of the tensor sends its local shard to the writer in
messages of at most :data:`CHUNK_BYTES` (rows of the local tensor), and the writer copies each one
into the destination's slice (the outbox view) at that piece's global offset. The writer holds the
destination and one message; the other ranks hold nothing more than their shard.

Which piece each rank holds comes from DTensor's own layout rule
(``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``, per mesh coordinate), so
uneven shards (``torch.chunk`` sizes, empty shards) are placed as ``full_tensor()`` would. Placements
other than plain ``Shard`` and ``Replicate`` (``_StridedShard`` of fsdp over tensor, ``Partial``) are
not handled here: :func:`supported` says so and the caller gathers them whole.

Idea: torch.distributed.checkpoint writes each rank's local shards with their global offsets
(``ChunkStorageMetadata``) rather than gathering; this places them the same way, on one rank.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

#: Bytes per message at most (rows of a rank's local shard; one row alone may be larger).
CHUNK_BYTES = 4 << 20


def supported(t, writer: int = 0) -> bool:
    """Whether :func:`gather_into` places DTensor ``t`` on ``writer``: plain ``Shard`` / ``Replicate`` placements on
    a mesh that holds ``writer`` (every rank of that mesh decides alike; a rank on a mesh without the writer, e.g.
    fsdp+tensor's per-group meshes, gathers as before, among its own mesh only)."""
    if not hasattr(t, "device_mesh") or not dist.is_initialized():
        return False
    from torch.distributed.tensor import Replicate, Shard  # DTensor's package: loaded once a DTensor exists

    mesh = t.device_mesh
    return (all(type(p) in (Shard, Replicate) for p in t.placements) and mesh.get_coordinate() is not None
            and writer in mesh.mesh.flatten().tolist())


def _pieces(t):
    """``(global rank, local shape, global offset)`` of each distinct piece of ``t`` (a replica sends once)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = t.device_mesh
    ranks = mesh.mesh
    out = []
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        if any(c and isinstance(p, Replicate) for c, p in zip(coord, t.placements)):
            continue  # a copy of the piece held at coordinate 0 of that replicated mesh dimension
        shape, offset = _compute_local_shape_and_global_offset(t.shape, ranks.shape, list(coord), t.placements)
        out.append((int(ranks[coord]), tuple(shape), tuple(offset)))
    return out


def _rows(shape, element_size: int) -> int:
    """Rows of a local shard of ``shape`` per message (at least one)."""
    row = element_size * (int(torch.Size(shape[1:]).numel()) if len(shape) > 1 else 1)
    return max(1, CHUNK_BYTES // max(row, 1))


def gather_into(t, dst, writer: int = 0, device=None) -> None:
    """Write DTensor ``t`` whole into ``dst`` on global rank ``writer``; every rank of ``t``'s mesh calls this.

    Parameters
    ----------
    t : DTensor
        Placements :func:`supported` accepts; the same tensor (same global shape and placements) on every rank,
        called in the same order (point-to-point messages pair by order).
    dst : torch.Tensor or None
        On ``writer``: a CPU (or device) tensor of ``t``'s global shape and dtype, filled in place. Ignored elsewhere.
    writer : int
        Global rank that assembles the tensor (a rank of ``t``'s mesh).
    device : torch.device or None
        Where messages travel: the default group's device (:func:`distnb.engine.process.collectives.group_device`,
        which the caller passes); None: the shard's own device.

    Notes
    -----
    Messages go over the default process group (``send``/``recv`` pair any two of its ranks), on ``device``: on nccl each travels from the sender's GPU (a
    shard in host memory, fsdp's ``--offload cpu``, is copied there one message at a time) into one buffer on
    the writer's GPU, then into ``dst`` (a blocking copy, so the buffer can take the next message).
    """
    me = dist.get_rank()
    local = t.to_local().detach()
    device = local.device if device is None else device  # a shard in host memory (fsdp --offload cpu) goes by it
    local = local.reshape(1) if local.dim() == 0 else local
    buf = None
    for rank, shape, offset in _pieces(t):
        shape, offset = (shape, offset) if shape else ((1,), (0,))
        if not all(shape) or me not in (rank, writer):  # an empty shard (more ranks than rows), or not ours
            continue
        if rank == me == writer:
            _place(dst, offset, shape, local)
            continue
        row = int(torch.Size(shape[1:]).numel())
        step = _rows(shape, local.element_size())
        for start in range(0, shape[0], step):
            n = min(step, shape[0] - start)
            if me == rank:
                dist.send(local[start:start + n].to(device).contiguous(), dst=writer)  # group device: moved there
                continue
            if buf is None or buf.numel() < n * row:
                buf = torch.empty(step * row, dtype=local.dtype, device=device)
            piece = buf[: n * row].view(n, *shape[1:])
            dist.recv(piece, src=rank)  # group device: buf is made on it
            _place(dst, (offset[0] + start, *offset[1:]), (n, *shape[1:]), piece)


def _place(dst, offset, shape, src) -> None:
    """``dst[offset : offset + shape] = src`` over every dimension (a 0-d tensor: the value)."""
    if dst.dim() == 0:
        dst.copy_(src.reshape(()))
        return
    view = dst
    for dim, (o, n) in enumerate(zip(offset, shape)):
        view = view.narrow(dim, o, n)
    view.copy_(src.reshape(shape))
