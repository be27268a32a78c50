"""The notebook globals a model's code reads, as the ranks got them: part of the model's fingerprint.

A class defined in the notebook travels to the ranks by value (cloudpickle), and with it the
values of the globals its methods read (``TEMP`` in ``return self.l(x) / TEMP``), and, by value
too, the notebook functions and classes they call, with theirs. Those values are fixed on the
ranks when the model is sent, so a global changed in the notebook afterwards (``TEMP = 100.0``,
a helper function defined again) would leave the ranks computing something else than the
kernel's model. :func:`digest` is a hash of what would be captured now; a change in it makes the
model's fingerprint (:func:`distnb.transfer.fingerprint`) change, and the model is sent again.

What is compared: plain values (numbers, strings, ``None``, tuples/lists/dicts/sets of up to
:data:`MAX_ITEMS` of them) by value; tensors and arrays by identity and (tensors) version; functions and classes pickled by
value by what they capture in turn; everything else (modules, library objects) by identity.
Mirrors cloudpickle's rule for what goes by value: objects of ``__main__`` or of a module not
importable by name (``sys.modules``).
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


def _of_value(value, seen, depth):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list, frozenset, set, dict)) and len(value) > MAX_ITEMS:
        return ("object", id(value), len(value))  # a large table: by identity and size, not read through
    if isinstance(value, (tuple, list, frozenset, set)) and all(isinstance(v, _PLAIN) for v in value):
        return (type(value).__name__, tuple(sorted(map(repr, value))) if isinstance(value, (set, frozenset))
                else tuple(value))
    if isinstance(value, dict) and all(isinstance(v, _PLAIN) for v in (*value, *value.values())):
        return ("dict", tuple(sorted(map(repr, value.items()))))
    if isinstance(value, types.FunctionType) and by_value(value):
        return ("function", id(value), _of_function(value, seen, depth))
    if isinstance(value, type) and by_value(value):
        return ("class", id(value), _of_class(value, seen, depth))
    version = getattr(value, "_version", None)  # a tensor: written in place is a change too
    return ("object", id(value), version if isinstance(version, int) else None)
