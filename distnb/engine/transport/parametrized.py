"""Modules with ``torch.nn.utils.parametrize`` parametrizations travel by value like any other module.

``torch.nn.utils.parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal`` and
``register_parametrization`` swap a module's class for a generated subclass
(``ParametrizedLinear``) whose ``__getstate__`` refuses pickling ("only supported through
state_dict()"); ``copy.deepcopy`` works. Everything such a module holds pickles as usual: its
``parametrizations`` (a ``ModuleDict`` of ``ParametrizationList``: the original tensors, and the
parametrization modules with their state, e.g. spectral norm's power-iteration vectors), its
other parameters, buffers, children and attributes. So :func:`reduce` sends the module as its
class before the swap and its ``__dict__``, and :func:`rebuild` puts the swap back as
``register_parametrization`` makes it (torch's ``_inject_new_class`` and ``_inject_property``,
which ``register_parametrization`` itself calls): the same values, no ``right_inverse``
recomputed, so the ranks hold exactly the kernel's parametrized model.

Stdlib and torch only (the wire format uses it in both directions).
"""

from __future__ import annotations


def is_parametrized(obj) -> bool:
    """Whether ``obj`` is a module whose own tensors are parametrized (its class is torch's generated one)."""
    import torch
    from torch.nn.utils import parametrize

    return isinstance(obj, torch.nn.Module) and parametrize.is_parametrized(obj) and \
        type(obj).__name__.startswith("Parametrized")


def reduce(module) -> tuple:
    """The pickle reduction of a parametrized ``module``: ``(rebuild, (class before the swap, its __dict__))``."""
    return rebuild, (type(module).__bases__[0], dict(vars(module)))


def rebuild(cls, state: dict):
    """A module of ``cls`` holding ``state`` (its ``__dict__``), parametrized again as it was sent.

    Raises
    ------
    RuntimeError
        This torch has no ``_inject_new_class``/``_inject_property`` (internal to
        ``torch.nn.utils.parametrize`` since torch 1.9): naming the fix.
    """
    from torch.nn.utils import parametrize

    module = cls.__new__(cls)
    module.__dict__.update(state)
    try:
        inject_class, inject_property = parametrize._inject_new_class, parametrize._inject_property
    except AttributeError:
        raise RuntimeError(f"this torch cannot rebuild a parametrized {cls.__name__} (torch.nn.utils.parametrize "
                           "changed): remove its parametrizations before sending it "
                           "(torch.nn.utils.parametrize.remove_parametrizations)") from None
    inject_class(module)
    for name in module.parametrizations:
        inject_property(module, name)
    return module
