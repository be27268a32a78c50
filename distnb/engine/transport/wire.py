"""The wire format for tensors between the kernel and the ranks.

A tensor travels as a small description ``(dtype, shape, requires_grad, is_param)``
plus its bytes. Objects that *contain* tensors (a model, a data set) travel as a pickle
whose tensors are replaced by persistent ids, with the tensor bytes alongside (see
:mod:`distnb.transfer.transfer` for the kernel side). The bytes go one of two ways:

- **Shared memory** (kernel and rank on one host): the sender copies every tensor's bytes
  once into a segment of its pool under ``/dev/shm`` (a tmpfs: the pages are RAM, never a
  disk) and sends a small :class:`ShmRef` instead. Receivers copy the bytes into their tensors
  (models: into memory a dropped model used), or map the segment copy-on-write (data shards,
  which are read, not written: no copy at all). Segments, mappings and that memory are kept
  and written again by the next transfer, so their pages are touched already
  (:mod:`~distnb.engine.transport.segments` says why and what it costs). Whether a rank shares
  ``/dev/shm`` with the kernel is probed once per cluster (:func:`probe_shm`);
  ``DISTNB_SHM=0`` turns the path off. On one host this moves a 400 MB model at several GB/s,
  against about 250 MiB/s per engine through ipyparallel.
- **ipyparallel buffers** (a rank on another host, or no usable ``/dev/shm``): one flat
  ``uint8`` numpy array per tensor, which ipyparallel sends as a zero-copy message
  frame (no pickling of tensor data).

Files are named ``distnb-<kernel pid>-...`` so that whatever a crash leaves behind can be
swept: by the kernel when it stops its cluster and by the reaper when the kernel dies
(:func:`sweep_shm`).
"""

from __future__ import annotations

import difflib
import io
import os
import pickle
import types
import warnings
from collections import ChainMap

import torch

from distnb.engine.transport import parametrized, segments, sources
from distnb.engine.transport.segments import shm_path, sweep_shm  # noqa: F401  (the file names; used by the kernel too)

#: Byte alignment of each tensor in a shared-memory file (any dtype can be viewed there).
_ALIGN = 64
#: Bytes per read/write call in a shared-memory transfer, and the threads that share big ones.
_CHUNK = 8 << 20
_IO_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Rank side: set by :func:`probe_shm` when the kernel's ``/dev/shm`` is visible here.
_SHM = {"ok": False, "owner": None}
#: This process's mappings of other processes' segments, and its memory for received models.
_MAPS = segments.Maps()
_ARENAS = segments.Arenas()


def describe(t: torch.Tensor) -> tuple:
    """The description of a tensor: (dtype name, shape tuple, requires_grad, is_param), plus ``True`` for a
    tensor on the meta device (its shape only travels: :func:`to_buffer` gives no bytes)."""
    desc = (str(t.dtype).removeprefix("torch."), tuple(t.shape), bool(t.requires_grad),
            isinstance(t, torch.nn.Parameter))
    return desc + (True,) if t.is_meta else desc


def is_meta_desc(desc) -> bool:
    """Whether :func:`describe` said the tensor was on the meta device (no data travels)."""
    return len(desc) > 4 and bool(desc[4])


