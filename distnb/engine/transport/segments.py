"""Shared-memory segments reused between transfers, and the memory a rank receives models into.

On one host a transfer is memory copies, and what decides their speed is whether the
destination pages were touched before: on a 2-core machine of this kind a copy into touched
memory runs at about 10 GB/s, into fresh memory at about 1.9 GB/s (page faults; see
``shared/FIELD-NOTES.md``). A transfer that made a new ``/dev/shm`` file and new tensors each
time paid the first touch on both sides. Here every piece of memory a transfer writes is
kept and written again by the next one:

- **Writer pools** (:class:`Pool`): the kernel (models, objects, data shards) and each rank
  (weights back) keep their files under :data:`SHM_DIR`, each mapped
  once (``MAP_SHARED``), and reuse them; the tmpfs pages stay allocated between transfers.
- **Reader mappings** (:class:`Maps`): a reader keeps its mapping of each writer file, so a
  file written again is read through pages already mapped.
- **Receive arenas** (:class:`Arenas`): a rank copies a model into memory a previous model
  used and no longer does (known from a ``weakref.finalize`` on the object every tensor of one
  transfer keeps alive), so a model sent again lands in touched pages: one copy, at the warm rate.
- **Resident segments** (:meth:`Pool.keep`): a kernel segment that notebook tensors now live in
  (:mod:`distnb.transfer.resident`), so that sending them again copies nothing in the kernel; a rank
  gathers its data shard's rows out of such a segment into an arena, and writes the state it
  sends back into one the kernel offered. Never handed out while a tensor lives on it.
- **Lent segments**: where the kernel writes a shard's rows itself (a column on a GPU), the shard
  is a copy-on-write view (``MAP_PRIVATE``) of the kernel's file, no copy on the rank. Unwritten
  pages of such a view follow the file, so the kernel reuses the file only once no rank maps it
  any more (:func:`held_segments`, asked over ipyparallel).

The cost is memory that stays allocated: the pools keep up to :data:`IDLE_BYTES` of unused
files, and a rank up to :data:`IDLE_BYTES` of unused arena, and none of it while the machine has
less than a quarter of its memory available (many ranks on one host); all of it is freed when
the cluster stops (:meth:`Pool.close`, :func:`sweep_shm`).
"""

from __future__ import annotations

import errno
import mmap
import os
import uuid
import warnings
import weakref

import torch

#: Where same-host transfers put their files: a tmpfs (``DISTNB_SHM_DIR`` overrides).
SHM_DIR = os.environ.get("DISTNB_SHM_DIR", "/dev/shm")
#: Unused bytes a pool (or a rank's arenas) keeps for the next transfer; more is given back.
IDLE_BYTES = int(os.environ.get("DISTNB_SHM_IDLE_BYTES", 2 << 30))
#: Bytes of ``SHM_DIR`` distnb leaves free for others (``DISTNB_SHM_HEADROOM``): NCCL's shared-memory
#: transport makes its segments there (about 10 MB per peer and channel set), and Docker's default
#: ``/dev/shm`` is 64 MB ("failed to extend /dev/shm/nccl-...", NVIDIA/nccl#290). A transfer that
#: would leave less uses ipyparallel's messages instead, and idle segments are given back.
HEADROOM = int(os.environ.get("DISTNB_SHM_HEADROOM", 256 << 20))
#: Mappings are made with their page tables filled at once (``MAP_POPULATE``): one call instead of a
#: page fault per 4 KiB page on first use, which costs several times the copy on a busy machine.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: Segment sizes are rounded up to this (so a data set or model that grows a little still fits).
GRAIN = 1 << 20


def shm_path(owner_pid: int, tag: str) -> str:
    """A fresh file name ``SHM_DIR/distnb-<owner_pid>-<tag>-<random>``."""
    return os.path.join(SHM_DIR, f"distnb-{int(owner_pid)}-{tag}-{uuid.uuid4().hex}")


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


