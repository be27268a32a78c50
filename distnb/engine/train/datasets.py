"""Data sets loaded on the ranks: a torch ``Dataset`` indexed here through a ``DataLoader``.

The tensor fast path (:class:`distnb.engine.train.shards.Shard`) holds columns the kernel shipped.
This module is the other path: the kernel sends a ``Dataset`` *by value* (its class and
attributes: file paths, a transform; never its samples), or a function ``make(rank,
world_size)`` that builds one here, or names a Dataset a ``%%dist`` cell made on the ranks;
each rank then loads its own samples with ``__getitem__`` every epoch, so random
augmentation differs per epoch and per rank.

- **Map-style** (``kind="dataset"``: the whole set on every rank): this rank visits the
  indices :func:`distnb.engine.transport.shard.assign` deals it, in the per-epoch order of
  :func:`~distnb.engine.transport.shard.epoch_order`, padded or cut exactly as the tensor path is, so
  both paths cut the same data the same way (the parity test holds them to the same
  weights). That is ``DistributedSampler``'s contract (disjoint, covering, equal length,
  reshuffled per epoch with the seed), with shards assigned once as on the tensor path.
- **This rank's part** (``kind="part"``, from ``make(rank, world_size)``): the rank visits
  all of its part, reshuffled per epoch; every part must have the same length.
- **Streams** (``kind="stream"``, an ``IterableDataset``): sample ``i`` of the stream goes
  to part ``i % (num_shards * workers)`` (rank-major: part ``index * workers + worker id``),
  or to the dataset's own ``iter_part(part, num_parts)`` when it defines one; no sample is
  read twice. ``--steps-per-epoch N`` fixes the steps, and in any case the ranks agree every
  step (one tiny all-reduce) on whether each still has a batch, so the first stream to end
  ends the epoch on every rank: never a hang.

Randomness is reproducible: before the first sample of an epoch, the process that loads it
(the rank itself, or each DataLoader worker) seeds ``torch``, ``random`` and ``numpy`` from
``(--seed, epoch, data shard, worker id)``; the data shard is the rank under data parallelism,
and the ranks that share one (a tensor-parallel group, every rank of ``tensor`` or
``pipeline``) draw the same random augmentations, as they must train on the same batches. With
``--workers 0`` that seeds the rank's own generators, as the tensor path does (:func:`seed_epoch`);
with ``--workers N`` the rank seeds its own the same way too (the forward's dropout draws there).
``--workers N`` loads in N DataLoader worker processes (forked, ``pin_memory`` on GPU ranks,
``persistent_workers`` between the epochs of one cell, ``--prefetch-factor``); they are ended
when the cell ends, however it ends (:meth:`Source.close`). A sample that raises, samples that
cannot be batched, a worker that dies and a full ``/dev/shm`` are errors naming the rank, the
sample indices and the fix.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import sys
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info

from distnb.core.errors import ranks_named
from distnb.engine.process import binding, runtime
from distnb.engine.process.collectives import group_device
from distnb.engine.transport import shard as sharding
from distnb.engine.transport import wire

#: Data sets this rank holds for training, by name (the tensor path's are ``shards.SHARDS``).
SOURCES: dict = {}
#: Kinds of :class:`Source`: the whole map-style set, this rank's part of it, a stream.
KINDS = ("dataset", "part", "stream")


class SampleError(RuntimeError):
    """A sample could not be loaded or batched on a rank (the message names rank, indices and fix)."""


def seed_all(*keys: int) -> int:
    """Seed ``torch``, ``random`` and (if loaded) ``numpy`` of this process from ``keys``; returns the seed."""
    value = sharding.mix(*keys)
    torch.manual_seed(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % 2**32)
    return value


def seed_epoch(seed: int, epoch: int, stream: int) -> int:
    """Seed this process's generators for ``epoch`` (:func:`seed_all` of ``(seed, epoch, stream, worker id + 1)``).

    ``stream`` is the data shard: ranks that train on the same batches share it. Called before an
    epoch's first sample by the process that loads it: a DataLoader worker (worker key ``id + 1``),
    or the rank itself (key 0), which is also where the tensor path (``shards.Shard``) seeds, so tensors
    and the same data as a Dataset with ``--workers 0`` draw the same random numbers (dropout included).
    """
    return seed_all(seed, epoch, stream, _worker_id() + 1)


def _worker_id() -> int:
    info = get_worker_info()
    return -1 if info is None else info.id


def _identity(batch):
    return batch


def _count(batch) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 if it holds none)."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = _count(item)
        if n:
            return n
    return 1


def to_device(batch, device):
    """``batch`` (tensors in tuples, lists and dicts) on ``device`` (non-blocking from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def describe_sample(sample) -> str:
    """A sample's structure in words: ``(float32[3, 32, 32], int)`` (dtype and shape of arrays, else the type)."""
    if isinstance(sample, torch.Tensor):
        return f"{str(sample.dtype).removeprefix('torch.')}{list(sample.shape)}"
    if hasattr(sample, "shape") and hasattr(sample, "dtype"):
        return f"{sample.dtype}{list(sample.shape)}"
    if isinstance(sample, (tuple, list)):
        return "(" + ", ".join(describe_sample(s) for s in sample) + ")"
    if isinstance(sample, dict):
        return "{" + ", ".join(f"{k!r}: {describe_sample(v)}" for k, v in sample.items()) + "}"
    return type(sample).__name__


class Batcher:
    """Turns a list of samples into a batch: ``--collate NAME`` or ``default_collate``, errors explained."""

    def __init__(self, name, rank, collate=None, collate_name=None):
        self.name, self.rank, self.collate, self.collate_name = name, rank, collate, collate_name

    def __call__(self, samples, where):
        try:
            return (self.collate or default_collate)(samples)
        except Exception as exc:
            if any(w in str(exc) for w in _SHM_FULL):  # in a worker the batch is made in /dev/shm: see explain()
                raise
            if self.collate is not None:
                raise SampleError(f"rank {self.rank}: --collate {self.collate_name} raised {type(exc).__name__}: "
                                  f"{exc} on {where} of {self.name}; fix the collate function") from exc
            shapes = sorted({describe_sample(s) for s in samples})
            raise SampleError(
                f"rank {self.rank}: {where} of {self.name} cannot be batched by torch's default_collate "
                f"({type(exc).__name__}: {exc}); the samples are {' and '.join(shapes[:4])}. Give samples of one "
                "shape, or pass --collate NAME: a notebook function list of samples -> batch (padding them, "
                "for example)") from exc


class _Indexed(Dataset):
    """What the DataLoader indexes: a batch key ``(epoch, indices)`` -> the collated batch.

    The batch is built here (in the worker when there are workers), where the indices are
    known, so a failing sample is named by its index; the loader's own collate is the identity.
    """

    def __init__(self, dataset, name, rank, seed, batcher, stream=None):
        self.dataset, self.name, self.rank, self.seed, self.batcher = dataset, name, rank, seed, batcher
        self.stream = rank if stream is None else stream  # seeds the random streams (see Source.stream)
        self.epoch = None

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, key):
        epoch, indices = key
        if epoch != self.epoch:  # the epoch's first batch in this process: its random streams start here
            self.epoch = epoch
            seed_epoch(self.seed, epoch, self.stream)
            if callable(getattr(self.dataset, "set_epoch", None)):
                self.dataset.set_epoch(epoch)
        samples = []
        for i in indices:
            try:
                samples.append(self.dataset[i])
            except Exception as exc:
                raise SampleError(
                    f"rank {self.rank}: {self.name}[{i}] raised {type(exc).__name__}: {exc}. Fix the Dataset's "
                    f"__getitem__ for index {i} (try `{self.name}[{i}]` in a %%dist cell); the next cell "
                    "works as usual") from exc
        return self.batcher(samples, f"samples {_few(indices)}")

    def __getitem__(self, i):  # the DataLoader always calls __getitems__ with a batch key
        return self.__getitems__((self.epoch, [i]))