def to_buffer(t: torch.Tensor):
    """A flat uint8 numpy view of ``t``'s bytes (a copy only if t is on a GPU or not contiguous; none for meta)."""
    if t.is_meta:
        import numpy as np

        return np.empty(0, dtype=np.uint8)
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _finish(t: torch.Tensor, desc: tuple) -> torch.Tensor:
    """Give a rebuilt tensor its Parameter-ness and requires_grad from ``desc``."""
    requires_grad, is_param = desc[2], desc[3]
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def from_buffer(desc: tuple, buf, copy: bool = True) -> torch.Tensor:
    """Rebuild a tensor from :func:`describe` and :func:`to_buffer` output.

    ``copy=False`` wraps the (possibly read-only) received buffer without copying; only
    use that for tensors that are read, never written.
    """
    dtype, shape = getattr(torch, desc[0]), desc[1]
    if is_meta_desc(desc):
        return _finish(torch.empty(shape, dtype=dtype, device="meta"), desc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only zmq buffers
        raw = torch.frombuffer(buf, dtype=torch.uint8) if len(memoryview(buf).cast("B")) else torch.empty(0, dtype=torch.uint8)
    if copy:
        raw = raw.clone()
    return _finish(raw.view(dtype).reshape(shape), desc)


def pack(obj, tensors=None):
    """Pickle ``obj`` with cloudpickle, its tensors cut out as zero-copy buffers.

    Classes and functions defined in a notebook (``__main__``) travel by value, their code with
    its file name and the notebook cell's source (:mod:`distnb.engine.transport.sources`: tracebacks and pdb
    on the receiving side show their lines). Used in both directions: kernel to ranks (push,
    models) and ranks to kernel (pull). ``tensors``:
    a list that receives the tensors cut out, in ``descs``' order (their version counters tell
    an in-place change, which neither the pickle nor the buffers' addresses show).

    Returns
    -------
    payload : bytes
        The pickle, without tensor data.
    descs : list of tuple
        One :func:`describe` per distinct tensor.
    buffers : list of numpy.ndarray
        One flat uint8 view per tensor (zero-copy for contiguous CPU tensors).
    """

    import cloudpickle


    class _TensorPickler(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: sources.reduce_code}, cloudpickle.Pickler.dispatch_table)

        def __init__(self, file):
            super().__init__(file, protocol=5)
            self.tensors, self._index = [], {}

        def reducer_override(self, obj):
            if parametrized.is_parametrized(obj):  # torch refuses to pickle these: their class, then their state
                return parametrized.reduce(obj)
            return super().reducer_override(obj)

        def persistent_id(self, obj):
            if isinstance(obj, torch.Tensor):
                key = id(obj)
                if key not in self._index:
                    self._index[key] = len(self.tensors)
                    self.tensors.append(obj)
                return self._index[key]
            return None

    f = io.BytesIO()
    p = _TensorPickler(f)
    p.dump(obj)
    if tensors is not None:
        tensors.extend(p.tensors)
    return f.getvalue(), [describe(t) for t in p.tensors], [to_buffer(t) for t in p.tensors]


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors):
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid):
        return self._tensors[pid]


def receive(descs, buffers, mapped: bool = False) -> list:
    """The tensors sent as ``buffers`` (ipyparallel buffers, or one :class:`ShmRef`), writable.

    ``mapped=True`` maps a shared-memory file copy-on-write instead of copying it (for data
    that is read, not written: the pages stay shared until something writes to them).
    """
    if len(buffers) == 1 and isinstance(buffers[0], ShmRef):
        return read_shm(buffers[0], descs, mapped=mapped)
    return [from_buffer(d, b) for d, b in zip(descs, buffers)]


def loads(payload: bytes, descs, buffers):
    """Load an object packed by :func:`pack` (tensors rebuilt, writable).

    ``buffers``: the tensor buffers, or one :class:`ShmRef` to them (see :func:`receive`).
    """
    obj = _Unpickler(io.BytesIO(payload), receive(descs, buffers)).load()
    if isinstance(obj, torch.nn.Module):
        hook_ids_after(obj)
    return obj


def hook_ids_after(module) -> None:
    """Make the hooks registered in this process from now on take keys above every hook key ``module`` came with.

    torch keys a module's hooks by ``torch.utils.hooks.RemovableHandle.next_id``, a counter of the
    process that registered them. A module unpickled here keeps its keys, while this process's
    counter starts at 0, so the next hook registered here on the same module (FSDP2's pre-forward
    hook, distnb's, the user's) took a received hook's key and replaced it: a
    ``torch.nn.utils.weight_norm`` layer under ``--strategy fsdp`` lost its hook and never trained
    ``weight_g``/``weight_v``, with no error.
    """
    from torch.utils.hooks import RemovableHandle

    top = -1
    for sub in module.modules():
        for key, value in vars(sub).items():
            if "hook" in key and isinstance(value, dict) and value:
                top = max(top, max((k for k in value if isinstance(k, int)), default=-1))
    if top >= RemovableHandle.next_id:
        RemovableHandle.next_id = top + 1


def unflatten_state(keys, descs, sizes, flat) -> dict:
    """Inverse of :func:`distnb.engine.transport.stateout.flatten_state`; the tensors are read-only views of ``flat``.

    For a :class:`ShmRef` the tensors are copies read from the rank's outbox.
    """
    if isinstance(flat, ShmRef):
        src = segments_view(flat)
        return {k: _view(src, off, n, d).clone() for k, d, off, n in zip(keys, descs, flat.offsets, flat.sizes)}
    out = {}
    for k, d, n, offset in zip(keys, descs, sizes, layout(sizes)[0]):
        out[k] = from_buffer(d[:2] + (False, False), flat[offset:offset + n], copy=False)
    return out


# shared memory -------------------------------------------------------------------------------

