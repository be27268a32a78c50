"""``--mesh DPxTP`` when the world changes size: the tensor-parallel size stays, the data-parallel one follows.

An fsdp+tensor model's ``--mesh`` carries over between cells (it is how the model is
distributed), so after ``%dist scale N`` or an ``--on-failure shrink`` the value of the
model's last cell names a mesh of the old world. The split layers' slices depend on the
tensor-parallel size ``TP`` (each layer's split dimension must divide by it), while the
data-parallel size ``DP`` is only how many FSDP shards there are: so the world change keeps
``TP`` and sets ``DP = N / TP`` (the torchtitan convention of re-sizing the data-parallel
dimension of a job and keeping the model-parallel ones). DCP then reshards the saved
DTensors onto the new mesh (:func:`distnb.engine.train.checkpoint.load`). An ``N`` that ``TP`` does
not divide is refused, naming the sizes that work.

Kernel side, stdlib only.
"""

from __future__ import annotations

import dataclasses

from distnb.core.errors import PlanError
from distnb.core.plan import mesh_shape
from distnb.core.tables import count

STRATEGY = "fsdp+tensor"


def sizes_that_work(tp: int, n: int) -> list[int]:
    """World sizes near ``n`` that ``tp`` divides: the multiples of ``tp`` up to the first one above ``n``."""
    return [k * tp for k in range(1, n // tp + 2)][-4:]


def _source(mesh: str | None, old_world: int) -> int:
    """The world ``mesh`` was given for: ``DP * TP`` when it parses, else ``old_world`` (None: the default there)."""
    try:
        dp, tp = (int(v) for v in mesh.lower().split("x"))
    except (AttributeError, ValueError):
        return old_world
    return dp * tp if dp > 0 and tp > 0 else old_world


def refit(mesh: str | None, old_world: int, n: int, what: str) -> str:
    """``--mesh`` for ``n`` ranks with the tensor-parallel size of ``mesh``.

    Parameters
    ----------
    mesh : str or None
        ``DPxTP`` (of the world ``DP * TP`` it was given for), or None: :func:`distnb.core.plan.mesh_shape`'s
        default on ``old_world`` ranks.
    old_world, n : int
        World sizes (ranks) before and after.
    what : str
        How the message names the model and the change, e.g. ``"%dist scale 3: net"``.

    Returns
    -------
    str
        ``"{n // TP}x{TP}"``.

    Raises
    ------
    PlanError
        When ``TP`` does not divide ``n``, naming ``n``, ``TP`` and the sizes that work.
    """
    dp, tp = mesh_shape(mesh, _source(mesh, old_world))
    if n % tp:
        works = ", ".join(map(str, sizes_that_work(tp, n)))
        raise PlanError(f"{what} (--strategy {STRATEGY}, --mesh {dp}x{tp}) keeps its tensor-parallel size {tp} "
                        f"when the world changes size, and {tp} does not divide N = {n}: world sizes that work are "
                        f"multiples of {tp} ({works}, ...)")
    return f"{n // tp}x{tp}"


def plan_changes(plan: dict, old_world: int, n: int, what: str) -> dict:
    """TrainPlan fields (as a dict) that lay ``plan`` (a plan dict) out on ``n`` ranks: ``{"mesh": ...}`` or {}."""
    mesh = plan.get("mesh")
    if plan.get("strategy") != STRATEGY or _source(mesh, old_world) == n:
        return {}
    return {"mesh": refit(mesh, old_world, n, what)}


def plan_at(plan, old_world: int, n: int):
    """The TrainPlan ``plan`` (of a world of ``old_world``, or the one its ``--mesh`` names) laid out on ``n`` ranks.

    Raises PlanError (see :func:`refit`) when ``n`` does not fit the tensor-parallel size.
    """

    changes = plan_changes(plan.to_dict(), old_world, n, f"%dist scale {n}: {plan.model}")
    return dataclasses.replace(plan, **changes) if changes else plan


def carry(held, old_world: int, n: int) -> dict:
    """Rewrite the carried ``--mesh`` of each fsdp+tensor model for the world of ``n``: {model: new mesh}.

    ``held`` is the session's :class:`distnb.train.holdings.Holdings`. A mesh that already fits
    ``n`` (a model resharded onto it) stays; a model whose ``TP`` does not divide ``n`` keeps
    the mesh of its last cell (its next cell then says where it came from,
    :func:`carried_message`).
    """
    moved = {}
    for model, values in held.carried.items():
        mesh = values.get("mesh")
        if values.get("strategy") != STRATEGY or old_world == n:
            continue
        try:
            if mesh is not None:
                mesh_shape(mesh, n)
                continue  # already laid out for this world
        except PlanError:
            pass
        try:
            values["mesh"] = moved[model] = refit(mesh, old_world, n, model)
        except PlanError:
            continue
    return moved


def carried_message(model: str, mesh: str, world: int) -> str:
    """The error of a ``--mesh`` carried from ``model``'s last cell that does not fit this world of ``world`` ranks."""
    fits = " or ".join(f"{world // t}x{t}" for t in range(1, world + 1) if world % t == 0)
    try:
        dp, tp = (int(v) for v in mesh.lower().split("x"))
        then, back = f", on a world of {count(dp * tp, 'rank')}", f"%dist scale {dp * tp} to go back to it"
    except ValueError:
        then, back = "", "or %dist scale to a world it fits"
    return (f"--mesh {mesh} came from {model}'s last cell{then}, not from this one, and does not fit this world of "
            f"{count(world, 'rank')}: give this cell --mesh DPxTP with DP * TP = {world} (--mesh {fits}), or {back}")