def _few(indices) -> str:
    shown = ", ".join(map(str, indices[:8]))
    return f"[{shown}{', ...' if len(indices) > 8 else ''}]"


class _Split(IterableDataset):
    """A stream cut into ``num_shards * workers`` disjoint parts; this process reads its part."""

    def __init__(self, dataset, name, index, num_shards, rank, seed, first_epoch, batcher, batch_size, drop_last,
                 stream=None):
        self.dataset, self.name, self.index, self.num_shards = dataset, name, index, num_shards
        self.rank, self.seed, self.epoch, self.batcher = rank, seed, first_epoch - 1, batcher
        self.stream = rank if stream is None else stream  # seeds the random streams (see Source.stream)
        self.batch_size, self.drop_last = batch_size, drop_last

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self.epoch += 1  # each iteration of this copy (one per epoch, in this process) is the next epoch
        seed_epoch(self.seed, self.epoch, self.stream)
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(self.epoch)
        part, parts = self.index * workers + worker, self.num_shards * workers
        hook = getattr(self.dataset, "iter_part", None)
        read = [0]  # samples the stream gave so far (all parts'): the one that raised is the next
        samples = hook(part, parts) if callable(hook) else \
            itertools.islice(_counted(iter(self.dataset), read), part, None, parts)
        batch, first = [], part
        for n in itertools.count():
            try:
                sample = next(samples)
            except StopIteration:
                break
            except Exception as exc:
                where = f"sample {read[0]}" if not callable(hook) else f"sample {n} of part {part}"
                raise SampleError(f"rank {self.rank}: the stream {self.name} raised {type(exc).__name__}: {exc} "
                                  f"at {where}; fix the IterableDataset's __iter__") from exc
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield self.batcher(batch, f"stream samples from {first}")
                batch, first = [], part + (n + 1) * parts
        if batch and not self.drop_last:
            yield self.batcher(batch, f"stream samples from {first}")