class ShmRef:
    """Where tensors' bytes lie in one shared-memory file: what travels instead of the bytes.

    Attributes
    ----------
    path : str
        The file (under :data:`~.segments.SHM_DIR`).
    offsets, sizes : list of int
        Byte offset and byte length of each tensor (offsets aligned to 64 bytes).
    """

    __slots__ = ("path", "offsets", "sizes")

    def __init__(self, path: str, offsets, sizes):
        self.path, self.offsets, self.sizes = path, list(offsets), list(sizes)

    def __getstate__(self):
        return self.path, self.offsets, self.sizes

    def __setstate__(self, state):
        self.path, self.offsets, self.sizes = state

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(self.sizes)

    @property
    def extent(self) -> int:
        """Bytes from the start of the file to the end of the last tensor (at least 1)."""
        return max([off + n for off, n in zip(self.offsets, self.sizes)] + [1])

    def unlink(self) -> None:
        """Remove the file (mappings of it stay valid); no error if it is gone already."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self):
        return f"ShmRef({self.path!r}, {len(self.sizes)} tensors, {self.nbytes} bytes)"


def layout(sizes) -> tuple:
    """Byte offsets (64-byte aligned) of tensors of ``sizes`` bytes in one segment, and its length."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // _ALIGN) * _ALIGN
    return offsets, max(end, 1)


def _view(base: torch.Tensor, offset: int, nbytes: int, desc: tuple) -> torch.Tensor:
    """The tensor ``desc`` (dtype, shape, ...) at ``offset`` of a uint8 ``base``."""
    return base[offset:offset + nbytes].view(getattr(torch, desc[0])).view(tuple(desc[1]))


def write_into(seg, buffers) -> ShmRef:
    """Copy ``buffers`` (flat uint8 arrays, see :func:`to_buffer`) into segment ``seg``; where they lie."""
    return _write(seg.base, seg.path, buffers)


def _write(base: torch.Tensor, path: str, buffers) -> ShmRef:
    views = [torch.from_numpy(b) if len(b) else torch.empty(0, dtype=torch.uint8) for b in buffers]
    offsets, _ = layout([v.numel() for v in views])
    for v, off in zip(views, offsets):
        base[off:off + v.numel()].copy_(v)
    return ShmRef(path, offsets, [v.numel() for v in views])


def rows_layout(columns, index) -> tuple:
    """``(descs, sizes, total bytes)`` of rows ``index`` of ``columns`` laid out in one segment."""
    shapes = [(len(index),) + tuple(c.shape[1:]) for c in columns]
    sizes = [int(torch.Size(s).numel()) * c.element_size() for s, c in zip(shapes, columns)]
    descs = [(str(c.dtype).removeprefix("torch."), s, False, False) for c, s in zip(columns, shapes)]
    return descs, sizes, layout(sizes)[1]


def write_rows_into(seg, columns, index) -> tuple:
    """Gather rows ``index`` of each column straight into segment ``seg`` (no copy in between).

    Returns
    -------
    ref : ShmRef
    descs : list of tuple
        :func:`describe` of each gathered column (shape ``(len(index), ...)``).
    """
    index = torch.as_tensor(index, dtype=torch.long)
    descs, sizes, _ = rows_layout(columns, index)
    offsets, _ = layout(sizes)
    for c, d, off, n in zip(columns, descs, offsets, sizes):
        if n:
            src = c.detach() if c.device.type == "cpu" else c.detach().cpu()
            torch.index_select(src, 0, index, out=_view(seg.base, off, n, d))
    return ShmRef(seg.path, offsets, sizes), descs


def segments_view(ref: ShmRef) -> torch.Tensor:
    """uint8 view of what ``ref`` points at, through this process's kept mapping of the file."""
    return _MAPS.view(ref.path, ref.extent)


def _own(owner, offset: int, desc: tuple) -> torch.Tensor:
    """The tensor ``desc`` at byte ``offset`` of ``owner`` (a numpy uint8 array over an arena or mapping):
    sharing its memory, but neither a view nor on a shared storage.

    Views of one tensor share autograd's version counter, so an in-place update of one buffer
    (BatchNorm's running statistics in the forward) would look like a change of every weight
    saved for backward; and tensors on one storage save together (``torch.save`` writes the whole
    storage, and refuses tensors of different dtypes on it). Each gets a storage of its own over
    exactly its bytes (:func:`~.segments.tensor_at`).
    """
    return segments.tensor_at(owner, offset, getattr(torch, desc[0]), desc[1])


#: Above this many bytes a segment is read with ``pread`` into the arena, not through this process's kept mapping.
#: A mapping stays for the next cell (a small model's warm cell reuses it), and every page of it counts in the
#: rank's resident memory while mapped: a 1 GiB model sent under ddp held 1 GiB more on each rank than torchrun's
#: (1.46x, issue 34), and its pages stayed alive after the kernel let the segment go.
MAPPED_READ_BYTES = 64 << 20


