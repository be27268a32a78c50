"""What a model's code is and the notebook globals it reads, as the ranks got them: part of the model's fingerprint.

A class defined in the notebook travels to the ranks by value (cloudpickle): its methods' code, and with it the
values of the globals its methods read (``TEMP`` in ``return self.l(x) / TEMP``), and, by value
too, the notebook functions and classes they call, with theirs. Those are fixed on the
ranks when the model is sent, so a method replaced in the notebook afterwards (``M.forward = lambda self, x: ...``,
a new ``def`` assigned to the class, other defaults or decorators), a global changed (``TEMP = 100.0``) or
a helper function defined again would leave the ranks computing something else than the
kernel's model. :func:`digest` is what would be captured now; a change in it makes the
model's fingerprint (:func:`distnb.transfer.transfer.fingerprint`) change, and the model is sent again.

What is compared: a function by its code (bytecode, constants, names and nested code objects; not its file
or line numbers, so a cell run again from the same source is no change), its defaults and keyword defaults,
the contents of its closure cells and its attributes (``__wrapped__`` of ``functools.wraps``: a decorator
is its wrapper's code plus what the wrapper closes over), and the globals it reads, in turn; staticmethod,
classmethod, property, ``functools.partial`` and objects with ``__wrapped__`` (``functools.lru_cache``) by
what they wrap. Plain values (numbers, strings, ``None``, tuples/lists/dicts/sets of them, nested,
up to :data:`MAX_ITEMS` items in all) by value, and small objects holding only such values (a dataclass,
``SimpleNamespace``) by their fields; tensors and arrays by identity and (tensors) version; classes pickled by
value by their members (a class's other attributes too: ``SCALE = 1.0`` in its body); everything else
(modules, library objects) by identity. Mirrors cloudpickle's rule for what goes by value:
objects of ``__main__`` or of a module not importable by name (``sys.modules``).

:func:`module_state` does the same for what a model object carries besides its tensors, which travels
with it too: each submodule's own attributes (``net.act = torch.tanh``, ``net.cfg["scale"] = 3``) and the
hooks registered on it (``register_forward_hook``, removed or added).
"""

from __future__ import annotations

import functools
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


def digest(classes) -> tuple:
    """What the notebook-defined ``classes`` (a model's module types) are, as now: per class (by its qualified
    name, in that order) each member's digest: methods by their code, defaults, closure, decorators and the
    globals they read (:func:`of_value`); a class defined again from the same source gives the same digest."""
    seen: set = set()
    ordered = sorted((c for c in classes if by_value(c)), key=lambda c: (c.__module__ or "", c.__qualname__))
    return tuple((c.__qualname__, _of_class(c, seen, DEPTH)) for c in ordered)


def patched_library_members(classes) -> list:
    """Members of importable (library) classes among ``classes`` and their bases that the notebook replaced with
    its own code (``nn.Linear.forward = my_forward``), as ``"torch.nn.Linear.forward"``.

    cloudpickle sends such a class by reference: a rank imports torch's own ``nn.Linear`` and never sees the
    notebook's replacement, so the ranks would compute something else than the kernel's model.
    """
    found = []
    for cls in classes:
        for klass in cls.__mro__:
            if klass is object or by_value(klass):
                continue
            for name, member in vars(klass).items():
                try:
                    fn = getattr(member, "__func__", getattr(member, "fget", member))
                    fn = getattr(fn, "__wrapped__", fn)
                except Exception:  # a descriptor whose attribute lookup raises: not notebook code
                    continue
                if isinstance(fn, types.FunctionType) and by_value(fn):
                    where = f"{klass.__module__.split('.modules.')[0]}.{klass.__qualname__}.{name}"
                    if where not in found:
                        found.append(where)
    return found


def library_patches(model) -> list:
    """:func:`patched_library_members` of the classes of ``model``'s modules."""
    return patched_library_members({type(m) for m in model.modules()})


