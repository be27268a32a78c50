"""The memory levers on the ranks (see :mod:`distnb.core.levers` for the options and their checks).

- ``--activation-checkpointing``: torch's composable ``checkpoint`` on each FSDP unit (fsdp,
  fsdp+tensor: ``--fsdp-units`` or the default units) or each block (ddp, tensor, ps: every child
  with parameters, a ``ModuleList``'s elements; the root when it has no such child). It wraps the
  module's forward in ``torch.utils.checkpoint`` (non-reentrant): only the block's inputs are kept
  for the backward, which runs its forward again. It keeps the module and its ``state_dict`` keys
  as they are (``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module``), and is applied before
  ``fully_shard`` or DDP wraps the module, as torchtitan does.
- ``--offload cpu``: FSDP2's ``CPUOffloadPolicy`` (pinned host memory on GPU ranks).
- ``--param-dtype bf16``: FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
  reduce_dtype=torch.float32)``; ``--precision bf16/fp16`` (autocast) gives the same policy for fsdp.
"""

from __future__ import annotations

import torch

from distnb.engine.strategies import is_container

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def blocks(module, prefix: str = "") -> list[str]:
    """The blocks ``--activation-checkpointing`` recomputes for ddp, tensor and ps: the children with
    parameters, a ``ModuleList``'s or ``ModuleDict``'s elements in its place (FSDP's default units,
    :func:`~distnb.engine.strategies.fsdp.default_units`)."""
    names = []
    for name, child in module.named_children():
        if not any(True for _ in child.parameters()):
            continue
        names += blocks(child, f"{prefix}{name}.") if is_container(child) else [prefix + name]
    return names


def checkpoint_blocks(module, plan, names=None) -> list[str]:
    """Apply ``--activation-checkpointing`` to ``names`` (default :func:`blocks`; the root when there are
    none); returns them. Called before a strategy wraps or shards the module (fsdp: its units).

    Applied once per module: turning the option off or on re-sends the model
    (:func:`distnb.core.levers.changed`), since hooks cannot be taken off a live module.
    """
    if not getattr(plan, "activation_checkpointing", False):
        return []
    from torch.distributed._composable import checkpoint

    names = list(blocks(module) if names is None else names) or [""]
    for name in names:
        sub = module.get_submodule(name)
        if not getattr(sub, "_distnb_checkpointed", False):
            checkpoint(sub)
            sub._distnb_checkpointed = True
    return names


def fsdp_policies(plan, device_type: str) -> dict:
    """``fully_shard`` keywords for the levers and ``--precision``: ``mp_policy`` and ``offload_policy``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs = {}
    dtype = _DTYPES.get(getattr(plan, "param_dtype", "fp32")) or _DTYPES.get(plan.precision)
    if dtype is not None:  # compute in low precision, reduce gradients in fp32; the sharded weights stay fp32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if getattr(plan, "offload", None) == "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return kwargs
