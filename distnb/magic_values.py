"""Option values a magic's line cannot hold: a Python expression where a notebook name goes.

``%%distrain --data (X, Y)`` was split at its spaces by IPython's argument parser, and the cell
said only "unrecognized arguments: Y)". Options that take an object take a notebook *name*
(the Python API, ``session.train(data=(X, Y))``, takes the object itself): the line is refused
with what to write instead.
"""

from __future__ import annotations

import functools
import re

from IPython.core.error import UsageError

from distnb.core import options
from distnb.core.plan import ClusterSpec, RunOptions, TrainPlan

#: A flag, then a value that opens a tuple, list, dict or call: ``--data (X, Y)``, ``--data=[X, Y]``.
_EXPRESSION = re.compile(r"(?:^|\s)(--?[A-Za-z][\w-]*)(?:\s+|=)([(\[{][^\n]*)")
_CLOSE = {"(": ")", "[": "]", "{": "}"}


@functools.lru_cache(maxsize=1)
def _name_flags() -> frozenset:
    """The flags of the options that take a notebook name (``--data``, ``--val-data``, ``--metric``, ...)."""
    return frozenset(flag for cls in (TrainPlan, RunOptions, ClusterSpec) for f, opt in options.declared(cls)
                     if opt.kind in ("name", "names") for flag in options.flags_of(f, opt))


def refuse_expressions(line: str) -> None:
    """UsageError for an option given a Python expression (``--data (X, Y)``), naming the fix.

    Raises
    ------
    UsageError
        ``--data takes the name of a notebook object, not an expression: bind it in a cell first
        (data_set = (X, Y)), then --data data_set``.
    """
    found = next((m for m in _EXPRESSION.finditer(line) if m.group(1) in _name_flags()), None)
    if found is None:
        return
    flag, rest = found.groups()
    depth, end = 0, len(rest)
    for i, ch in enumerate(rest):  # the expression: up to its matching closing bracket
        depth += (ch in _CLOSE) - (ch in _CLOSE.values())
        if depth == 0:
            end = i + 1
            break
    expression = rest[:end]
    name = flag.lstrip("-").replace("-", "_") + "_set" if flag in ("--data", "--val-data") else "value"
    raise UsageError(f"{flag} takes the name of a notebook object, not an expression ({flag} {expression}): bind it "
                     f"in a cell first, e.g. `{name} = {expression}`, then {flag} {name} (the Python API takes the "
                     f"object itself: session.train(..., {flag.lstrip('-').replace('-', '_')}={expression}))")
