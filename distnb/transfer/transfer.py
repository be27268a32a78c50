"""Kernel-side transfer: data as columns for shards, change detection, weights back.

Objects themselves are packed by :func:`distnb.engine.transport.wire.pack` (shared with the ranks,
which use it for ``%dist pull``): cloudpickle, so classes and functions defined in the
notebook (``__main__``) travel by value and the engines need no import of them
(FIELD-NOTES pitfall 4). Tensors inside an object are cut out of the pickle and sent
as separate zero-copy buffers (:mod:`distnb.engine.transport.wire`), so a model's weights are
neither pickled nor copied whole in the kernel.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import io
import os
import types
import uuid
import zlib

from distnb.core import calls
from distnb.core.errors import PlanError
from distnb.transfer import captured, resident, weights_back


def is_sample_list(obj) -> bool:
    """Whether ``obj`` is a list of samples (``list(zip(X, y))``: its items are tuples, lists or dicts), which
    trains as a map-style Dataset (what DataLoader makes of a list), rather than columns (``[X, y]``)."""
    return isinstance(obj, list) and bool(obj) and isinstance(obj[0], (tuple, list, dict))


def is_columns(obj) -> bool:
    """Whether ``obj`` is a non-empty tuple, list or dict whose items are all tensors or numpy arrays (columns)."""
    import numpy as np
    import torch

    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return bool(items) and all(isinstance(x, (torch.Tensor, np.ndarray)) for x in items)


def collated(obj) -> bool:
    """Whether a data set taken as tensors is collated from its items (:func:`columns_of`): a map-style Dataset
    other than a TensorDataset, or a list of samples."""
    from torch.utils.data import Dataset, TensorDataset

    return is_sample_list(obj) or (isinstance(obj, Dataset) and not isinstance(obj, TensorDataset)
                                   and hasattr(obj, "__len__"))


def columns_of(data, name="data"):
    """Normalise a data set held in the kernel into columns of equal length.

    Accepts a tensor or numpy array, a tuple/list of them, a dict of them, a
    ``TensorDataset``, or any map-style ``torch.utils.data.Dataset`` or list of samples
    (:func:`is_sample_list`; its items are collated with ``default_collate``).

    Returns
    -------
    structure : tuple
        ``("tensor",)``, ``("tuple", k)`` or ``("dict", keys)``; ``("tuple", k, "TensorDataset")``
        for a Dataset whose samples are k-tuples (a TensorDataset among them): batches are
        k-tuples, and the ranks' shard is a TensorDataset of the k columns.
    columns : list of torch.Tensor
        Each of shape (num_samples, ...).
    num_samples : int

    Raises
    ------
    PlanError
        For an unsupported type, empty data, or columns of different lengths.
    """
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    def as_tensor(x, where):
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, np.ndarray):
            try:
                return torch.from_numpy(np.ascontiguousarray(x))
            except TypeError:
                raise PlanError(f"{where} is a numpy array of dtype {x.dtype}, which torch cannot hold; "
                                "convert it to numbers first (e.g. label-encode strings)") from None
        raise PlanError(f"{where} is a {type(x).__name__}; --data takes tensors or numpy arrays "
                        "(a tensor, a tuple of them, a dict of them, or a torch Dataset)")

    if isinstance(data, TensorDataset):
        structure, columns = ("tuple", len(data.tensors), "TensorDataset"), list(data.tensors)
    elif isinstance(data, (torch.Tensor, np.ndarray)):
        structure, columns = ("tensor",), [as_tensor(data, name)]
    elif isinstance(data, (tuple, list)) and not is_sample_list(data):
        structure = ("tuple", len(data))
        columns = [as_tensor(x, f"{name}[{i}]") for i, x in enumerate(data)]
    elif isinstance(data, dict):
        structure = ("dict", tuple(data))
        columns = [as_tensor(v, f"{name}[{k!r}]") for k, v in data.items()]
    elif collated(data):
        return _dataset_columns(data, name)
    else:
        raise PlanError(f"{name} is a {type(data).__name__}; --data takes a torch Dataset, a TensorDataset, "
                        "a tensor/array, or a tuple of tensors/arrays")
    if not columns:
        raise PlanError(f"{name} holds no tensors")
    for i, c in enumerate(columns):
        if c.dim() == 0:
            raise PlanError(f"{name}: column {i} is a 0-d tensor; samples are along the first dimension")
    lengths = {len(c) for c in columns}
    if len(lengths) != 1:
        raise PlanError(f"{name}: columns have different numbers of samples {sorted(lengths)}")
    num_samples = lengths.pop()
    if num_samples == 0:
        raise PlanError(f"{name} is empty (0 samples)")
    return structure, columns, num_samples


def _dataset_columns(data, name):
    """:func:`columns_of` of a map-style Dataset or list of samples: its items collated with ``default_collate``."""
    from torch.utils.data import default_collate

    n = len(data)
    if n == 0:
        raise PlanError(f"{name} is empty (len 0)")
    items = []
    for i in range(n):
        try:
            items.append(data[i])
        except Exception as exc:  # the Dataset's own error, not the collation's
            raise PlanError(f"{name}[{i}] raised {type(exc).__name__}: {exc}; fix the Dataset's __getitem__ for index "
                            f"{i} (a Dataset taken as tensors is read whole, in the kernel)") from exc
    try:
        collated = default_collate(items)
    except Exception as exc:
        raise PlanError(f"cannot collate the items of {name} into tensors ({type(exc).__name__}: {exc}); "
                        "give tensors or a Dataset whose items are tensors/numbers of one shape each") from exc
    try:
        structure, columns, num_samples = columns_of(collated, name)
    except PlanError as exc:  # a field that collates to no tensor (a list of strings, of None)
        raise PlanError(f"{name}'s items collate with torch's default_collate to what is not all tensors: "
                        f"{str(exc).split(';')[0]}; a Dataset taken as tensors (a --val-data set, %dist scatter) "
                        "needs items of tensors and numbers only: leave the other fields out of its items") from None
    return structure + (("TensorDataset",) if structure[0] == "tuple" and not is_sample_list(data) else ()), \
        columns, num_samples


def _module_settings(module):
    """Each submodule's type, own attributes and hooks (:func:`distnb.transfer.captured.module_state`)."""
    return captured.module_state(module)