def _read_file(ref: ShmRef, dst: torch.Tensor) -> None:
    """Copy each tensor of ``ref``'s segment into ``dst`` (uint8, its layout) with ``os.preadv``: nothing stays mapped."""
    fd = os.open(ref.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(dst.numpy())
        for off, n in zip(ref.offsets, ref.sizes):
            done = 0
            while done < n:
                got = os.preadv(fd, [view[off + done:off + n]], off + done)
                if got <= 0:
                    raise OSError(f"{ref.path} ended at byte {off + done} of {off + n}: the kernel's segment was cut")
                done += got
    finally:
        os.close(fd)


def read_shm(ref: ShmRef, descs, mapped: bool = False) -> list:
    """The tensors in ``ref``'s segment: copied into an arena, or ``mapped`` copy-on-write (no copy).

    Each tensor lies in the arena (or mapping) but is a tensor of its own (:func:`_own`).
    """
    total = ref.extent
    if mapped:
        owner = segments.borrow(ref.path, total).numpy()
        return [_meta(d) if is_meta_desc(d) else _finish(_own(owner, off, d), d) for d, off in zip(descs, ref.offsets)]
    dst = _ARENAS.take(total)
    if total > MAPPED_READ_BYTES:
        _read_file(ref, dst)
    else:
        src = segments_view(ref)
        for off, n in zip(ref.offsets, ref.sizes):
            if n:
                dst[off:off + n].copy_(src[off:off + n])
    owner = dst.numpy()
    return [_meta(d) if is_meta_desc(d) else _finish(_own(owner, off, d), d) for d, off in zip(descs, ref.offsets)]


def _meta(desc):
    """The meta tensor ``desc`` describes (:func:`is_meta_desc`)."""
    return from_buffer(desc, b"")


def offer(outbox) -> None:
    """Rank side: kept for the calls' signature; the kernel no longer offers a segment of its own.

    The kernel used to offer a model-sized segment of its pool for rank 0 to write the trained state
    into, so that the kernel held the model twice after every cell. Now rank 0 writes into its own
    outbox and the kernel reads each tensor from there into its own (:mod:`distnb.transfer.weights_back`).
    """
    _SHM["offer"] = None


def probe_shm(path: str, token: str, owner_pid: int) -> bool:
    """Rank side: does the kernel's ``/dev/shm`` file ``path`` hold ``token``? Remembers the answer.

    True turns on the shared-memory path for what this rank sends back (:func:`distnb.engine.transport.stateout.flatten_state`).
    """
    try:
        with open(path) as f:
            ok = f.read() == token
    except OSError:
        ok = False
    _SHM.update(ok=ok and os.environ.get("DISTNB_SHM", "1") != "0", owner=owner_pid)
    return _SHM["ok"]


def drop_outstanding() -> None:
    """Rank side: give back this rank's outbox, mappings and idle arenas (the group is being left)."""
    pool = _SHM.pop("outbox", None)
    if pool is not None:
        pool.close()
    _SHM.pop("last", None)
    _SHM.pop("offer", None)
    _ARENAS.clear()
    _MAPS.prune()


def bind(ns: dict, name: str, payload: bytes, descs, *buffers) -> None:
    """Bind an object packed in the kernel to ``name`` in the engine namespace."""
    ns[name] = loads(payload, descs, buffers)


def lookup(ns: dict, name: str):
    """The engine's value of ``name``, packed by :func:`pack`; ``("missing", nearest names)`` if undefined.

    The kernel words the error (:func:`distnb.transfer.pulling.pull_value`): only it knows what the notebook holds.
    """
    if name not in ns:
        shown = [n for n in ns if isinstance(n, str) and not n.startswith("_")]
        return ("missing", difflib.get_close_matches(name, shown, n=3, cutoff=0.6))
    value = ns[name]
    try:
        return pack(value)
    except Exception as exc:
        if not isinstance(value, torch.nn.Module):
            raise
        # a model placed for training (fsdp, tensor: parameters bound to the process group) does not travel whole
        first = next((n for n, _ in value.named_parameters()), None)
        one = f"%dist pull {name}.{first}" if first else f"%dist pull {name}.PARAM"
        raise TypeError(f"{name} is a model placed on the ranks for training and cannot be sent whole as it is "
                        f"({type(exc).__name__}: {exc}): read one weight, gathered whole, with {one} (a state_dict "
                        f"name), or write every weight with %dist save DIR") from exc
