"""A tensor shard's batch onto the rank's GPU without a synchronous copy (GPU review, finding 8).

A batch of a shard of tensors is gathered from the shard's rows on the host every step. A copy to
the GPU from ordinary (pageable) memory is synchronous even with ``non_blocking=True``: CUDA
stages it through a driver buffer, and the host waits. :func:`rows` gathers the rows straight
into page-locked (pinned) memory, from torch's caching host allocator (reused from step to step,
and kept until the copy that reads it has run), and copies from there with
``non_blocking=True``: the copy is queued behind the last step's kernels and the host goes on to
the next launch. On the CPU the rows are gathered as before.
"""

from __future__ import annotations

import torch


def rows(column: torch.Tensor, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``column[idx]`` on ``device`` (a CPU column, a 1-d long ``idx``): pinned and asynchronous on a GPU.

    Parameters
    ----------
    column : torch.Tensor
        ``[N, ...]`` on the CPU (a shard's column).
    idx : torch.Tensor
        int64 ``[B]``: the batch's rows.
    device : torch.device
        The rank's device.

    Returns
    -------
    torch.Tensor
        ``[B, ...]`` of ``column.dtype`` on ``device``. On a GPU, the copy may still be running
        when this returns; work queued on the current stream after it sees the data.
    """
    if device.type == "cpu":
        return column[idx]
    staged = torch.empty((len(idx), *column.shape[1:]), dtype=column.dtype, pin_memory=True)
    torch.index_select(column, 0, idx, out=staged)
    return staged.to(device, non_blocking=True)
