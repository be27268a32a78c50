"""The notebook globals a model's code reads, as the ranks got them: part of the model's fingerprint.

A class defined in the notebook travels to the ranks by value (cloudpickle), and with it the
values of the globals its methods read (``TEMP`` in ``return self.l(x) / TEMP``), and, by value
too, the notebook functions and classes they call, with theirs. Those values are fixed on the
ranks when the model is sent, so a global changed in the notebook afterwards (``TEMP = 100.0``,
a helper function defined again) would leave the ranks computing something else than the
kernel's model. :func:`digest` is a hash of what would be captured now; a change in it makes the
model's fingerprint (:func:`distnb.transfer.fingerprint`) change, and the model is sent again.

What is compared: plain values (numbers, strings, ``None``, tuples/lists/dicts/sets of them, nested,
up to :data:`MAX_ITEMS` items in all) by value; tensors and arrays by identity and (tensors) version; functions
and classes pickled by value by what they capture in turn (a class's other attributes too: ``SCALE = 1.0`` in its
body); everything else (modules, library objects) by identity. Mirrors cloudpickle's rule for what goes by value:
objects of ``__main__`` or of a module not importable by name (``sys.modules``).

:func:`module_state` does the same for what a model object carries besides its tensors, which travels
with it too: each submodule's own attributes (``net.act = torch.tanh``, ``net.cfg["scale"] = 3``) and the
hooks registered on it (``register_forward_hook``, removed or added).
"""

from __future__ import annotations

import sys
import types

_PLAIN = (int, float, complex, str, bytes, bool, type(None))
#: How deep calls from the model's methods into other notebook functions are followed.
DEPTH = 4
#: Containers of more items than this are compared by identity and length, not item by item.
MAX_ITEMS = 256


def by_value(obj) -> bool:
    """Whether cloudpickle sends ``obj`` (a function or class) by value rather than by reference."""
    module = getattr(obj, "__module__", None)
    return module == "__main__" or module is None or module not in sys.modules


def digest(classes) -> int:
    """A hash of the globals the notebook-defined ``classes`` (a model's module types) read, as now."""
    seen: set = set()
    return hash(tuple(_of_class(c, seen, DEPTH) for c in classes if by_value(c)))


def of_value(value):
    """A hashable digest of ``value`` as the ranks would get it by value (see the module docstring)."""
    return _of_value(value, set(), DEPTH)


def _of_class(cls, seen, depth) -> tuple:
    if id(cls) in seen or depth < 0:
        return ()
    seen.add(id(cls))
    out = []
    for klass in cls.__mro__:  # notebook base classes too
        if klass is object or not by_value(klass):
            continue
        for name, member in sorted(vars(klass).items()):
            fn = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(fn, types.FunctionType):
                out.append((name, _of_function(fn, seen, depth)))
            elif not (name.startswith("__") and name.endswith("__")):  # a class attribute: SCALE = 1.0
                out.append((name, _of_value(member, seen, depth - 1)))
    return tuple(out)


def _of_function(fn, seen, depth) -> tuple:
    if id(fn) in seen or depth < 0:
        return (id(fn),)
    seen.add(id(fn))
    names = _names(fn.__code__)
    found = fn.__globals__
    return tuple((n, _of_value(found[n], seen, depth - 1)) for n in sorted(names) if n in found)


