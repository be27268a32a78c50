"""Data sets in the kernel: which way ``--data`` reaches the ranks, shards, and how batches are cut.

Two paths (:func:`path_of` decides, and the cell's first message says which and why):

- **Tensors** (a TensorDataset, tensor, array, or a tuple/list/dict of them): the fast path.
  The kernel materialises the set once as columns (:func:`distnb.transfer.transfer.columns_of`),
  deals them out with the seeded assignment of :mod:`distnb.engine.transport.shard` (disjoint,
  covering) and writes each shard once (shared memory on one host).
- **Loaded on the ranks** (:func:`ensure_dataset`): any other map-style ``Dataset`` or an
  ``IterableDataset`` is sent *by value* (cloudpickle: its class and attributes, such as file
  paths and a transform, never its samples); a function ``make(rank, world_size)`` is sent
  and run on each rank; ``--data-on-ranks`` uses a Dataset a ``%%dist`` cell made there.
  The ranks load their samples every epoch (:mod:`distnb.engine.train.datasets`) with the same
  shard arithmetic as the tensor path. The kernel calls ``__getitem__`` at most once (sample
  0, to describe it), when the set is sent.

What the ranks hold is recorded in ``session.holdings.data`` so a training cell sends again
only when the data, the seed or the number of shards changed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import types

from distnb.core import calls
from distnb.core.errors import PlanError
from distnb.core.tables import count
from distnb.transfer.transfer import collated, columns_of, fingerprint, is_sample_list, outgoing, outgoing_rows


def scatter(session, name: str, obj, seed: int, num_shards: int, allow_empty: bool = False) -> list:
    """Send each rank its shard of ``obj`` under ``name`` (rank ``r`` gets shard ``shard_index(r, ...)``).

    With fewer shards than ranks, the ranks of one shard are consecutive
    (:func:`distnb.engine.transport.shard.shard_index`).

    Returns
    -------
    list of int
        Samples per rank.

    Raises
    ------
    PlanError
        If ``obj`` is not a data set, or has fewer samples than ``num_shards`` (unless ``allow_empty``: a
        validation set, whose empty shards count nothing), or ``num_shards`` does not divide world_size
        (before the ranks drop what they held under ``name``).
    """
    from distnb.engine.transport import shard as sharding  # loads numpy, torch at first use

    cluster = session.cluster
    world = cluster.world_size
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1 or world % num_shards:
        fits = ", ".join(str(k) for k in range(1, world + 1) if world % k == 0)
        raise PlanError(f"num_shards must divide world_size={world} (ranks go in equal blocks, one shard a block): "
                        f"one of {fits}, got {num_shards!r}")
    structure, columns, n = columns_of(obj, name)
    if n < num_shards and not allow_empty:
        raise PlanError(f"{name} has {n} samples, fewer than world_size={cluster.world_size}")
    shards = sharding.assign(n, num_shards, seed)
    session.holdings.data.pop(name, None)  # the ranks drop what they held under name first
    ars = []
    with contextlib.ExitStack() as files:  # each shard written once (shared memory on one host)
        for index, idx in enumerate(shards):
            ranks = sharding.shard_ranks(index, cluster.world_size, num_shards)
            descs, sent = files.enter_context(outgoing_rows(cluster, columns, idx, ranks))
            for rank in ranks:
                ars.append(cluster.apply(rank, calls.install_shard, name, n, num_shards, seed, index, structure,
                                         descs, *sent))
        sizes = cluster.wait_all(ars, timeout=cluster.spec.timeout, what=f"scatter {name}")
    session.holdings.data[name] = dict(fingerprint=held_fingerprint(obj), seed=seed, num_samples=n, shards=shards,
                                       structure=structure, num_shards=num_shards)
    return sizes


def scatter_line(name: str, info: dict, sizes: list) -> str:
    """What ``%dist scatter`` did, in one line: ``sizes`` are the samples per rank, ``info`` the holdings entry."""
    n, shards = info["num_samples"], info["num_shards"]
    if shards == 1:
        return f"scattered {name} ({n} samples): every rank holds the whole set (num_shards=1)"
    if shards < len(sizes):
        per = len(sizes) // shards
        return (f"scattered {name} ({n} samples) as {shards} shards of {', '.join(map(str, sizes[::per]))}, "
                f"each held by {per} ranks in a row")
    return f"scattered {name} ({n} samples) as shards of {', '.join(map(str, sizes))}"


def gather(session, name: str):
    """``name`` from every rank: for data :func:`scatter` sent, the shards put back in the original sample order
    (:func:`reassemble`), else (or when the ranks changed their shards' lengths, which is said) a list by rank."""
    values = session.pull(name)
    info = session.holdings.data.get(name)
    if info is None or "structure" not in info:
        return values
    whole = reassemble(values, info)
    if isinstance(whole, list):  # filtered on the ranks, say: no sample order to restore (it returns no list else)
        try:
            held = str(len(values[0]))
        except TypeError:
            held = f"a {type(values[0]).__name__}"
        print(f"distnb: {name} on the ranks no longer has the shards' lengths it was scattered with (rank 0 holds "
              f"{held} of {len(info['shards'][0])}): gathered as a list by rank")
    return whole


def reassemble(values: list, info: dict):
    """The shards pulled from the ranks (``values``, by rank) put back in the original sample order.

    Returns a tensor, tuple, dict or TensorDataset like the scattered original, or ``values`` unchanged when
    the ranks no longer hold tensors of the shards' lengths.
    """
    import torch

    values = values[::len(values) // info["num_shards"]]  # the first rank of each shard (the others hold copies)
    kind = info["structure"][0]
    cols_by_rank = [[v] if kind == "tensor" else list(v.values()) if kind == "dict" else
                    list(v.tensors if isinstance(v, torch.utils.data.TensorDataset) else v) for v in values]
    columns = []
    for j in range(len(cols_by_rank[0])):
        parts = [cols[j] for cols in cols_by_rank]
        if not all(isinstance(p, torch.Tensor) and len(p) == len(i) for p, i in zip(parts, info["shards"])):
            return values
        out = parts[0].new_empty((info["num_samples"],) + tuple(parts[0].shape[1:]))
        for p, idx in zip(parts, info["shards"]):
            out[idx] = p
        columns.append(out)
    if kind == "tensor":
        return columns[0]
    if kind == "dict":
        return dict(zip(info["structure"][1], columns))
    return torch.utils.data.TensorDataset(*columns) if info["structure"][2:] == ("TensorDataset",) else tuple(columns)


def describe_cut(plan, info: dict, num_shards: int, world_size: int) -> str:
    """One sentence: how ``plan.data`` is cut into shards and batches (pad or drop, steps per epoch)."""
    from distnb.engine.transport import shard as sharding  # loads numpy, torch at first use

    n, w = info["num_samples"], num_shards
    if num_shards == 1 and world_size > 1:
        steps = sharding.steps_per_epoch(n, 1, plan.batch_size, plan.drop_last)
        return (f"{plan.data}: {count(n, 'sample')}, the whole set on every rank (--strategy {plan.strategy} "
                f"trains all ranks on the same batches); {count(steps, 'step')}/epoch of {_batch(plan, n)}")
    per = sharding.samples_per_epoch(n, w, plan.drop_last)
    steps = sharding.steps_per_epoch(n, w, plan.batch_size, plan.drop_last)
    lens = [sharding.shard_length(n, w, r) for r in range(w)]
    if plan.drop_last:
        held = str(min(lens)) if min(lens) == max(lens) else f"{min(lens)}-{max(lens)}"
        used = min(per, steps * plan.batch_size)  # full batches only: the shard's tail is not trained on
        how = f"drop: each rank uses {used} of its {held} samples, full batches only"
    elif min(lens) < per:
        how = f"pad: ranks with {count(min(lens), 'sample')} repeat {per - min(lens)} so all visit {per}"
    else:
        how = f"every rank visits {per} samples"
    shared = (f" (each shared by the {world_size // w} ranks of a tensor-parallel group)" if 1 < w < world_size
              else "")
    return (f"{plan.data}: {count(n, 'sample')} in {count(w, 'shard')}{shared}; {how}; {count(steps, 'step')}/epoch "
            f"of {_batch(plan, per, ' per rank')}")


def _batch(plan, visited: int, per_rank: str = "") -> str:
    """The batch a rank trains on: ``--batch-size``, or all it visits when that is fewer (and the cell says so)."""
    if plan.batch_size <= visited:
        return f"{plan.batch_size}{per_rank}"
    return (f"{visited}{per_rank} (--batch-size {plan.batch_size} is more than the {count(visited, 'sample')} a rank "
            "visits per epoch)")


def describe_validation(name: str, info: dict, num_shards: int, batch_size: int) -> str:
    """One sentence: how the validation set ``name`` is cut (every sample counted once, masked padding)."""
    from distnb.engine.transport import shard as sharding  # loads numpy, torch at first use

    n = info["num_samples"]
    lens = [sharding.shard_length(n, num_shards, r) for r in range(num_shards)]
    forwards = -(-max(lens) // batch_size)
    pad = ("; shorter shards end with a masked pad sample (counted in no sum)" if min(lens) < max(lens)
           and -(-min(lens) // batch_size) < forwards else "")
    where = f"in {count(num_shards, 'shard')}" if num_shards > 1 else "on every rank (the same batches)"
    return (f"validation set {name}: {count(n, 'sample')} {where}, each counted once; "
            f"{count(forwards, 'forward')} of up to {batch_size} per rank{pad}")


# data sets loaded on the ranks -------------------------------------------------------------

#: Options that only a data set loaded on the ranks through a DataLoader takes.
_LOADER_OPTIONS = (("workers", "--workers"), ("collate", "--collate"), ("prefetch_factor", "--prefetch-factor"))


def path_of(plan, obj) -> tuple:
    """Which way ``obj`` (``--data``) reaches the ranks, and why: ``(path, why)``.

    ``path`` is ``"tensors"`` (the fast path: shards of tensors), ``"dataset"`` (a map-style
    Dataset sent by value), ``"stream"`` (an IterableDataset sent by value), ``"factory"``
    (a function ``make(rank, world_size)`` run on each rank) or ``"ranks"``
    (``--data-on-ranks``: a Dataset made on the ranks).

    Raises
    ------
    PlanError
        For a Dataset without ``__len__`` that is not an IterableDataset, or loader options
        (``--workers``, ``--collate``, ``--prefetch-factor``) with tensors.
    """
    from torch.utils.data import Dataset, IterableDataset, TensorDataset

    name = plan.data
    if plan.data_on_ranks:
        path, why = "ranks", "made on the ranks (--data-on-ranks); nothing passes through the kernel"
    elif isinstance(obj, IterableDataset):
        path, why = "stream", f"an IterableDataset ({type(obj).__name__}) sent by value, read on the ranks"
    elif isinstance(obj, Dataset) and not isinstance(obj, TensorDataset):
        if not hasattr(obj, "__len__"):
            raise PlanError(f"--data {name} is a {type(obj).__name__} without __len__: a map-style Dataset needs "
                            "one (or derive it from torch.utils.data.IterableDataset for a stream)")
        path, why = "dataset", (f"a map-style {type(obj).__name__} sent by value (its class and attributes, not its "
                                "samples; the tensor fast path is for tensor containers); each rank loads its shard "
                                "with __getitem__ every epoch")
    elif is_sample_list(obj):
        path, why = "dataset", ("a list of samples sent by value, a map-style data set as DataLoader takes one; each "
                                "rank loads its shard every epoch")
    elif isinstance(obj, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)):
        path, why = "factory", f"{name}(rank, world_size) runs on each rank and returns that rank's part"
        _check_factory(name, obj)
    else:
        path, why = "tensors", "a tensor container, materialised once and shipped as shards"
        _check_container(name, obj)
    if path == "dataset" and plan.steps_per_epoch:  # known before anything is sent, as for tensors below
        _check_steps_option(plan, dict(kind="dataset", num_samples=len(obj)))
    if path == "tensors":
        given = [flag for field, flag in _LOADER_OPTIONS if getattr(plan, field)] + \
            (["--steps-per-epoch"] if plan.steps_per_epoch else [])
        if given:
            raise PlanError(f"{', '.join(given)}: for a Dataset loaded on the ranks; --data {name} is a tensor "
                            "container, whose batches are sliced from memory (nothing to load). Wrap the loading "
                            "in a torch.utils.data.Dataset to use DataLoader workers")
    return path, why


def _check_factory(name, make) -> None:
    """PlanError unless ``make`` can be called as ``make(rank, world_size)`` (checked in the kernel, not on each rank)."""

    try:
        inspect.signature(make).bind(0, 1)
    except TypeError as exc:
        raise PlanError(f"--data {name} is a function, so each rank calls {name}(rank, world_size) for its part of the "
                        f"data, but it does not take those two arguments ({exc})") from None
    except ValueError:  # no signature to read (some builtins): the ranks' call will say
        pass


def _check_container(name, obj) -> None:
    """PlanError unless ``obj`` can be a tensor container: a tensor/array, a TensorDataset, or a flat
    tuple, list or dict of tensors/arrays (their lengths are checked when it is cut)."""
    import numpy as np
    import torch

    if not isinstance(obj, (torch.Tensor, np.ndarray, tuple, list, dict, torch.utils.data.TensorDataset)):
        raise PlanError(f"--data {name} is a {type(obj).__name__}; --data takes a torch Dataset, a TensorDataset, "
                        "a tensor/array, a tuple of tensors/arrays, a list of samples such as list(zip(X, y)), or a "
                        "function make(rank, world_size)")
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (tuple, list)) else ()
    for key, value in items:  # what columns_of takes, checked before the model is sent
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            nested = (" (a nested container: flatten it, e.g. (x, y, w), or give a Dataset whose items nest)"
                      if isinstance(value, (tuple, list, dict)) else "")
            raise PlanError(f"{name}[{key!r}] is a {type(value).__name__}; --data takes tensors or numpy arrays "
                            f"(a tensor, a tuple of them, a dict of them, or a torch Dataset){nested}")


def _fingerprint(payload: bytes, descs, buffers, tensors) -> tuple:
    """Identity of a packed object: its pickle's hash (numpy arrays are inside it), its tensors' descriptions,
    where their bytes are and their version counters (``ds.X[:] = 0`` bumps one, and moves nothing)."""
    where = tuple(b.__array_interface__["data"][0] for b in buffers)
    versions = tuple(t._version for t in tensors)
    return hashlib.blake2b(payload, digest_size=16).hexdigest(), tuple(map(tuple, descs)), where, versions


def held_fingerprint(obj):
    """What the ranks' copy of a data set taken as tensors is compared by: a Dataset collated in the kernel by what
    it packs to (its attributes too: ``val.shift = 5.0`` after a cell is a change), anything else by
    :func:`distnb.transfer.transfer.fingerprint` (whose identity of a Dataset missed that)."""
    from distnb.engine.transport.wire import pack  # loads numpy, torch: at first use, not when this module is imported

    if collated(obj):
        tensors = []
        try:
            return "collated", _fingerprint(*pack(obj, tensors), tensors)
        except Exception:  # it cannot be pickled (it is collated here, never sent): by identity
            pass
    return fingerprint(obj)


def _pack(name, obj, path, tensors=None):
    from distnb.engine.transport.wire import pack  # loads numpy, torch: at first use, not when this module is imported

    try:
        return pack(obj, tensors)
    except Exception as exc:
        raise PlanError(f"cannot send --data {name} ({type(obj).__name__}) to the ranks: {type(exc).__name__}: "
                        f"{exc}. Build it on the ranks instead: --data with a function make(rank, world_size) -> "
                        "Dataset, or create it in a %%dist cell and pass --data-on-ranks") from None


def _sample(plan, obj) -> str:
    """What sample 0 of a map-style Dataset looks like (its one ``__getitem__`` call in the kernel).

    Raises PlanError when torch's ``default_collate`` cannot batch it and no ``--collate`` is given.
    """
    from torch.utils.data import default_collate

    from distnb.engine.train.datasets import describe_sample  # loads numpy, torch at first use

    try:
        sample = obj[0]
    except Exception as exc:  # the ranks name the rank and index when they hit it
        return f"sample 0 raised {type(exc).__name__} in the kernel"
    if plan.collate is None:
        try:
            default_collate([sample])
        except Exception as exc:
            raise PlanError(f"--data {plan.data}: sample 0 is {describe_sample(sample)}, which torch's "
                            f"default_collate cannot batch ({type(exc).__name__}: {exc}); return tensors, numbers or "
                            "numpy arrays from __getitem__, or pass --collate NAME (a notebook function list of "
                            "samples -> batch)") from None
    return f"samples like {describe_sample(sample)}"


def ensure_dataset(session, plan, obj, path, why, num_shards) -> tuple:
    """Make the ranks hold ``plan.data`` loaded on the ranks (sent again only when it changed).

    Returns
    -------
    (info, changed) : (dict, bool)
        ``session.holdings.data[plan.data]``: path, kind, why, length (per rank's part for
        ``make``), num_samples (None for a stream), num_shards; and whether it was (re)sent.

    Raises
    ------
    PlanError
        The object cannot be pickled, the ranks' lengths differ, or ``--steps-per-epoch``
        was given for a map-style set.
    RankError
        A rank failed to build or adopt it (``make`` raised, no such name on the ranks).
    """
    cluster, name = session.cluster, plan.data
    held = session.holdings.data.get(name)
    sample = None
    if path == "ranks":
        fp = None
        ars = cluster.apply_all(calls.adopt_dataset, name, num_shards)
    else:
        tensors = []
        payload, descs, buffers = _pack(name, obj, path, tensors)
        fp = (path, _fingerprint(payload, descs, buffers, tensors), id(obj))
        if held is not None and held.get("fingerprint") == fp and held["num_shards"] == num_shards:
            _check_steps_option(plan, held)
            return held, False

        sample = _sample(plan, obj) if path == "dataset" else None  # before anything is sent
        kind = {"factory": "part"}.get(path, path)
        with outgoing(cluster, buffers) as sent:
            ars = cluster.apply_all(calls.install_dataset, name, kind, num_shards, payload, descs, *sent)
            answers = cluster.wait_all(ars, timeout=cluster.spec.timeout + 60, what=f"sending {name}")
    if path == "ranks":
        answers = cluster.wait_all(ars, timeout=cluster.spec.timeout, what=f"finding {name} on the ranks")
    info = _agree(plan, path, answers, num_shards)
    info.update(path=path, why=why, fingerprint=fp, num_shards=num_shards,
                sample=sample)
    session.holdings.data[name] = info
    _check_steps_option(plan, info)
    return info, True


def _agree(plan, path, answers, num_shards) -> dict:
    """The ranks' answers (kind, length) as one description; PlanError when their lengths differ."""
    kinds = {a["kind"] for a in answers}
    lengths = [a["length"] for a in answers]
    kind = "stream" if "stream" in kinds else answers[0]["kind"]
    if kind != "stream" and len(set(lengths)) > 1:
        each = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
        fix = ("every part must have the same length so that every rank runs the same number of steps: give each "
               "rank as many samples (drop the extra ones in make)" if path == "factory" else
               "every rank must hold the same data set (distnb gives each rank its shard of it): build it from the "
               "same files or data on every rank")
        raise PlanError(f"--data {plan.data} has different lengths on the ranks ({each}): {fix}")
    length = None if kind == "stream" else lengths[0]
    num_samples = None if length is None else length * (num_shards if kind == "part" else 1)
    return dict(kind=kind, length=length, num_samples=num_samples)


def _check_steps_option(plan, info) -> None:
    if plan.steps_per_epoch and info["kind"] != "stream":
        raise PlanError(f"--steps-per-epoch is for an IterableDataset (a stream has no length); --data {plan.data} "
                        f"has {count(info['num_samples'], 'sample')}: leave it out")


def steps_of(plan, info, num_shards) -> int:
    """Steps per epoch on every rank for ``info`` (0: a stream read until one rank's ends); PlanError if none."""
    from distnb.engine.transport import shard as sharding  # loads numpy, torch at first use

    if info.get("kind") == "stream":
        return plan.steps_per_epoch or 0
    n = info["num_samples"]
    try:
        sharding.check_sizes(n, num_shards, plan.batch_size, plan.drop_last)
    except ValueError as exc:
        raise PlanError(f"--data {plan.data}: {exc}") from None
    return sharding.steps_per_epoch(n, num_shards, plan.batch_size, plan.drop_last)


def describe_loaded(plan, info, world_size) -> str:
    """One sentence for a data set loaded on the ranks: the path and why, the cut, the loader."""
    workers = f"{count(plan.workers, 'DataLoader worker')}/rank" if plan.workers else "loaded in each rank (no workers)"
    if info["kind"] == "stream":
        split = f"split across {count(info['num_shards'], 'rank')} x {max(1, plan.workers)} loaders without duplicates"
        steps = (f"{count(plan.steps_per_epoch, 'step')}/epoch of {plan.batch_size}" if plan.steps_per_epoch else
                 f"batches of {plan.batch_size} each epoch until the first rank's stream ends (the ranks agree at "
                 "every step)")
        return f"{plan.data}: {info['why']}; {split}; {steps}; {workers}"
    cut = describe_cut(plan, info, info["num_shards"], world_size).split(": ", 1)[1]
    if info["kind"] == "part":
        cut = f"parts of {count(info['length'], 'sample')} ({cut})"
    sample = f" ({info['sample']})" if info.get("sample") else ""
    return f"{plan.data}: {info['why']}{sample}; {cut}; {workers}"
