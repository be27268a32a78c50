"""A rank's peak memory, per cell: the dashboard's "peak memory" column (GPU review, finding 10).

A process-lifetime peak says nothing about the cell in front of the user: it holds the install copy,
earlier cells and the full-state gathers. Each training cell starts a new window
(:func:`start_cell`, called when the cell's :class:`distnb.engine.transport.report.Reporter` is made), and
:func:`peak_memory` reads the peak since then.

- CUDA: ``torch.cuda.reset_peak_memory_stats`` then ``torch.cuda.max_memory_allocated`` (kind
  ``"cuda"``): the caching allocator's tensors only. It excludes the CUDA context, NCCL's buffers
  and the allocator's cache (``max_memory_reserved``), so it reads lower than ``nvidia-smi`` and
  is not an out-of-memory predictor.
- Host: the peak resident set size, ``VmHWM`` of ``/proc/self/status``, reset by writing ``5``
  to ``/proc/self/clear_refs`` (Linux >= 4.0, ``Documentation/filesystems/proc.rst``; kind
  ``"rss"``). Where that file cannot be written (another OS, a sandbox) the figure is
  ``getrusage``'s ``ru_maxrss``, the lifetime peak, and its kind says so (``"rss-lifetime"``).
"""

from __future__ import annotations

import resource
import sys

_HOST = {"reset": False}  # whether this process's VmHWM was reset (then it is the window's peak)


def _is_cuda(device) -> bool:
    return device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"


def start_cell(device=None) -> None:
    """Start a new peak window for ``device`` (a CUDA device: its allocator's; always the host's too).

    Never raises: a figure for the dashboard must not fail a cell.
    """
    if _is_cuda(device):
        import torch  # heavy: only where a CUDA device was chosen (then torch is loaded already)

        try:
            torch.cuda.reset_peak_memory_stats(device)
        except Exception:  # the figure then stays the lifetime peak; training goes on
            pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _HOST["reset"] = True
    except OSError:
        _HOST["reset"] = False


def host_peak() -> tuple:
    """``(bytes, kind)`` of this process's peak resident set size since :func:`start_cell`.

    ``kind`` is ``"rss"`` for the window's peak, ``"rss-lifetime"`` where it could not be reset.
    """
    if _HOST["reset"]:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024, "rss"
        except OSError:
            pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak if sys.platform == "darwin" else peak * 1024), "rss-lifetime"


def peak_memory(device=None) -> tuple:
    """Peak memory of this process since the cell began: ``(bytes, kind)``.

    Parameters
    ----------
    device : torch.device or str, optional
        A CUDA device: ``torch.cuda.max_memory_allocated`` since :func:`start_cell` (kind
        ``"cuda"``). Otherwise the host's peak resident set size (:func:`host_peak`).

    Returns
    -------
    tuple of (int, str)
    """
    if _is_cuda(device):
        import torch  # heavy: only for a CUDA device (torch is loaded already there)

        return int(torch.cuda.max_memory_allocated(device)), "cuda"
    return host_peak()
