"""The wire format for tensors between the kernel and the ranks.

A tensor travels as a small description ``(dtype, shape, requires_grad, is_param)``
plus one flat ``uint8`` numpy array that ipyparallel sends as a zero-copy buffer
(no pickling of tensor data). Objects that *contain* tensors (a model, a data set)
travel as a pickle whose tensors are replaced by persistent ids, with the tensor
buffers alongside (see :mod:`distnb.transfer` for the kernel side).
"""

from __future__ import annotations

import io
import pickle
import warnings

import torch


def describe(t: torch.Tensor) -> tuple:
    """The description of a tensor: (dtype name, shape tuple, requires_grad, is_param)."""
    return (str(t.dtype).removeprefix("torch."), tuple(t.shape), bool(t.requires_grad),
            isinstance(t, torch.nn.Parameter))


def to_buffer(t: torch.Tensor):
    """A flat uint8 numpy view of ``t``'s bytes (a copy only if t is on a GPU or not contiguous)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def from_buffer(desc: tuple, buf, copy: bool = True) -> torch.Tensor:
    """Rebuild a tensor from :func:`describe` and :func:`to_buffer` output.

    ``copy=False`` wraps the (possibly read-only) received buffer without copying; only
    use that for tensors that are read, never written.
    """
    dtype_name, shape, requires_grad, is_param = desc
    dtype = getattr(torch, dtype_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only zmq buffers
        raw = torch.frombuffer(buf, dtype=torch.uint8) if len(memoryview(buf).cast("B")) else torch.empty(0, dtype=torch.uint8)
    if copy:
        raw = raw.clone()
    t = raw.view(dtype).reshape(shape)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


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


def loads(payload: bytes, descs, buffers):
    """Load an object packed by :func:`distnb.transfer.pack` (tensors rebuilt, writable)."""
    tensors = [from_buffer(d, b) for d, b in zip(descs, buffers)]
    return _Unpickler(io.BytesIO(payload), tensors).load()


def flatten_state(state: dict):
    """Pack a state_dict into (keys, descriptions, one flat uint8 array) for one message."""
    import numpy as np

    keys = list(state)
    descs = [describe(state[k]) for k in keys]
    parts = [to_buffer(state[k]) for k in keys]
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)
    return keys, descs, [len(p) for p in parts], flat


def unflatten_state(keys, descs, sizes, flat) -> dict:
    """Inverse of :func:`flatten_state`; the tensors are read-only views of ``flat``."""
    out, offset = {}, 0
    for k, d, n in zip(keys, descs, sizes):
        out[k] = from_buffer(d[:2] + (False, False), flat[offset:offset + n], copy=False)
        offset += n
    return out


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
