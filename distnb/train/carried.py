"""What carries from a model's last cell to its next, said where a user looks (kernel side, stdlib only).

Options declared ``carry`` (and those of how a model is distributed) keep their last value for the
model's next cell when a cell leaves them out (:func:`distnb.core.carryover.carry_over`); a new object bound
to the model's name starts from the defaults. Both are easy to miss in a cell's printed lines, so
the dashboard's header names this cell's carried options (and what a new object dropped), and
``%dist status`` lists each model's carried settings under its table.
"""

from __future__ import annotations

from distnb.core import options
from distnb.core.plan import TrainPlan


def flags(values: dict) -> str:
    """``--optimizer adam, --precision bf16``: option values as a cell would give them (declaration order)."""
    shown = []
    for f, opt in options.declared(TrainPlan):
        if f.name not in values:
            continue
        value = values[f.name]
        flag = options.flags_of(f, opt)[0]
        if value is True:
            shown.append(flag)
        elif value is False:
            shown.append("--no-" + flag[2:])
        else:
            shown.append(f"{flag} {','.join(map(str, value)) if isinstance(value, tuple) else value}")
    return ", ".join(shown)


def non_default(values: dict) -> dict:
    """The entries of ``values`` (carried options) that differ from their declared default (None: not chosen)."""
    defaults = {f.name: f.default for f, _ in options.declared(TrainPlan)}
    return {k: v for k, v in values.items() if v is not None and k in defaults and v != defaults[k]}


def cell_sentence(model: str, kept: dict, dropped: dict) -> str:
    """The dashboard header's words on this cell's carried options; ``""`` when nothing carried or was dropped.

    Parameters
    ----------
    model : str
        The ``--model`` name.
    kept : dict
        Options this cell left out that took the model's last cell's value (:func:`distnb.core.carryover.carry_over`).
    dropped : dict
        Options a new object bound to ``model`` did not take from the old object's cells.
    """
    parts = []
    kept = non_default(kept)
    if kept:
        parts.append(f"carried from {model}'s last cell: {flags(kept)}")
    dropped = non_default(dropped)
    if dropped:
        parts.append(f"{model} is a new object: {flags(dropped)} not carried (defaults used)")
    return "; ".join(parts)


def status_notes(carried: dict) -> list:
    """``%dist status``'s lines under the table: each model's settings its next cell takes when it leaves them out.

    ``carried``: :attr:`distnb.train.holdings.Holdings.carried` (model name -> carried option values).
    """
    lines = []
    for model, values in sorted(carried.items()):
        chosen = non_default(values)
        if chosen:
            lines.append(f"{model}'s next cell carries {flags(chosen)} (give another value to change it; "
                         f"a new object bound to {model} starts from the defaults)")
    return lines
