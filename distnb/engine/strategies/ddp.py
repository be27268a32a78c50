"""Data parallelism with ``torch.nn.parallel.DistributedDataParallel``.

DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020) broadcasts rank 0's parameters and buffers when it is built, so
every rank starts from identical state, and all-reduces (averages) gradients in
buckets during ``backward()``, overlapping communication with computation.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from . import Strategy


class DDP(Strategy):
    """Every rank holds the whole model; gradients are all-reduced during backward."""

    name = "ddp"
    wraps_model = True

    def __init__(self, module, plan, device, ns):
        super().__init__(module, plan, device, ns)
        device_ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
        self.model = DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True,
                                             find_unused_parameters=plan.find_unused_parameters)

    def close(self) -> None:
        """Also take the reducer's autograd hooks off the parameters.

        They outlive a wrapper that failed mid-step (e.g. DDP's unused-parameter error), and
        the next wrapper over the same parameters would then see every gradient twice
        ("Expected to mark a variable ready only once").
        """
        if self.model is not None:
            try:
                self.model._remove_autograd_hooks()
            except Exception:  # a torch without it: dropping the wrapper is all we can do
                pass
        super().close()


STRATEGY = DDP
