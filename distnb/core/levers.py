"""Memory levers of a training cell: activation checkpointing, CPU offload, low-precision parameters.

These are torch's and FSDP2's own mechanisms, declared as :class:`~distnb.core.plan.TrainPlan` options
(``--activation-checkpointing``, ``--offload cpu``, ``--param-dtype bf16``) and applied on the ranks by
:mod:`distnb.engine.strategies.levers`. This module holds what the kernel checks before anything is
sent (the combinations that cannot work) and which changes need the model sent again. Standard
library only: :mod:`distnb.core.plan` imports it on the ranks too.

Sources: torch.utils.checkpoint (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"); FSDP2's ``CPUOffloadPolicy`` and ``MixedPrecisionPolicy``
(``torch.distributed.fsdp.fully_shard``); torchtitan applies activation checkpointing per
transformer block before ``fully_shard``, as here.
"""

from __future__ import annotations

from distnb.core.errors import PlanError

#: The lever options: a change of any of them re-sends the model (hooks and policies are applied once,
#: when the strategy distributes it, and cannot be taken off a live model).
FIELDS = ("activation_checkpointing", "offload", "param_dtype")
#: ``--param-dtype`` values.
PARAM_DTYPES = ("fp32", "bf16")
#: ``--offload`` values.
OFFLOADS = ("cpu",)
#: The strategies ``--offload`` and ``--param-dtype`` belong to (FSDP2's policies).
FSDP = ("fsdp", "fsdp+tensor")
#: Each lever's help (the magic's, and the Python keyword's docstring line), with an example.
HELP = {
    "activation_checkpointing": "recompute each FSDP unit's (ddp, tensor, ps: each block's, the children with "
                                "parameters) activations in the backward instead of keeping them "
                                "(torch.utils.checkpoint), e.g. --activation-checkpointing",
    "offload": "fsdp: keep parameter shards, gradients and optimizer state in host memory (FSDP2 "
               "CPUOffloadPolicy), e.g. --offload cpu",
    "param_dtype": "fsdp: dtype the gathered parameters compute in, gradients reduced in fp32, weights kept fp32 "
                   "(FSDP2 MixedPrecisionPolicy), e.g. --param-dtype bf16",
}


def check(plan) -> None:
    """Raise PlanError for a combination of levers and options that cannot work (names the fix)."""
    if plan.activation_checkpointing and plan.strategy == "pipeline":
        raise PlanError("--activation-checkpointing is not available with --strategy pipeline (its stages are "
                        "traced by torch.export); use it with ddp, fsdp, tensor or fsdp+tensor")
    if plan.param_dtype != "fp32" and plan.precision not in ("fp32", plan.param_dtype):
        raise PlanError(f"--param-dtype {plan.param_dtype} computes the forward in {plan.param_dtype}, but "
                        f"--precision {plan.precision} asks for another dtype; give one of them (--precision "
                        f"{plan.param_dtype} or leave --precision out)")


def changed(last_key: tuple, key: tuple, fields: tuple) -> bool:
    """Whether the levers differ between two :meth:`~distnb.core.plan.TrainPlan.strategy_key` tuples over ``fields``."""
    return any(a != b for name, a, b in zip(fields, last_key, key) if name in FIELDS)
