"""The kernel's own peak memory over a training cell (issue 34: the kernel stays flat).

Linux keeps a process's peak resident set (``VmHWM`` in ``/proc/self/status``) and lets the
process reset it to the current resident set by writing ``5`` to ``/proc/self/clear_refs``
(proc(5)). So a cell's peak is measured from the cell's start: :func:`reset` at the start,
:func:`peak` at the end. Where that is not possible (another OS, a locked-down /proc), the figure is
the process's lifetime peak (``ru_maxrss``) and its kind says so.

The resident set counts the shared-memory segments the kernel maps (a model that lives in one,
:mod:`distnb.transfer.resident`) as well as its own heap: all the memory the notebook's tensors use.
"""

from __future__ import annotations

import resource
import sys

_STATUS = "/proc/self/status"
_CLEAR = "/proc/self/clear_refs"


def _status_kib(key: str):
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset() -> bool:
    """Reset this process's peak resident set to its current one; False where that is not possible."""
    try:
        with open(_CLEAR, "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def current() -> int | None:
    """This process's resident set now, in bytes (None where ``/proc`` is not there)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak(since_reset: bool) -> tuple:
    """``(bytes, kind)``: the peak resident set since :func:`reset` (kind ``"rss"``), or, when the reset
    was not possible (``since_reset`` False), the process's lifetime peak (kind ``"rss-lifetime"``)."""
    kib = _status_kib("VmHWM") if since_reset else None
    if kib is not None:
        return kib * 1024, "rss"
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak_rss if sys.platform == "darwin" else peak_rss * 1024), "rss-lifetime"