def _counted(samples, read: list):
    """``samples``, counting in ``read[0]`` those it gave (a stream's position, for the error naming the sample)."""
    for sample in samples:
        read[0] += 1
        yield sample


class Source:
    """This rank's view of a data set loaded on the ranks (the counterpart of ``shards.Shard``).

    Parameters
    ----------
    name : str
        The data set's name (``--data``), for messages.
    dataset : torch.utils.data.Dataset
        Map-style (``__len__``, ``__getitem__``) or an ``IterableDataset``.
    kind : {"dataset", "part", "stream"}
        See the module docstring.
    num_shards, index : int
        The data-parallel size the set is cut for and the shard this rank takes.
    ns : dict
        The engine namespace (``--collate`` names a function in it).
    """

    def __init__(self, name, dataset, kind, num_shards, index, ns):
        self.name, self.dataset, self.kind, self.ns = name, dataset, kind, ns
        self.num_shards, self.index = num_shards, index
        self.length = None if kind == "stream" else len(dataset)
        self.num_samples = None if kind == "stream" else self.length * (num_shards if kind == "part" else 1)
        self._loader = None
        self._assigned = None  # (seed, this rank's data-set indices) for kind "dataset"
        #: What seeds the random streams with the epoch and worker: this rank's data shard, so
        #: ranks that train on the same batches (a tensor-parallel group) draw the same samples.
        self.stream = index

    def steps_per_epoch(self, plan) -> int:
        """Steps every rank runs per epoch (for a stream: ``--steps-per-epoch``, 0 when unknown)."""
        if self.kind == "stream":
            return plan.steps_per_epoch or 0
        sharding.check_sizes(self.num_samples, self.num_shards, plan.batch_size, plan.drop_last)
        return sharding.steps_per_epoch(self.num_samples, self.num_shards, plan.batch_size, plan.drop_last)

    def epoch_length(self, plan):
        """Samples this rank visits per epoch (None for a stream)."""
        if self.kind == "stream":
            return None
        return sharding.samples_per_epoch(self.num_samples, self.num_shards, plan.drop_last)

    def indices(self, plan, epoch: int) -> torch.Tensor:
        """The data-set indices this rank visits in ``epoch``, in order (int64)."""
        order = sharding.epoch_order(self.num_samples, self.num_shards, self.index, plan.seed, epoch, plan.drop_last)
        if self.kind == "part":
            return order
        if self._assigned is None or self._assigned[0] != plan.seed:
            self._assigned = (plan.seed, sharding.assign(self.num_samples, self.num_shards, plan.seed)[self.index])
        return self._assigned[1][order]

    def epoch(self, plan, epoch: int, skip: int, device, batches=None):
        """Yield ``(samples, batch)`` for each step of ``epoch``, ``skip`` samples in; batches on ``device``.

        ``batches``: the data-set indices of each batch instead (the rest of an epoch, engine/epochrest.py).
        """
        if self.kind == "stream":
            yield from self._stream(plan, epoch, device)
            return
        keys = [(epoch, idx.tolist()) for idx in (batches if batches is not None else sharding.batches(
            self.indices(plan, epoch)[skip:], plan.batch_size, plan.drop_last))]
        loader = self._loader_for(plan, device, epoch)
        loader.batch_sampler.keys = keys
        with _workers_share_cores():
            it = iter(loader)
        self._seed_rank(plan, epoch)
        for key in keys:
            batch = self._next(it, epoch, key[1])
            yield len(key[1]), (batch if device.type == "cpu" else to_device(batch, device))

    def _stream(self, plan, epoch, device):
        loader = self._loader_for(plan, device, epoch)
        with _workers_share_cores():
            it = iter(loader)
        self._seed_rank(plan, epoch)
        have = torch.ones(1, device=group_device())
        for step in itertools.count():
            if plan.steps_per_epoch is not None and step >= plan.steps_per_epoch:
                return
            batch = self._next(it, epoch, step, stream=True)
            mine = 0.0 if batch is None else 1.0  # (read from the tensor, it was a GPU sync a step)
            have.fill_(mine)
            dist.all_reduce(have, op=dist.ReduceOp.MIN)  # the first stream to end ends the epoch on every rank
            if not have.item():
                if step == 0:  # no step at all: it ended as a success with 0 steps and a nan loss
                    self._empty_stream(plan, epoch, mine)
                return
            yield _count(batch), (batch if device.type == "cpu" else to_device(batch, device))

    def _empty_stream(self, plan, epoch: int, mine: float) -> None:
        """Raise, on every rank, that the stream gave some ranks no batch in ``epoch`` (a collective)."""
        # on the group's device: nccl's group refuses a CPU tensor ("No backend type associated with device type cpu")
        flags = [torch.zeros(1, device=group_device()) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, torch.tensor([mine], dtype=torch.float32, device=group_device()))
        empty = [r for r, f in enumerate(flags) if not f.item()]
        which = "every rank" if len(empty) == len(flags) else ranks_named(empty)
        raise ValueError(f"the stream {plan.data} gave {which} no sample in epoch {epoch}, so no step could be "
                         "trained (the first stream to end ends the epoch on every rank). Every rank needs a batch "
                         "each epoch: check what make(rank, world_size) or iter_part finds for it; an __iter__ over a "
                         "generator or an open file is empty from its second pass: start over in __iter__")

    def _seed_rank(self, plan, epoch: int) -> None:
        """With ``--workers N``, seed this rank's own generators for ``epoch`` (its workers seed theirs).

        The forward and the step body run here, not in the workers: their random numbers (dropout)
        come from this process, seeded as with ``--workers 0`` (:func:`seed_epoch`, worker key 0),
        so the ranks of one data shard draw the same ones. With ``--workers 0`` the loader seeds it.
        """
        if plan.workers:
            seed_epoch(plan.seed, epoch, self.stream)

    def _next(self, it, epoch, what, stream=False):
        """The next batch of ``it`` (None at a stream's end); ``what``: its indices (a stream: its step)."""
        try:
            return next(it)
        except StopIteration:
            if stream:
                return None
            raise RuntimeError(f"rank {runtime.STATE.rank}: the DataLoader of {self.name} ended early "
                               f"(epoch {epoch}, before samples {_few(what)})") from None
        except SampleError as exc:
            if exc.__cause__ is not None:  # raised in this process (--workers 0): its cause holds the sample's frames
                raise
            # raised in a worker: the DataLoader re-raised it with the worker's traceback as text; that text
            # (the Dataset's own frames among it) becomes the cause of the SampleError, its message the message
            raise SampleError(_original_message(exc)) from WorkerTraceback(_worker_traceback(exc))
        except Exception as exc:
            where = f"step {what}" if stream else f"samples {_few(what)}"
            explain(exc, f"while loading {where} of {self.name} (epoch {epoch})")
            raise

    def _loader_for(self, plan, device, epoch):
        """The DataLoader of this cell (made at its first epoch; its workers live until :meth:`close`)."""
        if self._loader is not None:
            return self._loader
        rank = runtime.STATE.rank
        collate = None
        if plan.collate is not None:
            collate = self.ns.get(plan.collate)
            if not callable(collate):
                raise NameError(f"rank {rank}: --collate {plan.collate} is not a function on this rank")
        batcher = Batcher(self.name, rank, collate, plan.collate)
        workers = dict(num_workers=plan.workers, pin_memory=device.type == "cuda")
        if plan.workers:
            workers.update(persistent_workers=True, prefetch_factor=plan.prefetch_factor or 2,
                           multiprocessing_context="fork")
        with _workers_share_cores():
            self._loader = self._new_loader(plan, epoch, batcher, workers)
        return self._loader

    def _new_loader(self, plan, epoch, batcher, workers):
        rank = runtime.STATE.rank
        if self.kind == "stream":
            split = _Split(self.dataset, self.name, self.index, self.num_shards, rank, plan.seed, epoch, batcher,
                           plan.batch_size, plan.drop_last, stream=self.stream)
            return DataLoader(split, batch_size=None, **workers)
        return DataLoader(_Indexed(self.dataset, self.name, rank, plan.seed, batcher, stream=self.stream),
                          batch_sampler=_Keys(), collate_fn=_identity, **workers)

    def close(self) -> None:
        """End this cell's DataLoader workers (if any); the next cell makes a new loader."""
        loader, self._loader = self._loader, None
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        if loader is not None:
            loader._iterator = None


