"""Checked collectives for ``%%dist`` cells: mismatched tensors become an error on every rank.

gloo does not check that the ranks of a collective pass matching tensors: with different
sizes it aborts the whole engine process (``gloo::EnforceNotMet ... op.preamble.length <=
op.nbytes``, SIGABRT), and with the same number of bytes but a different shape or dtype it
returns a silently wrong result. While a ``%%dist`` cell runs, :func:`checked` wraps the
common collectives of ``torch.distributed`` so that each call made from the cell's own code
(a frame whose file is a distnb cell, ``<dist-cell-N>``, functions defined in cells included)
first compares a small fingerprint (collective, dtype, shape, root, reduce op) over the same group (an
all-reduce of its hash, :func:`_checked_call`); if the fingerprints differ, every rank raises
:class:`~distnb.core.errors.CollectiveMismatchError` naming each rank's tensor, before the
collective runs, and the process group stays consistent. This is the check that
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch's ``ProcessGroupWrapper``) does for every
collective of a process, limited here to user code, so libraries (DDP, FSDP, ...) and
training steps pay nothing for it. Cost: one all-reduce of 2 int64 per checked call (and an all-gather
of 14 int64 per rank when the ranks disagree).

Checked: ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather`` (the input tensor),
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (the input tensors), and ``barrier``
(no tensor: a rank in a barrier while another is in a collective is a mismatch too, and in a
cell run on some ranks only it raises at once instead of waiting for the others).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import inspect
import sys
import warnings

from distnb.core.errors import CollectiveMismatchError, ranks_named
from distnb.engine.process import abort, arrival, binding

#: Collective -> name of the argument holding the tensor that must match across ranks.
CHECKED = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather": "tensor",
           "all_gather_into_tensor": "input_tensor", "reduce_scatter_tensor": "input", "barrier": None}
_OPS = tuple(CHECKED)
#: Code of these files is checked: distnb's cells (see distnb.engine.process.runtime.cell_filename).
CELL_FILES = ("<dist-cell-", "<distrain-cell-")
_DIMS = 8  # shape entries in a fingerprint (a tensor of more dims is compared by its first 8 and numel)


def _fingerprint(torch, op: str, tensor, arguments: dict) -> list:
    """``[op, dtype, ndim, numel, 8 dims, root, reduce op]``: root is ``src``/``dst`` (-1: none), the
    reduce op its number (-1: none), so ranks that name different roots or ops disagree too."""
    root = arguments.get("src", arguments.get("dst"))
    reduce_op = arguments.get("op")
    if CHECKED[op] is None:  # barrier: the collective alone
        return [_OPS.index(op), -1, 0, 0, *[-1] * _DIMS, _number(root), _number(reduce_op)]
    dtypes = _dtypes(torch)
    dims = (list(tensor.shape) + [-1] * _DIMS)[:_DIMS]
    return [_OPS.index(op), dtypes.index(tensor.dtype) if tensor.dtype in dtypes else -1, tensor.dim(),
            tensor.numel(), *dims, _number(root), _number(reduce_op)]


def _number(value) -> int:
    """An int64 for a root rank or reduce op: -1 for none, -2 for one without a number (a custom op)."""
    if value is None:
        return -1
    try:
        return int(value)
    except (TypeError, ValueError):
        return -2


@functools.lru_cache(maxsize=1)
def _dtypes(torch):
    return [getattr(torch, n) for n in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
                                        "int8", "uint8", "bool", "complex64", "complex128")]


def _describe(torch, row, roots: bool = False, reduce_ops: bool = False) -> str:
    """``all_reduce of float32 [2, 3]``, with the root (``to rank 1``) and reduce op (``(MAX)``) when asked:
    where the ranks differ in them."""
    op, dtype, ndim, numel = row[:4]
    if CHECKED[_OPS[op]] is None:
        return _OPS[op]
    dtypes = _dtypes(torch)
    name = str(dtypes[dtype]).replace("torch.", "") if 0 <= dtype < len(dtypes) else "other dtype"
    shape = row[4:4 + min(ndim, _DIMS)] + (["..."] if ndim > _DIMS else [])
    root, reduce_op = row[4 + _DIMS:]
    where = f" {'from' if _OPS[op] == 'broadcast' else 'to'} rank {root}" if roots and root >= 0 else ""
    how = f" ({_reduce_name(reduce_op)})" if reduce_ops and reduce_op >= 0 else ""
    return f"{_OPS[op]} of {name} {list(shape)}{where}{how}"


def _reduce_name(number: int) -> str:
    import torch.distributed as dist

    try:
        return dist.ReduceOp.RedOpType(number).name
    except (ValueError, TypeError):
        return f"op {number}"


def _wrapped(dist, torch, op, original):
    """The checked version of ``original`` (``dist.<op>``), made once: ``inspect.signature`` of torch's
    decorated collectives costs about 20 us each, six of them for every cell on every rank."""
    key = (op, id(original))
    made = _WRAPPED.get(key)
    if made is None or made[0] is not original:
        made = _WRAPPED[key] = (original, _wrap(dist, torch, op, original))
    return made[1]


def _wrap(dist, torch, op, original):
    signature = inspect.signature(original)
    arg = CHECKED[op]
    placeholder = arg is None  # barrier: no tensor to compare, the check's own goes on the group's device

    @functools.wraps(original)
    def checked_collective(*args, **kwargs):
        # no check now (a name bound to it called between cells, or --unchecked), or a library's own call
        if SUBSET.get("off", True) or not sys._getframe(1).f_code.co_filename.startswith(CELL_FILES):
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # its own error message
        bound.apply_defaults()  # the default reduce op counts as the one named
        group = bound.arguments.get("group")
        if not dist.is_initialized() or dist.get_rank(group) < 0:
            return original(*args, **kwargs)
        tensor = _group_tensor(dist, torch, group) if placeholder else bound.arguments.get(arg)
        if not isinstance(tensor, torch.Tensor):
            return original(*args, **kwargs)
        world = dist.get_world_size(group)
        only = SUBSET.get("ranks")
        members = dist.get_process_group_ranks(group) if group is not None else range(world)
        if only is not None and not set(members) <= set(only):
            absent = [r for r in members if r not in only]
            raise CollectiveMismatchError(
                f"dist.{op} in a cell run on {ranks_named(only)} only: {ranks_named(absent)} of its group never "
                f"call{'s' if len(absent) == 1 else ''} it, so it would hang. Run the cell on every rank (leave out "
                "--targets)")
        # what a rank waiting here waits in (distnb.engine.process.where)
        CURRENT["call"] = (op, None if placeholder else list(tensor.shape))
        PROGRESS[0] += 1
        try:
            if SUBSET["unchecked"]:  # --unchecked --targets: only the subset is checked
                return original(*args, **kwargs)
            return _checked_call(dist, torch, op, original, args, kwargs, bound.arguments, group, world, tensor)
        finally:
            CURRENT.pop("call", None)

    return checked_collective


def _group_tensor(dist, torch, group):
    """An empty tensor on the device ``group``'s backend works on (a CUDA device for nccl), for a barrier's check."""
    return torch.empty(0, device=group_device(group))


def group_device(group=None):
    """The device a collective on ``group`` (None: the world) takes its tensors on.

    A group formed for nccl alone has no backend for CPU tensors: a collective given one raises
    ``RuntimeError: No backend type associated with device type cpu`` (even in a world of one rank).
    So every tensor distnb hands a collective is made on this device (or moved there with
    :func:`on_group`): the current CUDA device for such a group, the CPU for gloo or a group with a CPU
    backend besides (``"cpu:gloo,cuda:nccl"``). The rule is torch's own for its object collectives
    (``distributed_c10d._get_object_coll_device``).

    Returns
    -------
    torch.device
    """
    import torch
    from torch.distributed import distributed_c10d as c10d

    try:
        kind = c10d._get_object_coll_device(group)
    except (AttributeError, ValueError):  # a torch without the helper: by the backend's name
        kind = "cuda" if c10d.get_backend(group) == "nccl" else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def on_group(tensor, group=None):
    """``tensor`` on :func:`group_device` of ``group`` (the same tensor when it is there already).

    A collective that writes into its tensor (broadcast, all_gather's outputs) writes into the
    returned one: read the result from it, not from ``tensor``.
    """
    return tensor.to(group_device(group))


def _checked_call(dist, torch, op, original, args, kwargs, arguments, group, world, tensor):
    """The fingerprint check, then the collective itself (see the module docstring).

    First one all-reduce (max) of ``[h, -h]``, ``h`` a 56-bit hash of this rank's fingerprint: the
    ranks agree when the largest ``h`` is also the smallest. Only when they do not (every rank sees
    that alike) are the fingerprints all-gathered, to name each rank's tensor. Two int64 all-reduced
    took half the time of the twelve all-gathered (245-469 us against 447-834 us on 2 gloo ranks).
    """
    fingerprint = _fingerprint(torch, op, tensor, arguments)
    ranks = (dist.get_process_group_ranks(group) if group is not None else list(range(world)))
    if SUBSET.get("arrival") and arrival.available():  # a training body: agreed through the store, outside gloo
        rows = arrival.arrive(dist, group, ranks, fingerprint, op, SUBSET.get("timeout"))
        if all(row == rows[0] for row in rows):
            return original(*args, **kwargs)
        _mismatch(torch, rows, ranks)
    digest = int.from_bytes(hashlib.blake2b(repr(fingerprint).encode(), digest_size=7).digest(), "little")
    bounds = torch.tensor([digest, -digest], dtype=torch.int64, device=tensor.device)
    with warnings.catch_warnings():  # torch's deprecation notice is about its API, not the user's cell
        warnings.simplefilter("ignore", FutureWarning)
        _ORIGINALS["all_reduce"](bounds, op=dist.ReduceOp.MAX, group=group)
        highest, lowest = bounds.tolist()
        if highest != -lowest:
            mine = torch.tensor(fingerprint, dtype=torch.int64, device=tensor.device)
            every = torch.empty(world * mine.numel(), dtype=torch.int64, device=tensor.device)
            _ORIGINALS["all_gather_into_tensor"](every, mine, group=group)
    if highest == -lowest:
        return original(*args, **kwargs)  # the user's own call, with the warnings it gives
    _mismatch(torch, every.view(world, -1).cpu().tolist(), ranks)


def _mismatch(torch, rows, ranks):
    """Raise the error for ranks whose fingerprints ``rows`` (in ``ranks`` order) differ: the same text on every rank."""
    ops = sorted({_OPS[row[0]] for row in rows})  # the same text on every rank: one error, not several
    # one collective named with different roots or reduce ops: those are shown (different collectives differ anyway)
    roots, reduce_ops = (len(ops) == 1 and len({row[i] for row in rows}) > 1 for i in (4 + _DIMS, 5 + _DIMS))
    seen = "; ".join(f"rank {r}: {_describe(torch, row, roots, reduce_ops)}" for r, row in zip(ranks, rows))
    tensors = {tuple(row[1:4 + _DIMS]) for row in rows}  # dtype and shape, apart from root and reduce op
    what = "the ranks called different collectives" if len(ops) > 1 else \
        f"dist.{ops[0]} got different {'tensors' if len(tensors) > 1 else 'arguments'} on different ranks"
    raise CollectiveMismatchError(
        f"{what} ({seen}). Every rank must call the same collective with a tensor of the same shape and "
        "dtype (gloo would abort the engine or return a wrong result)")


_ORIGINALS: dict = {}
_WRAPPED: dict = {}  # (op, id(original)) -> (original, its checked wrapper), see _wrapped
#: ``{"call": (op, shape)}`` while a collective called from cell code runs on this rank.
CURRENT: dict = {}
#: Bumped by every checked collective call and every training micro-step (:mod:`distnb.engine.train.stepping`):
#: a rank whose count moved has moved on, even when each look finds it at the same line
#: (:class:`distnb.engine.process.where.Watchdog` restarts its "since" then).
PROGRESS = [0]
#: While a cell runs: ``"ranks"``, those it runs on when not all (``%%dist --targets``), ``"unchecked"``
#: (``--unchecked``), and ``"off"``: nothing to check (``--unchecked`` on every rank); empty between cells.
SUBSET: dict = {}


@contextlib.contextmanager
def checked(only=None, off=False, timeout=None, training=False):
    """While active, collectives called from cell code check their tensors across ranks first.

    ``only``: the ranks running the cell when not all of them (``%%dist --targets``); a
    collective called then on a group with other ranks raises at once instead of waiting.
    ``off``: no fingerprint check (``--unchecked``: each check is a collective of its own, about
    the latency of the call it guards; a loop of small all-reduces took 1.6-1.7x as long checked);
    with ``only``, a collective on a group beyond those ranks is still an error. The checked
    versions stand in ``torch.distributed`` then too, passing each call straight on, so that a name
    the cell binds to one (``ar = dist.all_reduce``) is checked when a later cell calls it. ``timeout``
    (seconds): the world's, which groups the cell makes take unless it gives one (:func:`_tracked_group`).
    ``training``: a ``%%distrain`` body, whose ranks meet DDP's (or FSDP's, or distnb's) collectives
    between their own: each checked call first waits in the store for every rank of its group
    (:mod:`distnb.engine.process.arrival`), so a call some ranks skip is a hang the kernel names, not gloo's abort.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or _ORIGINALS:  # nothing to check, or already active
        yield
        return
    import torch

    _ORIGINALS.update({op: getattr(dist, op) for op in (*_OPS, "new_group")})
    SUBSET.update(ranks=only, unchecked=off, off=off and only is None, arrival=training, timeout=timeout)
    try:
        for op in _OPS:
            setattr(dist, op, _wrapped(dist, torch, op, _ORIGINALS[op]))
        dist.new_group = _tracked_group(_ORIGINALS["new_group"], timeout)
        yield
    finally:
        for op, fn in _ORIGINALS.items():
            setattr(dist, op, fn)
        _ORIGINALS.clear()
        SUBSET.clear()


def _tracked_group(new_group, timeout=None):
    """``dist.new_group`` as a cell calls it: its gloo connections armed with the world's, and ``--timeout`` for its
    collectives unless the cell gives one (torch's default is 30 minutes).

    A rank waiting in such a group's collective for a rank that never came waited out that timeout, since
    ending the hang (or a failure) closed the world's connections only; the cell could not be interrupted and
    the next one hung too (:func:`distnb.engine.process.abort.tracking`).
    """


    @functools.wraps(new_group)
    def made(*args, **kwargs):
        if "timeout" not in kwargs and len(args) < 2 and timeout:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout)
        with abort.tracking():
            group = new_group(*args, **kwargs)
        binding.float_gloo()  # its gloo threads, as the world's (engine/binding.py)
        return group

    return made