def _leaf(x):
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):  # where its bytes lie and their type too: `.data =`, `.double()`, `.to()`
        return (id(x), x._version, x.data_ptr(), x.dtype, tuple(x.shape), x.device)
    if isinstance(x, np.ndarray):  # no version counter: checksum the bytes (about 1 GB/s)

        return (id(x), zlib.crc32(memoryview(np.ascontiguousarray(x)).cast("B")))
    return (id(x),)


def fingerprint(obj):
    """A cheap identity of ``obj``'s current state, to decide whether the ranks hold it already.

    A model: object id, each submodule's type, own attributes and hooks (``net.scale = 0.5``,
    ``net.act = torch.tanh``, ``register_forward_hook`` count; not tensors kept as plain attributes: a buffer
    is state), each tensor's version counter, memory address, dtype, shape and device, and which
    parameters require gradients, and its classes' code and the notebook globals it reads
    (:mod:`distnb.transfer.captured`: ``M.forward = ...`` or ``TEMP = 100.0`` after the model was sent counts; the class's
    cell run again from the same source does not). A notebook function: its code, defaults, closure and the
    globals it reads, not its identity. Data: object id, length, and per column the same of each tensor,
    or a numpy array's checksum; a tuple, list or dict of tensors or arrays is its columns, not its id
    (a new ``(X, y)`` of the same tensors, as ``train(data=(X, y))`` makes at every call, is the data
    the ranks hold). In-place changes through autograd-visible ops
    (``load_state_dict``, ``copy_``, ``*=``) bump ``_version``; a tensor given new memory or
    another dtype (``p.data = ...``, ``net.double()``, ``vector_to_parameters``) moves its
    address. Writes into a tensor's memory that torch does not see (``p.data.fill_(0)``, or
    through a numpy view of it) change neither: use ``--reset`` after those.
    """
    import torch

    if isinstance(obj, torch.nn.Module):
        leaves = [_leaf(t) for t in obj.state_dict(keep_vars=True).values()] + [_module_settings(obj)]
        leaves.append(tuple(p.requires_grad for p in obj.parameters()))  # a frozen layer is a change too
        leaves.append(captured.digest({type(m) for m in obj.modules()}))  # its classes' code, the globals it reads
    elif isinstance(obj, torch.utils.data.TensorDataset):
        leaves = [_leaf(t) for t in obj.tensors]
    elif isinstance(obj, (tuple, list)):
        leaves = [_leaf(x) for x in obj]
    elif isinstance(obj, dict):
        leaves = [(k, _leaf(v)) for k, v in obj.items()]
    elif isinstance(obj, (types.FunctionType, type)) and captured.by_value(obj):  # its code, the globals it reads
        leaves = [captured.of_value(obj)]
    else:
        leaves = [_leaf(obj)]
    length = len(obj) if hasattr(obj, "__len__") else None
    # a notebook function is what its code does (a cell run again from the same source is the same function);
    # a class keeps its identity too, as isinstance on the ranks follows it
    same = is_columns(obj) or (isinstance(obj, types.FunctionType) and captured.by_value(obj))
    return (0 if same else id(obj), type(obj), length, tuple(leaves))