@contextlib.contextmanager
def _workers_share_cores():
    """Around a bound rank's DataLoader: without torch's warning that more workers than cores "might get
    DataLoader running slow or even freeze". Its workers share the rank's cores by design (engine/binding.py:
    with 2 workers each on a rank's 1 core, 1.107x torchrun's unbound DataLoader, benchmarks/README.md)."""
    if binding.CORES is None:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes in total")
        yield


class _Keys:
    """The DataLoader's batch sampler: the ``(epoch, indices)`` keys of the epoch being loaded."""

    def __init__(self):
        self.keys = []

    def __iter__(self):
        return iter(self.keys)

    def __len__(self):
        return len(self.keys)


class WorkerTraceback(Exception):
    """The traceback of an error raised in a DataLoader worker process, as the text torch sent from it."""


def _worker_traceback(exc) -> str:
    """The first section of the worker's traceback in the message torch re-raised ``exc`` with (after
    "Original Traceback"): the error the sample raised, with its frames; "" when there is none."""
    text = str(exc)
    marker = "Original Traceback (most recent call last):"
    if marker not in text:
        return ""
    first = text.split(marker, 1)[1].split("\n\nThe above exception was the direct cause", 1)[0]
    return ("Traceback (most recent call last):" + first).rstrip()


def _original_message(exc) -> str:
    """The SampleError message raised in a DataLoader worker, without the worker's traceback around it."""
    text = str(exc)
    marker = "SampleError: "
    return text[text.rindex(marker) + len(marker):].strip() if marker in text else text


