"""The tensor-plan check's second forward: both models' weights moved by the same seeded noise.

A non-elementwise term that is zero at the current weights (``h + g * h.mean(-1)`` with ``g``
initialised at 0, as in ReZero or adaLN-Zero) makes the split model agree with the whole one on the
first batch and differ once ``g`` has trained; at moved weights it differs at once
(:mod:`~distnb.engine.strategies.tensor_check`). Each parameter ``w`` moves by ``noise * (0.5 *
mean|w| + 0.1)``, ``noise`` standard normal.

The noise is a function of the parameter's index in ``named_parameters()`` and of the row, never of
the rank: :func:`noise_rows` makes any block of rows of any parameter, so the whole model's copy of a
layer and each rank's shard of it get the same values without any rank making the whole tensor's
noise. The scales come from every rank's shard in one ``all_reduce``.

Two ways to move the weights, with the same noise:

- :class:`MovedPerModule` (the whole model runs one module at a time, :mod:`.layered`, and the split
  model has no FSDP unit): each module's parameters are moved just before its forward, into new
  tensors, and put back after it; the whole model's layer is moved as it is gathered. A rank holds one
  module's moved shard beside its share: no copy of the share (it kept one, 128 MiB of a 256 MiB
  model split in two, to put the values back: 1.37-1.46x torchrun's peak for a meta model under
  ``--strategy tensor`` in issue 34's benchmark).
- :class:`MovedInPlace` (the whole model held, or FSDP units whose gathered parameters are views of
  their shards): the parameters are moved in place and copied back afterwards, bit for bit; each
  shard's noise is cut from the whole tensor's by ``distribute_tensor`` (any placement, fsdp+tensor's
  ``_StridedShard`` included), as the check always did.
"""

from __future__ import annotations

import torch

from distnb.engine.process.collectives import group_device

#: Noise is made in blocks of rows of at most this many bytes (float32), seeded per parameter and block.
BLOCK_BYTES = 1 << 20
SEED = 20260104


