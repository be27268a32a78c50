"""Which of a model's options carry over from its last training cell to the next (stdlib only).

The one rule (:func:`carry_over`): state the ranks keep between cells (how the model is distributed,
its optimizer) keeps the last cell's value when a cell leaves the option out; settings of one cell take
their defaults. :func:`not_carried` names the carried values a cell's strategy cannot take, which are
dropped. The options themselves are declared on :class:`~distnb.core.plan.TrainPlan`.
"""

from __future__ import annotations

from distnb.core import options
from distnb.core.plan import TrainPlan, strategy_refuses

#: The options that carry over between cells (see :func:`carry_over`).
CARRIED = options.carried_fields(TrainPlan)


def carry_over(last: dict | None, given: dict) -> dict:
    """The options a cell left out that keep the values of the model's last cell: the one rule.

    State carries, settings do not. How a model is distributed (``--strategy`` and the
    options of that strategy, ``--precision``, ``--compile``, ``--sync-bn``,
    ``--find-unused-parameters``: :data:`~distnb.core.plan.DISTRIBUTION`) and its optimizer (``--optimizer``)
    are state the ranks keep between cells, so a cell that leaves one out keeps the value of
    the model's last cell. The options of a strategy carry only while that strategy does: a
    cell that names another ``--strategy`` starts them afresh, and a carried value that the
    cell's strategy cannot take (``--precision bf16`` into ``--strategy pipeline``:
    :data:`~distnb.core.plan.STRATEGY_LIMITS`) is dropped too (:func:`not_carried` names those). The learning
    rate and ``--lr-schedule`` live on in the ranks' optimizer and scheduler in the same way
    (their default, None, means "keep the live one"). Every other option applies to its own
    cell alone and takes its default when left out.

    Parameters
    ----------
    last : dict or None
        :data:`CARRIED` field -> value of the model's last cell (None: no cell trained it yet).
    given : dict
        The options the cell gave (field names; a None for an option whose default is None
        counts as left out).

    Returns
    -------
    dict
        Field -> value for each carried option the cell left out (only values that are not
        the field's default).
    """
    return _carry(last, given)[0]


def not_carried(last: dict | None, given: dict) -> dict:
    """Field -> value of the model's last cell that :func:`carry_over` drops because the cell's strategy cannot
    take it (the cell left the option out, and named another ``--strategy``)."""
    return _carry(last, given)[1]


def _carry(last, given) -> tuple:
    """(kept, dropped): :func:`carry_over`'s and :func:`not_carried`'s values."""
    if not last:
        return {}, {}
    strategy = given.get("strategy") or last.get("strategy")
    kept = {}
    for f, opt in options.declared(TrainPlan):
        name = f.name
        if name not in CARRIED or given.get(name) is not None or last.get(name, f.default) == f.default:
            continue
        if not options.strategies_of(opt) or strategy in options.strategies_of(opt):
            kept[name] = last[name]
    dropped = {name: kept.pop(name) for name in strategy_refuses(strategy, kept)}
    return kept, dropped
