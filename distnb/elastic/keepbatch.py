"""``%dist scale N --keep-global-batch``: which models keep their global batch, and until when.

The keeping applies to the models live when the world was scaled (the same notebook objects: a model
made later, or a new object bound to a live model's name, trains its batch options as written), each
with the world its cells' ``--batch-size`` and ``--accumulate`` are written for; a later ``%dist scale``
without the flag ends it, at the world's own size too. The rewrite of a cell's options is
:func:`distnb.elastic.scaling.batch_for_world`'s (it says so on every cell it changes).
"""

from __future__ import annotations

import weakref


def after_scale(session, old: int, keep: bool) -> list:
    """After a scale from ``old`` ranks: with ``keep``, the models live now keep their global batch (a model kept
    from an earlier scale keeps its world); without, the keeping ends. Returns the models whose keeping ended."""
    held = session.holdings
    if not keep:
        return end(session)
    kept = {}
    for name in held.models:
        obj = session.ns.get(name)
        if obj is None:
            continue
        was = held.batch_world.get(name)
        kept[name] = was if was is not None and was[1]() is obj else (old, weakref.ref(obj))
    held.batch_world = kept
    return []


def end(session) -> list:
    """End ``--keep-global-batch``; the models it applied to."""
    ended = sorted(k for k in session.holdings.batch_world if k is not None)
    session.holdings.batch_world = {}
    return ended


def ended_note(models: list) -> str:
    """The sentence that says the keeping ended for ``models`` ("" for none)."""
    return (f"; --keep-global-batch ended for {', '.join(models)}: the next cells' --batch-size and --accumulate "
            "are per rank as written") if models else ""


def kept_models(session) -> list:
    """The models whose cells ``--keep-global-batch`` rewrites (live at the scale, the same notebook object)."""
    return sorted(k for k, (_, obj) in session.holdings.batch_world.items()
                  if k is not None and obj() is not None and obj() is session.ns.get(k))