def load_state_into(model, keys, descs, sizes, flat) -> None:
    """Copy weights received from a rank into the kernel's ``model`` in place, one tensor at a time
    (:func:`distnb.transfer.weights_back.load_into`)."""

    weights_back.load_into(model, keys, descs, sizes, flat)


def shm_ranks(cluster) -> frozenset:
    """Ranks that see this kernel's ``/dev/shm`` (same host, same user): probed once per cluster.

    A file holding a random token is written here and every rank is asked to read it
    (:func:`distnb.engine.transport.wire.probe_shm`, which also turns on the shared-memory path for
    what the rank sends back). ``DISTNB_SHM=0`` in the kernel's environment turns it off.
    """

    from distnb.engine.transport import segments, wire  # loads numpy, torch at first use

    known = getattr(cluster, "_distnb_shm_ranks", None)
    if known is not None:
        return known
    ok = frozenset()
    if os.environ.get("DISTNB_SHM", "1") != "0" and os.path.isdir(segments.SHM_DIR):
        token = uuid.uuid4().hex
        path = wire.shm_path(os.getpid(), "probe")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
            ars = cluster.apply_all(calls.probe_shm, path, token, os.getpid())
            answers = cluster.wait_all(ars, timeout=cluster.spec.timeout, what="probing shared memory")
            ok = frozenset(r for r, yes in enumerate(answers) if yes)
        except OSError:
            ok = frozenset()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
    cluster._distnb_shm_ranks = ok
    return ok


#: The kernel's pool of shared-memory segments (models, objects and shards sent to the ranks).
_POOL = None


def _pool():
    global _POOL
    from distnb.engine.transport import segments  # loads numpy, torch: at first use, not when this module is imported

    if _POOL is None or _POOL.owner_pid != os.getpid():
        _POOL = segments.Pool(os.getpid(), "k")
    return _POOL


def _acquire(cluster, nbytes: int, sparse: bool = False):
    """A segment of ``nbytes`` from the kernel's pool, or None (no room in ``/dev/shm``).

    When no free segment fits but some are lent out (data shards the ranks map copy-on-write),
    the ranks are asked which they still map (:func:`distnb.engine.transport.segments.held_segments`): the rest
    are reused, their pages already touched.
    """
    from distnb.engine.transport import segments  # loads numpy, torch: at first use, not when this module is imported

    pool = _pool()
    if pool.lent and not any(nbytes <= s.size <= 2 * nbytes + segments.GRAIN for s in pool.free):
        try:
            ars = cluster.apply_all(calls.held_segments, os.getpid())
            answers = cluster.wait_all(ars, timeout=cluster.spec.timeout, what="asking which data the ranks map")
            pool.returned(set().union(*map(set, answers)))
        except Exception:  # a rank that cannot answer may still map them: make a new segment
            pass
    try:
        return pool.acquire(nbytes, sparse=sparse)
    except OSError:  # no room in /dev/shm: send the bytes in the messages
        return None