def library_patch_warning(name: str, model) -> str:
    """The sentence that says the ranks compute ``model`` (notebook name ``name``) without the notebook's
    replacements in its library classes (:func:`library_patches`), and what to do."""
    patched = library_patches(model)
    return (f"{', '.join(patched)} {'was' if len(patched) == 1 else 'were'} replaced in the notebook, but {name}'s "
            "library classes reach the ranks by reference (imported there, as their library defines them), so "
            "the ranks compute without the replacement: subclass the class in the notebook (a notebook class "
            "travels by value), or make the same change on the ranks in a %%dist cell")


def changed_members(before: tuple, after: tuple) -> list:
    """The class members (``"MLP.forward"``) whose own definition differs between two :func:`digest`: its code,
    defaults, closure or decorators, not only a global it reads."""
    if [name for name, _ in before] != [name for name, _ in after]:
        return []
    said = []
    for (cls, old), (_, new) in zip(before, after):
        old, new = dict(old), dict(new)
        for member in sorted(set(old) | set(new)):
            a, b = old.get(member), new.get(member)
            if a != b and (_is_code_digest(a) or _is_code_digest(b)) and _strip_globals(a) != _strip_globals(b):
                said.append(member if "." in member else f"{cls}.{member}")  # a base's: Base.forward
    return said


_CODE_KINDS = frozenset({"function", "library function", "staticmethod", "classmethod", "property", "partial",
                         "partialmethod", "cached_property", "method", "wrapper"})


def _is_code_digest(value) -> bool:
    return isinstance(value, tuple) and bool(value) and isinstance(value[0], str) and value[0] in _CODE_KINDS


def _strip_globals(value):
    """A member's digest without the values of the globals its functions read (their names stay)."""
    if isinstance(value, tuple) and value[:1] == ("function",) and len(value) == 7:
        return value[:2] + tuple(_strip_globals(v) for v in value[2:-1]) + (tuple(n for n, _ in value[-1]),)
    if isinstance(value, tuple):
        return tuple(_strip_globals(v) for v in value)
    return value


def of_value(value):
    """A hashable digest of ``value`` as the ranks would get it by value (see the module docstring)."""
    return _of_value(value, set(), DEPTH)


def _of_class(cls, seen, depth) -> tuple:
    if id(cls) in seen or depth < 0:
        return (("seen", cls.__qualname__),)
    seen.add(id(cls))
    out = []
    for klass in cls.__mro__:  # notebook base classes too (their members as Base.name); library ones by name
        if klass is object:
            continue
        if not by_value(klass):
            out.append(("base", (klass.__module__, klass.__qualname__)))
            continue
        for name, member in sorted(vars(klass).items()):
            if name in _CLASS_BOOKKEEPING:
                continue
            if _is_code(member) or not (name.startswith("__") and name.endswith("__")):  # SCALE = 1.0 too
                out.append((name if klass is cls else f"{klass.__qualname__}.{name}", _of_value(member, seen, depth)))
    return tuple(out)


#: Entries of a class's ``__dict__`` that Python or the notebook's re-run sets anew, not the user's definition.
_CLASS_BOOKKEEPING = frozenset({"__module__", "__dict__", "__weakref__", "__doc__", "__qualname__",
                                "__firstlineno__", "__static_attributes__", "__annotations__", "__slotnames__",
                                "_abc_impl", "__parameters__", "__orig_bases__"})


def _is_code(member) -> bool:
    """Whether ``member`` of a class is a function or wraps one (a method, property, decorator's result)."""
    return isinstance(member, (types.FunctionType, staticmethod, classmethod, property, functools.partialmethod,
                               functools.partial, functools.cached_property)) or _wraps(member)


def _of_function(fn, seen, depth) -> tuple:
    """A function as cloudpickle sends it by value: its code (bytecode, constants, names, nested code), defaults,
    closure cells, attributes (``__wrapped__`` of ``functools.wraps``) and the globals its code reads."""
    if id(fn) in seen or depth < 0:
        return ("function", ("seen", fn.__qualname__))
    seen.add(id(fn))
    code = fn.__code__
    found = fn.__globals__
    cells = tuple(_of_value(_cell(c), seen, depth - 1) for c in (fn.__closure__ or ()))
    attrs = tuple((k, _of_value(v, seen, depth - 1)) for k, v in sorted(vars(fn).items()))
    return ("function", _of_code(code), _of_value(fn.__defaults__, seen, depth - 1),
            _of_value(fn.__kwdefaults__, seen, depth - 1), cells, attrs,
            tuple((n, _of_value(found[n], seen, depth - 1)) for n in sorted(_names(code)) if n in found))