def _rows_per_block(shape) -> int:
    row = int(torch.Size(shape[1:]).numel()) if len(shape) > 1 else 1
    return max(1, (BLOCK_BYTES // 4) // max(row, 1))


def noise_rows(index: int, shape, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of parameter ``index``'s standard-normal noise (float32, CPU), the same on every rank.

    Parameters
    ----------
    index : int
        The parameter's position in the split model's ``named_parameters()`` (ties counted once).
    shape : tuple of int
        The whole parameter's shape; a 0-d parameter is one row of one element.
    start, stop : int
        Rows of dimension 0 (of ``(1,)`` for a 0-d parameter).

    Returns
    -------
    torch.Tensor
        Shape ``(stop - start, *shape[1:])``, float32.
    """
    shape = tuple(shape) or (1,)
    per = _rows_per_block(shape)
    blocks = []
    for block in range(start // per, (stop - 1) // per + 1 if stop > start else start // per):
        lo, hi = block * per, min(shape[0], (block + 1) * per)
        gen = torch.Generator().manual_seed(SEED + 1_000_003 * index + block)
        rows = torch.randn((hi - lo, *shape[1:]), generator=gen, dtype=torch.float32)
        blocks.append(rows[max(start, lo) - lo: min(stop, hi) - lo])
    return torch.cat(blocks) if blocks else torch.empty((0, *shape[1:]))


def add_noise(dst: torch.Tensor, index: int, shape, offset, scale: float) -> None:
    """``dst += noise[offset : offset + dst.shape] * scale`` in place, a block of rows at a time.

    ``dst``: a tensor (or a shard) of the parameter of whole shape ``shape``, at ``offset`` in it (a tuple
    per dimension); a 0-d ``dst`` is one row.
    """
    view = dst.reshape(1) if dst.dim() == 0 else dst
    offset = tuple(offset) or (0,)
    per = _rows_per_block(tuple(shape) or (1,))
    for start in range(0, view.shape[0], per):
        n = min(per, view.shape[0] - start)
        rows = noise_rows(index, shape, offset[0] + start, offset[0] + start + n)
        for dim in range(1, view.dim()):
            rows = rows.narrow(dim, offset[dim], view.shape[dim])
        view[start:start + n].add_(rows.mul_(scale).to(view.device, view.dtype))


def _local_place(q):
    """(local tensor, global offset, counted here): a DTensor's shard and whether this rank counts it in a sum."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not hasattr(q, "device_mesh"):
        return q.detach(), (0,) * q.dim(), None
    _, offset = compute_local_shape_and_global_offset(q.shape, q.device_mesh, q.placements)
    coord = q.device_mesh.get_coordinate()
    counted = not any(c and isinstance(p, Replicate) for c, p in zip(coord, q.placements))
    return q.to_local().detach(), tuple(offset), counted


def scales(params) -> list[float]:
    """``0.5 * mean|w| + 0.1`` of each parameter of ``params`` (whole tensors), from the ranks' shards.

    One ``all_reduce`` (SUM) of every shard's sum of ``|w|`` over the default group: each distinct piece is
    counted once (a replica on one rank only; a plain, replicated parameter on rank 0 only). Every rank of
    the default group calls this with the same parameters in the same order.
    """
    import torch.distributed as dist

    sums = torch.zeros(len(params), dtype=torch.float64)
    rank0 = dist.get_rank() == 0
    for i, q in enumerate(params):
        local, _, counted = _local_place(q)
        if counted is None:
            counted = rank0
        if counted and local.numel():
            per = _rows_per_block(tuple(local.shape) or (1,))
            flat = local.reshape(1) if local.dim() == 0 else local
            sums[i] = sum(float(flat[s:s + per].abs().double().sum()) for s in range(0, flat.shape[0], per))
    sums = sums.to(group_device())
    dist.all_reduce(sums)
    return [0.5 * float(s) / max(q.numel(), 1) + 0.1 for s, q in zip(sums.cpu().tolist(), params)]


def _floats(split):
    """(index, parameter) of ``split``'s floating-point parameters, ties once, in ``named_parameters()`` order."""
    return [(i, q) for i, (_, q) in enumerate(split.named_parameters()) if q.is_floating_point()]


class MovedPerModule:
    """Within ``with``: each module of ``split`` runs with its own parameters moved (new tensors, put back after
    its forward), and ``layer_by_layer`` moves each layer of the whole model as it gathers it.

    Parameters
    ----------
    split : torch.nn.Module
        The distributed module (DTensor or plain parameters; no FSDP unit).
    device : torch.device
        This rank's device (the scales' ``all_reduce`` runs on the group's device).
    layer_by_layer : distnb.engine.strategies.layered.LayerByLayer
        The whole model's forward, one module at a time (its ``transform`` is set within ``with``).
    """

    def __init__(self, split, device, layer_by_layer):
        self.split, self.device, self.layers = split, device, layer_by_layer
        self.handles = []

    def __enter__(self):
        floats = _floats(self.split)
        self.index = {id(q): (i, s) for (i, q), s in zip(floats, scales([q for _, q in floats]))}
        self.layers.transform = self._move_whole
        for mod in self.split.modules():
            own = [k for k, q in mod._parameters.items() if q is not None and id(q) in self.index]
            if own:
                self.handles.append(mod.register_forward_pre_hook(lambda m, a, own=own: self._move(m, own)))
                self.handles.append(mod.register_forward_hook(lambda m, a, o, own=own: self._back(m, own),
                                                              always_call=True))
        self.kept = {}
        return self

    def __exit__(self, *exc):
        self.layers.transform = None
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for (mod, key), q in self.kept.items():  # a forward that raised before its module's hook after ran
            mod._parameters[key] = q
        self.kept = {}

    def _move_whole(self, src, full):
        """The whole model's copy of ``src`` (gathered into ``full``), moved: a new tensor, ``src`` untouched."""
        found = self.index.get(id(src))
        if found is None:
            return full
        local = src.to_local() if hasattr(src, "device_mesh") else src
        if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            full = full.clone()  # a plain or replicated parameter is its own whole tensor: never move the split one's
        add_noise(full, found[0], src.shape, (0,) * src.dim(), found[1])
        return full

    def _move(self, mod, own) -> None:
        from torch.distributed.tensor import DTensor

        for key in own:
            q = mod._parameters[key]
            if (mod, key) in self.kept:  # a module called again within its own call: already moved
                continue
            index, scale = self.index[id(q)]
            local, offset, _ = _local_place(q)
            moved = local.clone()
            add_noise(moved, index, q.shape, offset, scale)
            if hasattr(q, "device_mesh"):
                moved = DTensor.from_local(moved, q.device_mesh, q.placements, shape=q.shape, stride=q.stride(),
                                           run_check=False)
            self.kept[(mod, key)] = q
            mod._parameters[key] = torch.nn.Parameter(moved, requires_grad=q.requires_grad)

    def _back(self, mod, own) -> None:
        for key in own:
            q = self.kept.pop((mod, key), None)
            if q is not None:
                mod._parameters[key] = q


class MovedInPlace:
    """Within ``with``: both models' parameters moved in place by the same noise, copied back after, bit for bit.

    ``whole``: the whole model held (not a meta skeleton), or a skeleton filled from the split model's
    tensors (which carry the move). ``split``: the distributed module; FSDP units are resharded first, so
    that the noise goes into the shards (FSDP2 leaves the root's parameters gathered after a forward).
    """

    def __init__(self, whole, split, device):
        self.whole, self.split, self.device = whole, split, device

    def __enter__(self):
        self._reshard()
        floats = _floats(self.split)
        names = {id(q): n for n, q in self.split.named_parameters()}
        mine = {names[id(q)]: (i, q, s) for (i, q), s in zip(floats, scales([q for _, q in floats]))}
        self.saved = []
        with torch.no_grad():
            for name, p in self.whole.named_parameters():
                if name not in mine or not p.is_floating_point():
                    continue
                index, q, scale = mine[name]
                local = q.to_local().detach() if hasattr(q, "device_mesh") else q.detach()
                self.saved.append((local, local.clone()))  # before anything moves: p may be this very tensor
                if not p.is_meta:
                    if p.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                        p.data = p.detach().clone()  # a replica's full tensor is its local one: move each once
                    add_noise(p, index, p.shape, (0,) * p.dim(), scale)
                local.add_(self._shard_of_noise(index, q, scale))

    def _shard_of_noise(self, index: int, q, scale: float) -> torch.Tensor:
        """This rank's part of parameter ``index``'s moved amount, cut by DTensor's own rule (any placement)."""
        from torch.distributed.tensor import distribute_tensor

        noise = noise_rows(index, q.shape, 0, q.shape[0] if q.dim() else 1).reshape(q.shape)
        noise = noise.mul_(scale).to(self.device, q.dtype)
        if not hasattr(q, "device_mesh"):
            return noise
        return distribute_tensor(noise, q.device_mesh, q.placements, src_data_rank=None).to_local()

    def _reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for m in self.split.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def __exit__(self, *exc):
        self._reshard()  # the moved values the split forward gathered are freed, the shards restored below
        with torch.no_grad():
            for local, kept in self.saved:
                local.copy_(kept)
        self.saved = []