@contextlib.contextmanager
def outgoing(cluster, buffers, ranks=None, keep=None):
    """The arguments that carry ``buffers`` to ``ranks`` (default all) in one transfer.

    One segment of the kernel's shared-memory pool, written once, when every receiving
    rank shares ``/dev/shm`` with the kernel (:func:`shm_ranks`) and it has room (the ranks
    copy out of it during the call); else the buffers themselves (ipyparallel zero-copy
    frames). Buffers that already lie in a resident segment (:mod:`distnb.transfer.resident`) are sent
    where they are, with no copy here. Otherwise the segment goes back to the pool when the block
    ends, whether the ranks succeeded or not, unless ``keep`` (the tensors the buffers were
    made of: a model's state) moved into it, each as soon as it was written (:func:`distnb.transfer.resident.write_adopting`).

    Yields
    ------
    list
        ``[ShmRef]`` or ``buffers``: pass as ``*args`` after the tensor descriptions.
    """
    from distnb.engine.transport import wire  # loads numpy, torch: at first use, not when this module is imported

    ranks = range(cluster.world_size) if ranks is None else ranks
    seg = ref = None
    if buffers and set(ranks) <= shm_ranks(cluster):
        ref = resident.in_place(_pool(), buffers)
        if ref is None:
            seg = _acquire(cluster, wire.layout([len(b) for b in buffers])[1], sparse=keep is not None)
    kept = False
    try:
        if ref is not None:
            yield [ref]
            return
        if seg is not None and keep is not None:  # a model: its tensors move into the segment one by one
            ref, kept = resident.write_adopting(_pool(), seg, buffers, keep)
        else:
            ref = wire.write_into(seg, buffers) if seg is not None else None
        yield [ref] if seg is not None else list(buffers)
    finally:
        if seg is not None and not kept:
            _pool().release(seg)


@contextlib.contextmanager
def outgoing_rows(cluster, columns, index, ranks):
    """Like :func:`outgoing` for rows ``index`` of ``columns`` (a data shard): yields (descs, args).

    In shared memory the rows are gathered straight into a pooled segment (no copy of the
    shard in the kernel), which the ranks map copy-on-write: the segment stays lent until
    they drop the shard. Otherwise the rows are gathered into new tensors sent as buffers.
    """
    from distnb.engine.transport import wire  # loads numpy, torch: at first use, not when this module is imported

    seg = None
    if set(ranks) <= shm_ranks(cluster):
        seg = _acquire(cluster, wire.rows_layout(columns, index)[2])
    try:
        if seg is not None:
            ref, descs = wire.write_rows_into(seg, columns, index)
            yield descs, [ref]
        else:
            cols = [c[index] for c in columns]
            yield [wire.describe(c) for c in cols], [wire.to_buffer(c) for c in cols]
    finally:
        if seg is not None:
            _pool().release(seg, lent=True)


def sweep_shm() -> int:
    """Remove this kernel's shared-memory files (its pool, the ranks' outboxes); returns how many."""
    from distnb.engine.transport import wire  # loads numpy, torch: at first use, not when this module is imported

    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None
    wire._MAPS.prune()

    return wire.sweep_shm(os.getpid())


def free_names(code: str) -> set:
    """Names a code string reads but never assigns (candidates to fetch from the notebook).

    Builtins are left out. Raises SyntaxError for invalid code.
    """

    return {n for n in _unassigned(code) if not hasattr(builtins, n)}


@functools.lru_cache(maxsize=64)
def _unassigned(code: str) -> frozenset:
    """The names ``code`` reads and never assigns, parsed once per code string (a cell's body is read by the
    automatic push and by the export's capture, at every cell)."""

    tree = ast.parse(code)
    loaded, stored = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
        elif isinstance(node, ast.alias):
            stored.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            stored.add(node.arg)
    return frozenset(loaded - stored)


