"""Data parallelism with ``torch.nn.parallel.DistributedDataParallel``.

DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020) broadcasts rank 0's parameters and buffers when it is built, so
every rank starts from identical state, and all-reduces (averages) gradients in
buckets during ``backward()``, overlapping communication with computation.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(module: torch.nn.Module, plan, device: torch.device) -> DistributedDataParallel:
    """Wrap ``module`` (already on ``device``) in DDP over the default process group."""
    device_ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True,
                                   find_unused_parameters=plan.find_unused_parameters)
