"""Token-weighted losses: a step body's summed loss normalised by the global count of what it sums.

A body that sums its loss over valid items (tokens, with padding masked) says how many items the
sum covers with ``ctx.num_items = mask.sum()``. The mean of per-micro-batch means weights a batch
of 3 valid tokens like one of 300; the update one process makes on the whole global batch (all
ranks, all micro-steps of the ``--accumulate`` group) divides the summed loss by the *global*
count instead. :class:`ItemCount` does that: each micro-step back-propagates the body's sum
unscaled, and at the group's end the count summed over the group's micro-steps is all-reduced
(one 3-element all-reduce per optimizer step) and every gradient is multiplied by
``world_size / global_count`` before hooks, clipping and the optimizer step. The ``world_size``
undoes the mean the gradient reduction takes over the ranks (DDP's all-reduce and FSDP2's
reduce-scatter average; a rank of a tensor-parallel group, which sees the same batch as its
peers, adds the same count ``world_size`` times, so the factor is ``1 / count`` there).

This is the fix the field made in 2024-25 for gradient accumulation with padded batches:
transformers PR #34191 (``num_items_in_batch``) and torchtitan PR #2206 (``global_valid_tokens``,
all-reduced over the data-parallel ranks, the loss scaled by the dp size to undo the average).

The logged loss of such a cell is the token-weighted mean: a step's loss is its sum over its own
count, an epoch's is the sum over every step and rank over the total count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distnb.engine.process.collectives import on_group

#: Strategies whose gradients distnb cannot normalise after the fact, and why (``ctx.num_items`` is refused there).
UNSUPPORTED = {
    "pipeline": "the pipeline schedule runs the body per microbatch on the last stage only, inside torch's schedule, "
                "so the other stages never see the count",
    "ps": "the parameter servers apply each worker's gradients as they arrive, before the group's global count "
          "is known",
}

def check_allowed(plan) -> None:
    """Raise ValueError when ``ctx.num_items`` cannot apply to ``plan`` (--loop, pipeline, ps), naming why."""
    if plan.loop:
        raise ValueError("ctx.num_items normalises distnb's own backward; with --loop the body runs backward "
                         "itself: divide its summed loss by the global count (all-reduce the count over the ranks "
                         "and micro-steps, and multiply by world_size, as DDP averages the gradients)")
    why = UNSUPPORTED.get(plan.strategy)
    if why is not None:
        raise ValueError(f"ctx.num_items is not available with --strategy {plan.strategy}: {why}; return a mean "
                         "loss instead (each micro-batch then weighs the same)")


def as_count(value, device) -> torch.Tensor:
    """``value`` (an int, float or 0-d tensor such as ``mask.sum()``) as a float64 0-d tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"ctx.num_items must be a number or a 0-d tensor (mask.sum()), got shape "
                             f"{tuple(value.shape)}")
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"ctx.num_items must be a number or a 0-d tensor (mask.sum()), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"ctx.num_items must be >= 0, got {value}")
    return torch.tensor(float(value), dtype=torch.float64, device=device)


class ItemCount:
    """The counts of one cell's accumulation groups on this rank, and the normalisation at each group's end.

    ``weighted`` is None until the ranks agree (at the first group end) whether the body sets
    ``ctx.num_items``; then True or False for the rest of the cell. A body that sets it on some
    micro-steps (or ranks) only is an error on every rank.
    """

    def __init__(self, device):
        self.device = device
        self.weighted = None
        self._reset()

    def _reset(self) -> None:
        self.items = torch.zeros((), dtype=torch.float64, device=self.device)
        self.set, self.unset = 0, 0
        self._pending = None  # (work, flags): the group's count all-reduce, started before its last backward

    def add(self, items) -> None:
        """A micro-step that set ``ctx.num_items`` (``items``: as :func:`as_count` gives it)."""
        if self.weighted is False:
            raise ValueError("ctx.num_items was set on this micro-step but not on the cell's first optimizer step: "
                             "set it on every micro-step of the cell, or on none")
        self.items += items
        self.set += 1

    def missing(self) -> None:
        """A micro-step that did not set ``ctx.num_items``."""
        if self.weighted:
            raise ValueError("ctx.num_items was not set on this micro-step, though earlier ones set it: the loss "
                             "would be a sum with nothing to divide it by; set it on every micro-step of the cell")
        self.unset += 1

    def start(self, world_size: int) -> None:
        """The group's last micro-step, before its backward: start the count's all-reduce (a weighted cell only).

        It runs while backward does (ahead of DDP's gradient buckets in the group's queue, on every
        rank alike), so :meth:`finish_group` finds it done rather than paying a round trip.
        """
        if self.weighted and self._pending is None and dist.is_initialized() and world_size > 1:
            flags = self._flags()
            self._pending = (dist.all_reduce(flags, async_op=True), flags)  # group device: _flags() puts them there

    def _flags(self) -> torch.Tensor:
        def scalar(n):
            return torch.tensor(float(n), dtype=torch.float64, device=self.device)

        flags = torch.stack([self.items, scalar(self.set), scalar(self.unset)])
        return on_group(flags) if dist.is_initialized() else flags  # gloo on a GPU rank: the CPU

    def drop_group(self) -> None:
        """The group was skipped (``--nan skip``): its counts go (a count all-reduce in flight is finished first)."""
        if self._pending is not None:
            self._pending[0].wait()
        self._reset()

    def finish_group(self, params, world_size: int):
        """At the group's end: agree, and scale the gradients of ``params`` by ``world_size / global count``.

        Returns the global count (a float64 0-d tensor) of a weighted group, None otherwise.
        A collective (every rank calls it) in the cell's first group and in every weighted group.
        """
        if self.weighted is False:
            self._reset()
            return None
        if self._pending is not None:
            work, flags = self._pending
            work.wait()
        else:
            flags = self._flags()
            if dist.is_initialized() and world_size > 1:
                dist.all_reduce(flags)  # group device: _flags() puts them there
        if self.weighted is None:
            was_set, was_unset = flags[1:].tolist()  # once per cell: read on the host
            if was_set and was_unset:
                raise ValueError(f"ctx.num_items was set on {int(was_set)} and not set on {int(was_unset)} micro-steps "
                                 "of the first optimizer step (over all ranks): set it on every micro-step of every "
                                 "rank, or on none")
            self.weighted = bool(was_set)
            if not self.weighted:
                self._reset()
                return None
        total = flags[0]  # no item anywhere (all padding): no gradient, not a blown-up one
        factor = torch.where(total > 0, world_size / total.clamp_min(torch.finfo(torch.float64).tiny),
                             torch.zeros_like(total))
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor.to(p.grad.dtype) if not hasattr(p.grad, "to_local") else float(factor))
        self._reset()
        return total