def _names(code) -> set:
    """The global names ``code`` and the functions nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


class _NotPlain(Exception):
    """Raised by :func:`_plain` for a value that is not plain, or too large to read through."""


def _plain(value, budget: list):
    """``value`` as a hashable tuple when it is plain (numbers, strings, containers of them, nested).

    ``budget``: ``[items left]``. Raises :class:`_NotPlain` for anything else, or for containers of
    more items in all than the budget.
    """
    if isinstance(value, _PLAIN):
        return value
    if not isinstance(value, (tuple, list, frozenset, set, dict)):
        raise _NotPlain
    budget[0] -= len(value)
    if budget[0] < 0:
        raise _NotPlain
    if isinstance(value, dict):
        return ("dict", tuple(sorted(repr((_plain(k, budget), _plain(v, budget))) for k, v in value.items())))
    items = tuple(_plain(v, budget) for v in value)
    return (type(value).__name__, tuple(sorted(map(repr, items))) if isinstance(value, (set, frozenset)) else items)


def _of_value(value, seen, depth):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list, frozenset, set, dict)) and len(value) > MAX_ITEMS:
        return ("object", id(value), len(value))  # a large table: by identity and size, not read through
    try:
        return _plain(value, [MAX_ITEMS])
    except _NotPlain:
        pass
    if isinstance(value, types.FunctionType) and by_value(value):
        return ("function", id(value), _of_function(value, seen, depth))
    if isinstance(value, type) and by_value(value):
        return ("class", id(value), _of_class(value, seen, depth))
    version = getattr(value, "_version", None)  # a tensor: written in place is a change too
    return ("object", id(value), version if isinstance(version, int) else None)


def module_state(module) -> tuple:
    """What ``module`` and its submodules carry besides their tensors, as the ranks get it with them.

    Per submodule (by its qualified name): its type, its own attributes (plain values by value,
    functions by what they capture, other objects by identity: ``net.act = torch.tanh``,
    ``net.cfg["scale"] = 3``) and the hooks registered on it. Tensors and arrays kept as plain
    attributes are left out: a forward that caches its activations there (``self.last = out``) would
    make every evaluation in the notebook a change; a tensor the model computes with belongs in a
    buffer (``register_buffer``), which is part of the state the fingerprint compares.
    """
    import numpy
    import torch

    own, hooks = _module_internals(torch)
    arrays = (torch.Tensor, numpy.ndarray)
    out = []
    for name, sub in module.named_modules():
        held = vars(sub)
        attrs = [(key, _of_value(held[key], set(), DEPTH)) for key in sorted(held.keys() - own)
                 if not isinstance(held[key], arrays)]
        for key in hooks:  # hooks: which, and what their code reads
            registered = held.get(key)
            if registered:
                attrs.append((key, tuple((i, _of_value(h, set(), DEPTH)) for i, h in registered.items())))
        out.append((name, id(type(sub)), tuple(attrs)))
    return tuple(out)


_INTERNALS: list = []


def _module_internals(torch) -> tuple:
    """The keys ``torch.nn.Module.__init__`` puts in every module's ``__dict__`` (its tensors, children, hooks,
    mode), and those of them that hold hooks (dicts)."""
    if not _INTERNALS:
        own = vars(torch.nn.Module())
        _INTERNALS.append((frozenset(own), tuple(k for k, v in own.items() if "hook" in k and isinstance(v, dict))))
    return _INTERNALS[0]


def changed_part(before: tuple, after: tuple, most: int = 4) -> str:
    """The submodule attributes and hooks that differ between two :func:`module_state`, in words ('' if none;
    the first ``most``, then how many more)."""
    if len(before) != len(after):
        return "its submodules changed"
    said = []
    for (name, kind, attrs), (name2, kind2, attrs2) in zip(before, after):
        where = name or "the model"
        if (name, kind) != (name2, kind2):
            said.append(f"{where} is another module")
            continue
        old, new = dict(attrs), dict(attrs2)
        for key in sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)):
            if "hook" in key:
                kind = next(k for k in ("backward", "load_state_dict", "state_dict", "forward") if k in key)
                hook = "pre-hook" if "pre_hook" in key else "hook"
                said.append(f"a {kind.replace('_', ' ')} {hook} on {where} was added, removed or replaced")
            else:
                said.append(f"{where}'s attribute {key} changed" if name else f"the model's attribute {key} changed")
    more = f" and {len(said) - most} more" if len(said) > most else ""
    return ", ".join(said[:most]) + more