def pack_named(name: str, value, why: str = "", tensors=None):
    """:func:`distnb.engine.transport.wire.pack` of the notebook's ``name`` (``tensors``: as there), or a PlanError that names
    what cannot travel.

    The error names the notebook variable, the attribute path to the object that cannot be
    pickled (``net.holder.gen: generator``) and the ways out, with no frames of distnb or
    cloudpickle. ``why``: what the value is sent for, added to the message.

    Raises
    ------
    PlanError
        If ``value`` (or something it holds) cannot be pickled.
    """
    from distnb.engine.transport import wire  # loads numpy, torch: at first use, not when this module is imported

    try:
        return wire.pack(value, tensors)
    except Exception as exc:  # cloudpickle raises TypeError, PicklingError, AttributeError, ...
        path, culprit, reason, owner = _walk(value, name) or (name, value, exc, value)
        owner = type(owner)
        fix = "" if owner in (dict, list, tuple, set, frozenset) or path == name else \
            f", or give {owner.__name__} a __getstate__ that leaves it out"
        head = f"cannot send {name!r} ({type(value).__name__}) to the ranks{why}"
        why_not = f"{type(reason).__name__}: {reason}"
        if path == name:
            raise PlanError(f"{head}: it cannot be pickled ({why_not}). Create it on the ranks in a %%dist cell "
                            "instead") from None
        raise PlanError(f"{head}: {path} is a {type(culprit).__name__}, which cannot be pickled ({why_not}). Leave it "
                        f"out of what is sent (delete or move it, or create it on the ranks in a %%dist cell){fix}"
                        ) from None


def _children(obj, path):
    """(path, child) of what pickling ``obj`` would pickle next: items, attributes, submodules."""
    if isinstance(obj, dict):
        return [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        return []
    out = []
    for k, v in state.items():
        if k in ("_modules", "_parameters", "_buffers") and isinstance(v, dict):
            out += [(f"{path}.{n}", m) for n, m in v.items() if m is not None]
        else:
            out.append((f"{path}.{k}", v))
    return out


def _pickle_error(obj):
    """The exception pickling ``obj`` raises (its tensors left out), or None."""

    import cloudpickle
    import torch

    class _NoTensors(cloudpickle.Pickler):
        def persistent_id(self, o):
            return 0 if isinstance(o, torch.Tensor) else None

    try:
        _NoTensors(io.BytesIO(), protocol=5).dump(obj)
    except Exception as exc:
        return exc
    return None


def unpicklable_part(value, name: str, limit: int = 2000):
    """``(path, object, exception)`` of the innermost part of ``value`` that cannot be pickled, or None.

    Walks items, attributes and submodules breadth-first from ``value`` (named ``name``),
    descending into the first child that fails, at most ``limit`` objects.
    """
    found = _walk(value, name, limit)
    return None if found is None else found[:3]


def _walk(value, name, limit=2000):
    """:func:`unpicklable_part` plus the object that holds the culprit (``value`` itself at the top)."""
    reason = _pickle_error(value)
    if reason is None:
        return None
    path, node, owner, seen = name, value, value, 0
    while seen < limit:
        for child_path, child in _children(node, path):
            seen += 1
            error = _pickle_error(child)
            if error is not None:
                path, owner, node, reason = child_path, node, child, error
                break
        else:
            return path, node, reason, owner
    return path, node, reason, owner


def model_change(old, new, keys) -> str:
    """What differs between two :func:`fingerprint` of a model (``keys``: its state_dict's keys), in words."""
    if old[0] != new[0] or old[1] != new[1]:
        return "it is a new object"
    before, after = old[3], new[3]
    if len(before) != len(after) or len(before) != len(keys) + 3:  # the tensors, then the three of fingerprint()
        return "its tensors changed"
    names = [k for k, a, b in zip(keys, before, after) if a != b]
    names = [f"{k[:-len('.num_batches_tracked')] or 'the'} running statistics (BatchNorm run in train mode)"
             if k.endswith("num_batches_tracked") else k for k in names]
    parts = []
    if names:
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        parts.append(f"{shown} changed")
    if before[-3] != after[-3]:
        parts.append(captured.changed_part(before[-3], after[-3]) or "a submodule's attributes changed")
    if before[-2] != after[-2]:
        parts.append("which parameters train changed")
    if before[-1] != after[-1]:
        members = captured.changed_members(before[-1], after[-1])
        if members:
            shown = ", ".join(members[:4]) + (f" and {len(members) - 4} more" if len(members) > 4 else "")
            parts.append(f"the code of {shown} changed (a method replaced, or its defaults, closure or decorators)")
        else:
            parts.append("a notebook global, function or class attribute its code reads changed")
    return "; ".join(parts) or "its state changed"
