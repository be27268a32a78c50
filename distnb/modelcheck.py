"""Kernel side: what a notebook model must be before it can be sent to the ranks.

A model with lazy modules (``torch.nn.LazyLinear``, ``LazyConv2d``, ``LazyBatchNorm1d``, ...) whose
first forward has not run holds uninitialized parameters: they have no shape, so they can be
neither fingerprinted nor sent, and each rank initializing its own on its own first batch would
start the replicas from different weights. torch's own error came from distnb's fingerprint,
as a traceback through distnb's internals.
"""

from __future__ import annotations

from .errors import PlanError


def uninitialized(module) -> list:
    """Names (state-dict keys) of ``module``'s parameters and buffers that lazy modules have not initialized yet."""
    from torch.nn.parameter import UninitializedTensorMixin

    return [name for name, t in module.state_dict(keep_vars=True).items() if isinstance(t, UninitializedTensorMixin)]


def check_initialized(name: str, module) -> None:
    """PlanError naming the uninitialized tensors of ``module`` (the notebook's ``name``) and the fix."""
    lazy = uninitialized(module)
    if not lazy:
        return
    shown = ", ".join(lazy[:4]) + (f" and {len(lazy) - 4} more" if len(lazy) > 4 else "")
    kinds = sorted({type(m).__name__ for m in module.modules() if type(m).__name__.startswith("Lazy")})
    raise PlanError(f"--model {name} has uninitialized parameters ({shown}{': ' if kinds else ''}{', '.join(kinds)} "
                    f"not yet run): run one forward pass in the notebook first, e.g. `{name}(x)` on a batch of the "
                    "data, so that they get their shapes and every rank starts from the same weights")