def _plenty() -> bool:
    """May memory stay allocated unused? Only while the machine has over a quarter of its memory
    available (``/proc/meminfo``), so that many ranks on one host never crowd it."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith("Mem")}
        return info["MemAvailable"] > info["MemTotal"] // 4
    except (OSError, KeyError, ValueError, IndexError):
        return True


def shm_room(path: str | None = None) -> int | None:
    """Free bytes in ``path`` (default :data:`SHM_DIR`), None when it cannot be read."""
    try:
        st = os.statvfs(path or SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _check_room(size: int) -> None:
    """Raise OSError (ENOSPC) when a new ``size``-byte segment would leave less than :data:`HEADROOM` free."""
    room = shm_room()
    if room is not None and room - size < HEADROOM:
        raise OSError(errno.ENOSPC, f"{SHM_DIR} has {room >> 20} MiB free: a {size >> 20} MiB segment would "
                      f"leave less than the {HEADROOM >> 20} MiB kept for NCCL and others (DISTNB_SHM_HEADROOM); "
                      "give the container more (docker run --shm-size=2g)")


def _round(nbytes: int) -> int:
    return max(GRAIN, -(-int(nbytes) // GRAIN) * GRAIN)


def _uint8(mm) -> torch.Tensor:
    return torch.frombuffer(mm, dtype=torch.uint8) if len(mm) else torch.empty(0, dtype=torch.uint8)


class Segment:
    """One file in shared memory, mapped ``MAP_SHARED`` by the process that writes it.

    Attributes
    ----------
    path : str
    size : int
        Bytes (a multiple of 1 MiB), all allocated when the segment is made, unless ``sparse``.
    base : torch.Tensor
        uint8, shape ``(size,)``: the mapping, to copy into.

    ``sparse=True`` allocates pages only as they are written (no ``fallocate``, no ``MAP_POPULATE``),
    after checking that ``/dev/shm`` has room for all of them: a model moved into the segment tensor
    by tensor (:func:`distnb.transfer.resident.write_adopting`) then frees its old memory as the new fills, and
    the kernel never holds it twice.
    """

    __slots__ = ("path", "size", "_mm", "base")

    def __init__(self, path: str, size: int, sparse: bool = False):
        if sparse:
            st = os.statvfs(os.path.dirname(path))
            if st.f_bavail * st.f_frsize < size:
                raise OSError(28, f"no room in {os.path.dirname(path)} for {size} bytes")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            if hasattr(os, "posix_fallocate") and not sparse:  # a full /dev/shm is an OSError here, not a SIGBUS
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (0 if sparse else _POPULATE))
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.path, self.size = path, size
        self.base = _uint8(self._mm)

    def close(self, unmap: bool = True) -> None:
        """Unlink, and unmap unless ``unmap`` is False: tensors live on the mapping (``torch.frombuffer``
        holds a reference to it but no buffer export, so unmapping would pull the memory from under
        them); it then goes when the last of them does."""
        self.base = None
        if unmap:
            try:
                self._mm.close()
            except BufferError:  # a memoryview is alive: the mapping goes with it
                pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


#: Memory a pool kept for tensors (:meth:`Pool.keep`), path -> (address, bytes), until those tensors are
#: gone: also after the pool closed (the cluster stopped) and another one took its place.
_KEPT: dict[str, tuple] = {}


class Pool:
    """Segments one process writes into, reused from transfer to transfer.

    A segment is *busy* while a transfer writes or readers copy from it, *lent* while readers
    may still map it copy-on-write (data shards), and free otherwise.

    Parameters
    ----------
    owner_pid : int
        The kernel's pid: every file is ``distnb-<owner_pid>-<tag>-...`` so that a crash's
        leftovers are swept with the kernel's (:func:`sweep_shm`).
    tag : str
        ``"k"`` for the kernel, ``"r<rank>"`` for a rank.
    """

    def __init__(self, owner_pid: int, tag: str):
        self.owner_pid, self.tag = int(owner_pid), tag
        self.free: list[Segment] = []
        self.lent: dict[str, Segment] = {}
        self.busy: dict[str, Segment] = {}
        self.resident: dict[str, Segment] = {}

    def acquire(self, nbytes: int, avoid: str | None = None, sparse: bool = False) -> Segment:
        """A free segment of at least ``nbytes`` (the smallest that fits), else a new one.

        A segment more than twice the size asked for is not taken (a shard would otherwise keep
        a model's segment lent, and the next model send would make a new one).

        ``sparse``: a new segment's pages are allocated as they are written (:class:`Segment`).
        ``avoid``: a path not to hand out now (a rank's last weights, which the kernel may
        still be reading). A free segment whose file is gone is dropped (the kernel sweeps every
        file of its pid when it stops a cluster, which can be another one than the ranks' own).
        Raises OSError when ``/dev/shm`` has no room, or a new segment would leave it less than
        :data:`HEADROOM` free.
        """
        for gone in [s for s in self.free if not os.path.exists(s.path)]:  # swept: another session stopped
            self.free.remove(gone)
            gone.close()
        fits = [s for s in self.free if nbytes <= s.size <= 2 * nbytes + GRAIN and s.path != avoid]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self.free.remove(seg)
        else:
            _check_room(_round(nbytes))  # NCCL needs room there too: the transfer then goes as messages
            seg = Segment(shm_path(self.owner_pid, self.tag), _round(nbytes), sparse=sparse)
        self.busy[seg.path] = seg
        return seg

    def release(self, seg: Segment, lent: bool = False) -> None:
        """The transfer over ``seg`` ended: free it, or ``lent`` until readers drop their views."""
        self.busy.pop(seg.path, None)
        if lent:
            self.lent[seg.path] = seg
        else:
            self.free.append(seg)
            self.trim()

    def keep(self, seg: Segment):
        """``seg`` becomes the memory of tensors that the caller re-points into it (it is *resident*).

        Returns a numpy uint8 array over the whole segment: tensors made on it (:func:`tensor_at`)
        keep the segment resident, never handed out again, until every one of them is gone; then
        it is given back (unlinked and unmapped): a deleted model's memory leaves with it, not kept idle.
        """
        self.busy.pop(seg.path, None)
        self.resident[seg.path] = seg
        owner = seg.base.numpy()  # a new ndarray per keep: it lives as long as the tensors made on it
        _KEPT[seg.path] = (seg.base.data_ptr(), seg.size)
        weakref.finalize(owner, self._unkeep, seg.path)
        return owner

    def _unkeep(self, path: str) -> None:
        _KEPT.pop(path, None)
        seg = self.resident.pop(path, None)
        if seg is not None and seg.base is not None:  # the tensors' memory goes with them (the kernel stays flat)
            seg.close()

    def holding(self, address: int, nbytes: int):
        """``(segment, offset)`` of the resident segment whose mapping holds bytes ``[address, address +
        nbytes)``, or None (also when its file was swept: readers could not open it)."""
        for seg in self.resident.values():
            start = seg.base.data_ptr()
            if start <= address and address + nbytes <= start + seg.size:
                return (seg, address - start) if os.path.exists(seg.path) else None
        return None

    def ours(self, address: int, nbytes: int) -> bool:
        """Do bytes ``[address, address + nbytes)`` lie in memory a pool of this process kept (:meth:`keep`), resident
        now or closed since (its mapping lives on while tensors use it)?"""
        return any(start <= address and address + nbytes <= start + size for start, size in _KEPT.values())

    def returned(self, still_held) -> None:
        """Lent segments whose paths are not in ``still_held`` (a set of paths) are free again."""
        for path in list(self.lent):
            if path not in still_held:
                self.free.append(self.lent.pop(path))
        self.trim()

    def trim(self) -> None:
        """Give back free segments beyond :data:`IDLE_BYTES` (the largest kept first), or all when
        the machine is short of memory."""
        self.free.sort(key=lambda s: s.size, reverse=True)
        kept, total = [], 0
        plenty = _plenty() if self.free else True
        room = shm_room() if self.free else None  # idle segments never eat into the headroom
        budget = IDLE_BYTES if room is None else min(IDLE_BYTES, room + sum(s.size for s in self.free) - HEADROOM)
        for seg in self.free:
            if plenty and total + seg.size <= budget:
                kept.append(seg)
                total += seg.size
            else:
                seg.close()
        self.free = kept

    def close(self) -> None:
        """Unlink every segment of the pool (busy and lent ones too: mappings keep their pages)."""
        for seg in [*self.free, *self.lent.values(), *self.busy.values()]:
            seg.close()
        for seg in self.resident.values():
            seg.close(unmap=False)  # its mapping stays while the tensors on it do
        self.free, self.lent, self.busy, self.resident = [], {}, {}, {}


def tensor_at(owner, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` on the bytes at ``offset`` of ``owner`` (a numpy uint8 array), with a
    storage of its own: exactly its bytes, so that ``torch.save`` of it writes those (not the whole segment)
    and tensors of other dtypes beside it save too. The storage keeps ``owner`` alive."""
    numel = 1
    for n in shape:
        numel *= int(n)
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only owner (a reader's mapping)
        return torch.frombuffer(owner, dtype=dtype, count=numel, offset=offset).view(tuple(shape))


class Maps:
    """A reader's ``MAP_SHARED`` mappings of other processes' segments, kept while the files exist."""

    def __init__(self):
        self._maps: dict[str, tuple] = {}

    def view(self, path: str, nbytes: int, writable: bool = False) -> torch.Tensor:
        """uint8 tensor over the first ``nbytes`` of ``path`` (read it, or write it if ``writable``;
        do not keep it). One :class:`Maps` maps every file one way: keep writers apart."""
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            known = self._maps.get(path)
            if known is None or known[0] != st.st_ino or len(known[1]) < nbytes:
                self.drop(path)
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | _POPULATE, prot=prot) if st.st_size else b""
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # torch.frombuffer of a read-only mapping
                    known = (st.st_ino, mm, _uint8(mm))
                self._maps[path] = known
        finally:
            os.close(fd)
        self.prune()
        return known[2][:nbytes]

    def drop(self, path: str) -> None:
        known = self._maps.pop(path, None)
        if known is not None and isinstance(known[1], mmap.mmap):
            try:
                known[1].close()
            except BufferError:
                pass

    def prune(self) -> None:
        """Forget mappings of files that are gone (their writer trimmed or stopped)."""
        for path in [p for p in self._maps if not os.path.exists(p)]:
            self.drop(path)


#: Rank side: paths mapped copy-on-write (data shards) -> live views' count.
_HELD: dict[str, int] = {}


def _unhold(path: str) -> None:
    _HELD[path] = _HELD.get(path, 1) - 1
    if _HELD[path] <= 0:
        _HELD.pop(path, None)


def borrow(path: str, nbytes: int) -> torch.Tensor:
    """uint8 copy-on-write view (``MAP_PRIVATE``) of ``path``'s first ``nbytes``: no copy.

    Writes go to this process's own pages. The path counts as held (:func:`held_segments`) until
    every tensor viewing the mapping is gone.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    _HELD[path] = _HELD.get(path, 0) + 1
    weakref.finalize(mm, _unhold, path)
    return _uint8(mm)


def held_segments(owner_pid: int) -> list:
    """Rank side: the paths of ``owner_pid``'s segments this rank still maps copy-on-write."""
    prefix = f"distnb-{int(owner_pid)}-"
    return sorted(p for p in _HELD if os.path.basename(p).startswith(prefix))


class Arenas:
    """A rank's memory for received models: given back when a model is gone, reused by the next.

    :meth:`take` returns a writable uint8 tensor; when every tensor viewing it is gone the
    memory returns to the idle list (up to :data:`IDLE_BYTES`), and a later :meth:`take` that
    fits reuses it: its pages were touched by the model before.
    """

    def __init__(self):
        self.idle: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        fits = [a for a in self.idle if nbytes <= a.numel() <= 2 * nbytes + GRAIN]
        if fits:
            arena = min(fits, key=lambda a: a.numel())
            self.idle.remove(arena)
        else:
            arena = torch.empty(_round(nbytes), dtype=torch.uint8)
        owner = arena.numpy()[:nbytes]  # a new ndarray per transfer: it lives as long as its tensors
        weakref.finalize(owner, self._give_back, arena)
        return torch.from_numpy(owner) if nbytes else torch.empty(0, dtype=torch.uint8)

    def _give_back(self, arena: torch.Tensor) -> None:
        self.idle.append(arena)
        self.idle.sort(key=lambda a: a.numel(), reverse=True)
        kept, total = [], 0
        plenty = _plenty()
        for a in self.idle:
            if plenty and total + a.numel() <= IDLE_BYTES:
                kept.append(a)
                total += a.numel()
        self.idle = kept

    def clear(self) -> None:
        self.idle = []