_EMPTY = ("empty cell",)


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled (a name the enclosing function assigns later)
        return _EMPTY


def _of_code(code) -> tuple:
    """A code object by what it does: bytecode, constants (nested code by the same), names, argument layout.
    Not its file name or line numbers, which a re-run of the same cell changes."""
    consts = tuple(_of_code(c) if isinstance(c, types.CodeType) else (type(c).__name__, repr(c))
                   for c in code.co_consts)
    return (code.co_name, code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars,
            code.co_cellvars, code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)


def _names(code) -> set:
    """The global names ``code`` and the functions nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _of_callable(value, seen, depth):
    """A method wrapper, property, partial or decorated callable by what it wraps; None for anything else."""
    if isinstance(value, (staticmethod, classmethod)):
        return (type(value).__name__, _of_value(value.__func__, seen, depth))
    if isinstance(value, property):
        return ("property",) + tuple(_of_value(f, seen, depth) for f in (value.fget, value.fset, value.fdel))
    if isinstance(value, (functools.partial, functools.partialmethod)):
        return (type(value).__name__, _of_value(value.func, seen, depth), _of_value(value.args, seen, depth),
                _of_value(value.keywords, seen, depth))
    if isinstance(value, functools.cached_property):
        return ("cached_property", _of_value(value.func, seen, depth))
    if isinstance(value, types.MethodType):  # a bound method: its function and the object it is bound to
        return ("method", _of_value(value.__func__, seen, depth), _of_value(value.__self__, seen, depth))
    if not isinstance(value, type) and _wraps(value) and not _is_tensor(value):
        # a decorator's callable object (functools.lru_cache, a library wrapper): its type and what it wraps
        return ("wrapper", id(type(value)), _of_value(value.__wrapped__, seen, depth))
    return None


def _wraps(value) -> bool:
    """Whether ``value`` has ``__wrapped__`` (a decorator's result); False for an object whose attribute lookup
    raises (a proxy's ``__getattr__``): a fingerprint never fails on the model's code."""
    try:
        return hasattr(value, "__wrapped__")
    except Exception:
        return False


def _is_tensor(value) -> bool:
    return hasattr(value, "_version") and hasattr(value, "data_ptr")


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
    if isinstance(value, (tuple, list)) and depth >= 0:  # (fn, 2): items read through, functions by their code
        return (type(value).__name__,) + tuple(_of_value(v, seen, depth - 1) for v in value)
    if isinstance(value, types.FunctionType) and by_value(value):
        return _of_function(value, seen, depth)
    if isinstance(value, types.FunctionType) and value.__closure__ and depth >= 0:
        # a library decorator's wrapper (torch.no_grad()'s): its code is the library's, what it closes over is ours
        return ("library function", id(value.__code__), tuple(_of_value(_cell(c), seen, depth - 1)
                                                             for c in value.__closure__))
    if isinstance(value, type) and by_value(value):
        return ("class", value.__qualname__, _of_class(value, seen, depth))
    wrapped = _of_callable(value, seen, depth - 1) if depth >= 0 else None
    if wrapped is not None:
        return wrapped
    settings = _settings(value)
    if settings is not None:  # a small settings object (a dataclass, SimpleNamespace, a no_grad()): its fields
        return ("instance", id(type(value)), settings)
    version = getattr(value, "_version", None)  # a tensor: written in place is a change too
    return ("object", id(value), version if isinstance(version, int) else None)


def _settings(value):
    """The fields of an object that holds plain values only (``vars()``), as a tuple; None for any other object."""
    if isinstance(value, (type, types.ModuleType)) or _is_tensor(value):
        return None
    held = getattr(value, "__dict__", None)
    if not isinstance(held, dict) or not held:
        return None
    try:
        return _plain(held, [MAX_ITEMS])
    except _NotPlain:
        return None


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
