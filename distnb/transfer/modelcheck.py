"""Kernel side: what a notebook model must be before it can be sent to the ranks, and the fix when its
data's dtype is not its parameters' (:func:`dtype_hint`).

A model with lazy modules (``torch.nn.LazyLinear``, ``LazyConv2d``, ``LazyBatchNorm1d``, ...) whose
first forward has not run holds uninitialized parameters: they have no shape, so they can be
neither fingerprinted nor sent, and each rank initializing its own on its own first batch would
start the replicas from different weights. torch's own error came from distnb's fingerprint,
as a traceback through distnb's internals.
"""

from __future__ import annotations

import re

from distnb.core.errors import PlanError


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


#: What torch says when a batch's dtype is not the parameters' (F.linear, conv, matmul, the losses)
_DTYPE_CLASH = re.compile(r"same dtype|expected scalar type|Found dtype|should be the same|Expected .*dtype", re.I)


def dtype_hint(exc, plan, model_obj, data_obj, sample: str = "") -> str:
    """The fix when a step failed on a dtype clash between float64 data (numpy's default) and a model of
    another floating dtype, or between float32 data and a model cast to bfloat16/float16, else ''.

    ``sample``: how sample 0 of a Dataset sent by value looked (``samples like (float64[5], int)``), whose
    ``__getitem__`` the kernel does not call again.
    """
    import numpy as np

    if not _DTYPE_CLASH.search(str(exc.evalue)) or data_obj is None or not hasattr(model_obj, "parameters"):
        return ""
    parts = data_obj.values() if isinstance(data_obj, dict) else data_obj if isinstance(data_obj, (tuple, list)) \
        else getattr(data_obj, "tensors", None) or [data_obj]  # a TensorDataset's columns
    double = [p for p in parts if str(getattr(p, "dtype", "")) in ("float64", "torch.float64")]
    params = {str(p.dtype).removeprefix("torch.") for p in model_obj.parameters() if p.is_floating_point()}
    if not params or params == {"float64"}:
        return ""
    if not double and "float64[" in sample:  # a Dataset: np.random.randn, pandas' .values, np.load of floats
        return (f"--data {plan.data}'s samples are {sample.removeprefix('samples like ')}, float64 (numpy's default "
                f"for floats), and {plan.model}'s parameters are {', '.join(sorted(params))}: return float32 from "
                "__getitem__ (x.astype(np.float32), torch.as_tensor(x, dtype=torch.float32)), or convert the batch in "
                "the step (x = x.float())")
    low = params & {"bfloat16", "float16"}
    if not double and low and any(str(getattr(p, "dtype", "")) in ("torch.float32", "float32") for p in parts):
        return (f"{plan.model}'s parameters are {', '.join(sorted(params))} and --data {plan.data} holds float32: to "
                f"train in {min(low)}, keep the model float32 and pass --precision {'bf16' if 'bfloat16' in low else 'fp16'}"
                " (autocast: the parameters, the optimizer state and the weights that come back stay float32), or "
                f"convert the batch in the step (x = x.to(torch.{min(low)}))")
    if not double:
        return ""
    held, fix = (("float64 arrays (numpy's default for floats)", "X.astype(np.float32)")
                 if any(isinstance(p, np.ndarray) for p in double) else ("float64 tensors", "X.float()"))
    return (f"--data {plan.data} holds {held} and {plan.model}'s parameters are {', '.join(sorted(params))}: "
            f"convert the data once in the notebook ({fix}), or the batch in the step (x = x.float())")
