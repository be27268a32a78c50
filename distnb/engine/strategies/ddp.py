"""Data parallelism with ``torch.nn.parallel.DistributedDataParallel``.

DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020) broadcasts rank 0's parameters and buffers when it is built, so
every rank starts from identical state, and all-reduces (averages) gradients in
buckets during ``backward()``, overlapping communication with computation.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from distnb.engine.process import abort
from distnb.engine.strategies import Strategy, compiling, levers


class DDP(Strategy):
    """Every rank holds the whole model; gradients are all-reduced during backward."""

    name = "ddp"
    wraps_model = True
    replicated_grads = True
    replicas = True

    def __init__(self, module, plan, device, ns):
        super().__init__(module, plan, device, ns)
        levers.checkpoint_blocks(module, plan)  # --activation-checkpointing, before wrapping
        device_ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
        self.model = self.ddp = DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True,
                                                        find_unused_parameters=plan.find_unused_parameters)
        import torch.distributed as dist


        if dist.get_backend() == "gloo":  # a peer's failure ends this rank's backward at once (engine/abort.py)
            self.ddp.register_comm_hook(None, abort.ddp_allreduce_hook)

    def no_sync(self):
        """DDP's own ``no_sync()``: gradients accumulate locally, the next synced backward all-reduces the sum."""
        return self.ddp.no_sync()

    def compile(self) -> None:
        """Compile the module DDP wraps, in place (torch's advice, :mod:`distnb.engine.strategies.compiling`): compiled
        from outside, DDP's forward graph-breaks and dynamo makes no graph at all. ``model`` stays the DDP
        wrapper, whose reducer hooks on the parameters' gradients all-reduce what the compiled backward gives."""
        compiling.compile_in_place(self.module)

    def check_grads(self) -> None:
        """Every trainable parameter got a gradient, else a RuntimeError naming those that did not.

        Without ``find_unused_parameters`` DDP all-reduces a bucket only once all of its parameters
        have gradients: a parameter that took no part in the loss leaves its bucket rank-local, and
        torch says so only at the next forward, after the optimizer stepped with those local
        gradients (and never in a one-step cell). Checked before the cell's first step, nothing is
        updated and the ranks stay identical.
        """
        if self.plan.find_unused_parameters:
            return
        missing = sorted(n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None)
        if missing:
            import torch.distributed as dist

            raise RuntimeError(
                f"[distnb] some parameters got no gradient: run the cell with --find-unused-parameters (or set "
                f"requires_grad=False on them). On rank {dist.get_rank()} the loss did not depend on "
                f"{', '.join(missing[:12])}{', ...' if len(missing) > 12 else ''}; no optimizer step was taken")

    def eval_model(self):
        """The module itself: the parameters are identical on every rank (the buffers too, once
        :meth:`sync_buffers` ran) and validation needs no gradient sync."""
        return self.module

    def close(self) -> None:
        """Also take the reducer's autograd hooks off the parameters.

        They outlive a wrapper that failed mid-step (e.g. DDP's unused-parameter error), and
        the next wrapper over the same parameters would then see every gradient twice
        ("Expected to mark a variable ready only once").
        """
        if getattr(self, "ddp", None) is not None:
            try:
                self.ddp._remove_autograd_hooks()
            except Exception:  # a torch without it: dropping the wrapper is all we can do
                pass
        self.ddp = None
        super().close()  # a rebuild without --compile calls the module eagerly again


STRATEGY = DDP
