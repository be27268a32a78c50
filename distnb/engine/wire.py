"""The wire format for tensors between the kernel and the ranks.

A tensor travels as a small description ``(dtype, shape, requires_grad, is_param)``
plus its bytes. Objects that *contain* tensors (a model, a data set) travel as a pickle
whose tensors are replaced by persistent ids, with the tensor bytes alongside (see
:mod:`distnb.transfer` for the kernel side). The bytes go one of two ways:

- **Shared memory** (kernel and rank on one host): the sender writes every tensor's bytes
  once into one file under ``/dev/shm`` (a tmpfs: the pages are RAM, never a disk) and
  sends a small :class:`ShmRef` instead; receivers copy the bytes straight into their
  tensors with ``preadv`` (models), or map the file copy-on-write (data shards, which are
  read, not written: no copy at all). The file is unlinked as soon as every receiver has
  its copy or mapping, and on any failure; a mapping keeps its pages alive after the
  unlink. Whether a rank shares ``/dev/shm`` with the kernel is probed once per cluster
  (:func:`probe_shm`); ``DISTNB_SHM=0`` turns the path off. On one host this moves a
  400 MB model at several GB/s, against about 250 MiB/s per engine through ipyparallel.
- **ipyparallel buffers** (a rank on another host, or no usable ``/dev/shm``): one flat
  ``uint8`` numpy array per tensor, which ipyparallel sends as a zero-copy message
  frame (no pickling of tensor data).

Files are named ``distnb-<kernel pid>-...`` so that whatever a crash leaves behind can be
swept: by the kernel when it stops its cluster and by the reaper when the kernel dies
(:func:`sweep_shm`).
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
import warnings

import torch

#: Where same-host transfers put their files: a tmpfs (``DISTNB_SHM_DIR`` overrides).
SHM_DIR = os.environ.get("DISTNB_SHM_DIR", "/dev/shm")
#: Byte alignment of each tensor in a shared-memory file (any dtype can be viewed there).
_ALIGN = 64
#: Bytes per read/write call in a shared-memory transfer, and the threads that share big ones.
_CHUNK = 8 << 20
_IO_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Rank side: set by :func:`probe_shm` when the kernel's ``/dev/shm`` is visible here.
_SHM = {"ok": False, "owner": None, "outstanding": []}


def describe(t: torch.Tensor) -> tuple:
    """The description of a tensor: (dtype name, shape tuple, requires_grad, is_param)."""
    return (str(t.dtype).removeprefix("torch."), tuple(t.shape), bool(t.requires_grad),
            isinstance(t, torch.nn.Parameter))


def to_buffer(t: torch.Tensor):
    """A flat uint8 numpy view of ``t``'s bytes (a copy only if t is on a GPU or not contiguous)."""
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only zmq buffers
        raw = torch.frombuffer(buf, dtype=torch.uint8) if len(memoryview(buf).cast("B")) else torch.empty(0, dtype=torch.uint8)
    if copy:
        raw = raw.clone()
    return _finish(raw.view(dtype).reshape(shape), desc)


