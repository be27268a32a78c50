"""What to run when ranks of a live world have a dead engine (``%dist scale``'s refusal, ``%dist status``), or one
the controller no longer has registered."""

from __future__ import annotations

from distnb.core.errors import ranks_named
from distnb.core.tables import count


def dead_rank_fix(dead, world: int, n: int) -> str:
    """The fix for the dead ranks ``dead`` of a world of ``world`` ranks, as a sentence.

    Parameters
    ----------
    dead : collection of int
        The ranks whose engine died.
    world : int
        The world's size now.
    n : int
        The size of the fresh world ``%dist restart -n`` is named with.

    Returns
    -------
    str
        ``Run %dist restart -n N ...`` (a fresh world, empty namespaces) and, when rank 0 lives, the
        ``%dist scale K`` below the first dead rank that goes on with what the ranks below it hold
        (naming the live ranks above it that it stops too).
    """
    first = min(dead)
    also = [r for r in range(first, world) if r not in dead]  # alive, but above a dead rank: a scale drops them too
    without = (f", or %dist scale {first} (session.scale({first})) to go on without "
               f"{'it' if len(dead) == 1 else 'them'}, keeping what {ranks_named(range(first))} "
               f"{'holds' if first == 1 else 'hold'}" + (f" (it stops {ranks_named(also)} too)" if also else "")
               ) if first else ""
    return (f"Run %dist restart -n {n} (session.restart(n={n})) for a fresh world of {count(n, 'rank')} (empty "
            f"namespaces){without}")


def unregistered_fix(n: int) -> str:
    """The fix for ranks whose engine runs but is no longer registered with the controller, as a sentence.

    Parameters
    ----------
    n : int
        The size of the fresh world ``%dist restart -n`` is named with (the world's size now).

    Returns
    -------
    str
        ``Run %dist restart -n N ...``: the controller does not take an engine back, and a rank it
        cannot reach cannot leave the process group, so a fresh world is the fix.
    """
    return (f"Run %dist restart -n {n} (session.restart(n={n})) for a fresh world of {count(n, 'rank')} (empty "
            "namespaces)")
