"""One module per strategy: ``apply_<strategy>(module, plan, device) -> wrapped model``."""

from __future__ import annotations


def wrap(module, plan, device):
    """Wrap ``module`` for ``plan.strategy`` (only ``ddp`` exists so far)."""
    if plan.strategy == "ddp":
        from .ddp import apply_ddp

        return apply_ddp(module, plan, device)
    raise ValueError(f"strategy {plan.strategy!r} is not available on the ranks yet")