def pack(obj):
    """Pickle ``obj`` with cloudpickle, its tensors cut out as zero-copy buffers.

    Classes and functions defined in a notebook (``__main__``) travel by value. Used in
    both directions: kernel to ranks (push, models) and ranks to kernel (pull).

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
        def __init__(self, file):
            super().__init__(file, protocol=5)
            self.tensors, self._index = [], {}

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
    return _Unpickler(io.BytesIO(payload), receive(descs, buffers)).load()


def flatten_state(state: dict):
    """Pack a state_dict for one message: (keys, descriptions, byte sizes, bytes).

    ``bytes`` is a :class:`ShmRef` to a shared-memory file when this rank shares
    ``/dev/shm`` with the kernel (:func:`probe_shm`; the kernel reads it into its model and
    unlinks it), else one flat uint8 array.
    """
    import numpy as np

    keys = list(state)
    descs = [describe(state[k]) for k in keys]
    parts = [to_buffer(state[k]) for k in keys]
    if _SHM["ok"]:
        drop_outstanding()  # a previous state the kernel never read (its cell failed)
        try:
            ref = write_shm(parts, _SHM["owner"], f"r{os.environ.get('RANK', 'x')}")
        except OSError:  # /dev/shm full or gone: the message carries the bytes
            pass
        else:
            _SHM["outstanding"].append(ref.path)
            return keys, descs, [len(p) for p in parts], ref
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)
    return keys, descs, [len(p) for p in parts], flat


def unflatten_state(keys, descs, sizes, flat) -> dict:
    """Inverse of :func:`flatten_state`; the tensors are read-only views of ``flat``.

    For a :class:`ShmRef` the tensors are read from the file (the caller unlinks it).
    """
    if isinstance(flat, ShmRef):
        return dict(zip(keys, read_shm(flat, [d[:2] + (False, False) for d in descs])))
    out, offset = {}, 0
    for k, d, n in zip(keys, descs, sizes):
        out[k] = from_buffer(d[:2] + (False, False), flat[offset:offset + n], copy=False)
        offset += n
    return out


# shared memory -------------------------------------------------------------------------------

class ShmRef:
    """Where tensors' bytes lie in one shared-memory file: what travels instead of the bytes.

    Attributes
    ----------
    path : str
        The file (under :data:`SHM_DIR`).
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

    def unlink(self) -> None:
        """Remove the file (mappings of it stay valid); no error if it is gone already."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self):
        return f"ShmRef({self.path!r}, {len(self.sizes)} tensors, {self.nbytes} bytes)"


def shm_path(owner_pid: int, tag: str) -> str:
    """A fresh file name ``SHM_DIR/distnb-<owner_pid>-<tag>-<random>``."""
    return os.path.join(SHM_DIR, f"distnb-{int(owner_pid)}-{tag}-{uuid.uuid4().hex}")


def _layout(sizes) -> tuple:
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // _ALIGN) * _ALIGN
    return offsets, max(end, 1)


def _create(path: str, total: int) -> int:
    """Create ``path`` (owner-only) with ``total`` bytes of tmpfs pages reserved; returns the fd.

    The pages are allocated up front (``posix_fallocate``): a full ``/dev/shm`` is an OSError
    here, never a SIGBUS later when a mapping touches a page that cannot be backed.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, total)
        else:  # pragma: no cover - not Linux
            os.ftruncate(fd, total)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def _as_bytes(t: torch.Tensor):
    """A writable memoryview of a contiguous CPU tensor's bytes (any dtype)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _io(fd: int, jobs, write: bool) -> None:
    """``pwrite`` (``write``) or ``preadv`` each ``(writable memoryview, file offset)`` of ``jobs`` in full.

    The bytes go in pieces of :data:`_CHUNK`, spread over up to :data:`_IO_THREADS` threads
    for big transfers (the calls release the GIL; on a tmpfs they are memory copies).
    """
    pieces = [(view[a:a + _CHUNK], off + a) for view, off in jobs for a in range(0, len(view), _CHUNK)]

    def one(piece):
        view, off = piece
        while len(view):
            done = os.pwrite(fd, view, off) if write else os.preadv(fd, [view], off)
            if done <= 0:
                raise OSError(f"short {'write to' if write else 'read from'} shared memory at byte {off}")
            view, off = view[done:], off + done

    if _IO_THREADS < 2 or len(pieces) < 4:
        for piece in pieces:
            one(piece)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(_IO_THREADS, len(pieces)), thread_name_prefix="distnb-io") as pool:
        for _ in pool.map(one, pieces):
            pass


def write_shm(buffers, owner_pid: int, tag: str) -> ShmRef:
    """Write ``buffers`` (flat uint8 arrays, see :func:`to_buffer`) into one new shared-memory file.

    Raises OSError (nothing left behind) if the file cannot be created or filled.
    """
    views = [memoryview(b).cast("B") for b in buffers]
    sizes = [len(v) for v in views]
    offsets, total = _layout(sizes)
    path = shm_path(owner_pid, tag)
    fd = _create(path, total)
    try:
        _io(fd, list(zip(views, offsets)), write=True)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return ShmRef(path, offsets, sizes)


def write_shm_rows(columns, index, owner_pid: int, tag: str) -> tuple:
    """Write rows ``index`` of each column into one new shared-memory file.

    Rows are gathered a few MB at a time into one reused buffer and written from there:
    the kernel never holds a copy of the whole shard.

    Returns
    -------
    ref : ShmRef
    descs : list of tuple
        :func:`describe` of each gathered column (shape ``(len(index), ...)``).
    """
    index = torch.as_tensor(index, dtype=torch.long)
    shapes = [(len(index),) + tuple(c.shape[1:]) for c in columns]
    sizes = [int(torch.Size(s).numel()) * c.element_size() for s, c in zip(shapes, columns)]
    offsets, total = _layout(sizes)
    path = shm_path(owner_pid, tag)
    fd = _create(path, total)
    try:
        for c, shape, off, n in zip(columns, shapes, offsets, sizes):
            if n == 0:
                continue
            src = c.detach()
            if src.device.type != "cpu":
                src = src.cpu()
            row = n // len(index)
            rows = max(1, _CHUNK // max(1, row))
            tmp = torch.empty((min(rows, len(index)),) + tuple(shape[1:]), dtype=c.dtype)
            for a in range(0, len(index), rows):
                part = index[a:a + rows]
                dest = tmp[:len(part)]
                torch.index_select(src, 0, part, out=dest)
                _io(fd, [(_as_bytes(dest), off + a * row)], write=True)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    descs = [(str(c.dtype).removeprefix("torch."), s, False, False) for c, s in zip(columns, shapes)]
    return ShmRef(path, offsets, sizes), descs


def read_shm(ref: ShmRef, descs, mapped: bool = False) -> list:
    """The tensors in ``ref``'s file: fresh tensors read with ``preadv``, or ``mapped`` copy-on-write."""
    if mapped:
        total = _layout(ref.sizes)[1]
        base = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(ref.path, False, total))
        return [_finish(base[off:off + n].view(getattr(torch, d[0])).view(tuple(d[1])), d)
                for d, off, n in zip(descs, ref.offsets, ref.sizes)]
    out = [torch.empty(tuple(d[1]), dtype=getattr(torch, d[0])) for d in descs]
    fd = os.open(ref.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        read_into(fd, [(t, off, n) for t, off, n in zip(out, ref.offsets, ref.sizes)])
    finally:
        os.close(fd)
    return [_finish(t, d) for t, d in zip(out, descs)]


def read_into(fd: int, targets) -> None:
    """Fill contiguous CPU tensors from ``fd``: ``targets`` is a list of (tensor, file offset, bytes)."""
    jobs = []
    for t, offset, nbytes in targets:
        view = _as_bytes(t) if nbytes else memoryview(b"")
        if len(view) != nbytes:
            raise ValueError(f"a tensor of {len(view)} bytes cannot take the {nbytes} bytes sent")
        jobs.append((view, offset))
    _io(fd, jobs, write=False)


def probe_shm(path: str, token: str, owner_pid: int) -> bool:
    """Rank side: does the kernel's ``/dev/shm`` file ``path`` hold ``token``? Remembers the answer.

    True turns on the shared-memory path for what this rank sends back (:func:`flatten_state`).
    """
    try:
        with open(path) as f:
            ok = f.read() == token
    except OSError:
        ok = False
    _SHM.update(ok=ok and os.environ.get("DISTNB_SHM", "1") != "0", owner=owner_pid)
    return _SHM["ok"]


def drop_outstanding() -> None:
    """Rank side: unlink the state files this rank wrote that the kernel never collected."""
    while _SHM["outstanding"]:
        try:
            os.unlink(_SHM["outstanding"].pop())
        except OSError:
            pass


def sweep_shm(owner_pid: int) -> int:
    """Remove every ``distnb-<owner_pid>-*`` file in :data:`SHM_DIR`; returns how many."""
    prefix = f"distnb-{int(owner_pid)}-"
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


def bind(ns: dict, name: str, payload: bytes, descs, *buffers) -> None:
    """Bind an object packed in the kernel to ``name`` in the engine namespace."""
    ns[name] = loads(payload, descs, buffers)


def lookup(ns: dict, name: str):
    """The engine's value of ``name``, packed by :func:`pack`; NameError naming the rank if undefined."""
    if name not in ns:
        rank = ns.get("rank")
        raise NameError(f"name {name!r} is not defined on rank {rank}; push it with %dist push {name} "
                        "or define it in a %%dist cell")
    return pack(ns[name])
