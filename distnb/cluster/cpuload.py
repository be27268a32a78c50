"""How much of this host's CPU other processes use: what ``%dist start --cpu-bind auto`` decides by.

Binding each rank to its own cores (:mod:`distnb.engine.process.binding`) made DDP on 2 cores 1.18x faster
on a quiet machine, but with another process keeping one of the cores busy the rank bound to that
core got half of it, and the world ran at 0.82x torchrun's speed against 0.90x unbound
(benchmarks/README.md, issue 17: "CPU binding"). So ``auto`` binds only when other processes used
less than :data:`AUTO_MAX_FOREIGN` of a core just before the start.

"Other processes" is every process but the kernel and its descendants (the engine template, the
cluster's engines and controller): the CPU time of the host's cores (``/proc/stat``) minus theirs,
over the span since the last :func:`mark`. The cluster marks when its start begins and asks just
before the ranks set up, so the span is the start itself and nothing is added to its time; a span
shorter than :data:`MIN_SPAN` or longer than :data:`MAX_SPAN` seconds (a batch job that waited in the
queue) is replaced by a fresh :data:`SAMPLE_SECONDS` sample.
"""

from __future__ import annotations

import os
import time

#: ``--cpu-bind auto`` binds when other processes used less than this many cores (on average).
AUTO_MAX_FOREIGN = 0.25
#: Seconds sampled at a start when no mark covers a usable span.
SAMPLE_SECONDS = 0.1
#: A mark younger than this is too short a span (a restart right after a stop): sample instead.
MIN_SPAN = 0.2
#: A mark older than this says little about the load now: sample instead.
MAX_SPAN = 30.0

_MARK: tuple | None = None


def _busy_seconds(cpus) -> float | None:
    """CPU seconds the cores ``cpus`` have been busy since boot (``/proc/stat``), None where unreadable."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
    except OSError:
        return None
    busy = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            busy += sum(values) - values[3] - values[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> dict:
    """CPU seconds of this process and each of its live descendants, by pid."""
    import psutil

    me = psutil.Process()
    out = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            out[proc.pid] = times.user + times.system
        except psutil.Error:
            pass
    return out


def _cpus() -> set:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def mark() -> None:
    """Start a span: the next :func:`foreign_cores` measures from here."""
    global _MARK
    busy = _busy_seconds(_cpus())
    _MARK = None if busy is None else (time.monotonic(), busy, _own_seconds())


def foreign_cores() -> float:
    """Cores' worth of CPU that other processes used on this process's cores, on average (0.0 where unknown).

    Over the span since the last :func:`mark`, or over a fresh :data:`SAMPLE_SECONDS` sample when that
    span is shorter than :data:`MIN_SPAN` or longer than :data:`MAX_SPAN` (it then waits that long).
    """
    cpus = _cpus()
    start = _MARK
    if start is None or not MIN_SPAN <= time.monotonic() - start[0] <= MAX_SPAN:
        mark()
        time.sleep(SAMPLE_SECONDS)
        start = _MARK
    busy, own = _busy_seconds(cpus), _own_seconds()
    if start is None or busy is None:
        return 0.0
    ours = sum(cpu - start[2].get(pid, 0.0) for pid, cpu in own.items())
    span = max(1e-6, time.monotonic() - start[0])
    return max(0.0, (busy - start[1] - ours) / span)