#: What a failure of DataLoader workers looks like (torch's messages) -> what distnb adds.
_WORKER_DIED = ("DataLoader worker", ("killed by signal", "exited unexpectedly"))
_SHM_FULL = ("No space left on device", "insufficient shared memory", "out of shared memory", "shared memory(shm)",
             "unable to write to file </torch_", "unable to allocate shared memory", "Bus error")


def shm_free(path: str = "/dev/shm") -> str:
    """``path``'s free and total space, in words ("12 MiB free of 64 MiB"), or "" if it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    return f"{st.f_bavail * st.f_frsize >> 20} MiB free of {st.f_blocks * st.f_frsize >> 20} MiB"


def explain(exc: BaseException, where: str = "") -> None:
    """Add distnb's diagnosis to ``exc``'s message in place when it is a DataLoader worker failure.

    A worker killed (SIGKILL is what the out-of-memory killer sends) or a full ``/dev/shm``
    (workers pass each batch through shared memory) gets the rank, ``where`` and the fix.
    """
    text = str(exc)
    if not exc.args or "[distnb]" in text:
        return
    rank = runtime.STATE.rank
    at = f" {where}" if where else ""
    if any(w in text for w in _SHM_FULL):
        hint = (f"rank {rank} ran out of shared memory{at} (/dev/shm: {shm_free('/dev/shm') or 'unreadable'}): "
                "DataLoader workers pass every batch to the rank through /dev/shm. Lower --workers, "
                "--prefetch-factor or --batch-size, use --workers 0, or give the machine or container a larger "
                "/dev/shm (docker run --shm-size=2g)")
    elif _WORKER_DIED[0] in text and any(w in text for w in _WORKER_DIED[1]):
        hint = (f"a DataLoader worker of rank {rank} died{at} (SIGKILL is what the out-of-memory killer sends). "
                "Lower --workers, --prefetch-factor or --batch-size, or use --workers 0; the other workers were "
                "ended and the next cell works as usual")
    else:
        return
    exc.args = (f"{exc.args[0]}\n[distnb] {hint}",) + tuple(exc.args[1:])


# installing ------------------------------------------------------------------------------

class SampleList(Dataset):
    """A Python list of samples (``[(x, y), ...]``, ``[{"x": ..., "y": ...}, ...]``) as a map-style Dataset:
    what ``torch.utils.data.DataLoader`` makes of a list it is given."""

    def __init__(self, samples: list):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def _install(ns, name, dataset, kind, num_shards):
    per_rank = kind == "part"
    if isinstance(dataset, list):  # a list of samples (distnb.transfer.data.is_sample_list), sent or made on the ranks
        dataset = SampleList(dataset)
    if not isinstance(dataset, Dataset):
        raise TypeError(f"rank {runtime.STATE.rank}: {name} is a {type(dataset).__name__}, not a "
                        "torch.utils.data.Dataset")
    if kind != "stream" and isinstance(dataset, IterableDataset):
        kind = "stream"
    if kind != "stream" and not hasattr(dataset, "__len__"):
        raise TypeError(f"rank {runtime.STATE.rank}: {name} has no __len__: a map-style Dataset needs one "
                        "(or make it an IterableDataset)")
    old = SOURCES.pop(name, None)
    if old is not None:
        old.close()
    index = stream = sharding.shard_index(runtime.STATE.rank, runtime.STATE.world_size, num_shards)
    if kind == "stream" and per_rank:  # make() gave this rank its own stream: split it across workers only
        num_shards, index = 1, 0
    source = Source(name, dataset, kind, num_shards, index, ns)
    source.stream = stream
    SOURCES[name] = source
    return dict(kind=kind, length=source.length)


def install_dataset(ns, name, kind, num_shards, payload, descs, *buffers):
    """Receive a Dataset sent by value (``kind`` "dataset" or "stream") or a function ``make`` ("part").

    ``make`` is called as ``make(index, num_shards)``: the rank and world size for data
    parallelism (1 part, ``make(0, 1)``, where every rank trains on the same batches). The
    data set (for ``make``: this rank's part) is bound to ``name`` in the engine namespace.
    Returns ``dict(kind, length)`` (length None for a stream).
    """
    obj = wire.loads(payload, descs, buffers)
    if kind == "part":
        index = sharding.shard_index(runtime.STATE.rank, runtime.STATE.world_size, num_shards)
        obj = obj(index, num_shards)
    ns[name] = obj  # as a shard is bound to its name: on the ranks, NAME is this rank's data set
    return _install(ns, name, obj, kind, num_shards)


def adopt_dataset(ns, name, num_shards):
    """Use the Dataset a ``%%dist`` cell bound to ``name`` on this rank (``--data-on-ranks``).

    Returns ``dict(kind, length)``.
    """
    if name not in ns:
        raise NameError(f"rank {runtime.STATE.rank}: --data-on-ranks {name}: no such name on this rank; create it "
                        f"in a %%dist cell first (e.g. `{name} = MyDataset(...)`)")
    return _install(ns, name, ns[name], "dataset", num_shards)
