"""The whole model's forward, one module's tensors at a time: the tensor-plan check without the whole model.

The tensor-plan check (:mod:`~distnb.engine.strategies.tensor_check`) compares the split model's output
with the whole model's. The whole model is a skeleton on the meta device (no memory); during its
forward, a pre-hook on each module that owns parameters or buffers fills them with the split module's
tensors of the same names, gathered whole (``DTensor.full_tensor``, a collective: every rank runs the same
forward, so the gathers meet in the same order), and a hook after its forward puts the meta placeholders
back. A rank so holds its share plus one module's full tensors, never the whole model (it held the whole
state, gathered by ``get_model_state_dict(full_state_dict=True)``, before: 1.95x torchrun's peak for a
meta model under ``--strategy tensor`` in issue 34's benchmark).

A forward that reads a module's tensors outside that module's own call (``F.linear(x, self.emb.weight)``
in the parent) meets a meta tensor: :class:`NotLayered` is raised, alike on every rank, and the check
falls back to the whole model where it is small enough.

Idea: FSDP's own unit-by-unit all-gather around each forward (``torch.distributed.fsdp``), applied to a copy.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

#: Tensor methods that read a placeholder's description, not its values.
_DESCRIBE = {"__get__", "size", "dim", "numel", "element_size", "stride"}


class NotLayered(RuntimeError):
    """The whole model's forward cannot run one module at a time (a tensor read outside its module's call)."""


def _whole(t) -> torch.Tensor:
    """``t`` whole and detached: a DTensor's ``full_tensor()`` (a collective), else ``t``."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach()


class LayerByLayer:
    """Within ``with``: ``whole`` (a meta skeleton of ``split``) runs with each module's own tensors gathered
    from ``split`` just before that module's forward and dropped after it.

    Parameters
    ----------
    whole : torch.nn.Module
        The skeleton (:func:`~distnb.engine.strategies.tensor_check.skeleton`): parameters and persistent
        buffers on the meta device.
    split : torch.nn.Module
        The distributed module (DTensor parameters, or plain ones), with the same submodule names.
    """

    def __init__(self, whole, split):
        self.whole, self.split = whole, split
        self.handles = []
        #: ``transform(src, full)``: what the whole model takes of the split parameter ``src`` gathered into
        #: ``full`` (the check's moved weights, :class:`~distnb.engine.strategies.moved.MovedPerModule`); None: ``full``
        self.transform = None
        # fsdp+tensor: DTensor warns that a (_StridedShard, Shard) tensor takes two all-gathers, for every one
        self.log = logging.getLogger("torch.distributed.tensor._redistribute")
        self.level = self.log.level

    def __enter__(self):
        self.log.setLevel(logging.ERROR)
        for name, mod in self.whole.named_modules():
            own = [k for k, v in list(mod._parameters.items()) + list(mod._buffers.items())
                   if v is not None and v.is_meta]
            if own:
                placeholders = {k: getattr(mod, k) for k in own}
                self.handles.append(mod.register_forward_pre_hook(functools.partial(self._fill, name, own)))
                self.handles.append(mod.register_forward_hook(functools.partial(self._drop, placeholders),
                                                              always_call=True))
        return self

    def __exit__(self, *exc):
        self.log.setLevel(self.level)
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _fill(self, name, own, mod, args):
        try:
            live = self.split.get_submodule(name)
        except AttributeError:
            raise NotLayered(f"the split model has no submodule {name!r}") from None
        for key in own:
            src = live._parameters.get(key) if key in mod._parameters else live._buffers.get(key)
            if src is None or src.is_meta:
                raise NotLayered(f"{name}.{key} is not held by the split model")
            full = _whole(src)
            if key in mod._parameters:
                if self.transform is not None:
                    full = self.transform(src, full)
                mod._parameters[key] = torch.nn.Parameter(full, requires_grad=mod._parameters[key].requires_grad)
            else:
                mod._buffers[key] = full

    @staticmethod
    def _drop(placeholders, mod, args, out):
        for key, t in placeholders.items():
            if key in mod._parameters:
                mod._parameters[key] = t
            else:
                mod._buffers[key] = t


class _NoPlaceholders(TorchFunctionMode):
    """Raise :class:`NotLayered` when an op reads a meta tensor (a module's tensor outside its call).

    Ops mixing meta and CPU tensors do not always fail (``F.linear(cpu, meta)`` returns a CPU tensor of
    garbage), so the whole model's forward runs under this mode instead of trusting its outputs.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _DESCRIBE:
            for a in _pytree.tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and a.is_meta:
                    raise NotLayered(f"{getattr(func, '__name__', func)} read a tensor outside its module's call")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_placeholders():
    """Within: an op on a meta tensor raises :class:`NotLayered` (:class:`_NoPlaceholders`)."""
    with _NoPlaceholders():
        yield
