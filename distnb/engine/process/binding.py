"""CPU binding: each CPU rank of a host on its own share of the host's cores (``%dist start --cpu-bind``).

A rank whose threads the OS scheduler moves between cores (and which shares each core in turn with
its peer ranks, gloo's threads and the engine's own) waits for its peers at every all-reduce each
time one of them was moved or held up. On 2 cores, binding each of 2 ranks (every thread of its
process) to its own core made the digits CNN under DDP 1.18x faster in distnb and 1.18x under
torchrun alike (benchmarks/README.md, issue 17: "CPU binding"). It is the practice of Slurm's
``--cpu-bind=cores``, of Intel's PyTorch launcher and of ``torchrun --numa-binding``.

The cores this engine may run on when it is first bound (its launcher's set, e.g. a Slurm job's
cpuset) are shared out among the host's ``among`` ranks in order of socket, core and hardware
thread, so that a rank's share holds whole cores, sibling threads together, and one socket
before the next; shares differ by at most one core. With more ranks on the host than cores, no
rank is bound. Threads and processes started later (a DataLoader's workers) inherit the share of
the thread that starts them, except gloo's own threads (its network loop, ``gloo_tcp_loop``, and its
process groups' workers, ``pt_gloo_runloop``), which :func:`float_gloo` gives all of :func:`allowed`
once a group has formed: every collective hands its work to them and back, and on the rank's one core
that cost FSDP2 (an all-gather per unit per forward, a reduce-scatter per backward) twice the context
switches and system time. On 2 cores, 2 ranks, 4 alternated rounds (benchmarks/README.md, 2026-12-05):
the small transformer under FSDP2 0.98 s against 1.35 s with gloo's threads bound too, the digits MLP
under DDP 0.13 s against 0.16 s, the CNN and the transformer under DDP level (0.28 s, 0.46 s).
"""

from __future__ import annotations

import os

#: The cores this engine could run on before it was first bound (None until then).
_ALLOWED: list | None = None
#: This rank's share now (None: not bound).
CORES: list | None = None


def allowed() -> list:
    """The cores this engine may run on, read once, before any binding (sorted CPU numbers)."""
    global _ALLOWED
    if _ALLOWED is None:
        _ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return _ALLOWED


#: Where Linux describes each CPU's socket and core.
SYSFS_CPUS = "/sys/devices/system/cpu"


def _topology_key(cpu: int) -> tuple:
    """(socket, core, cpu) of CPU ``cpu`` from sysfs, so that a core's hardware threads sort together."""
    base = f"{SYSFS_CPUS}/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as f:
            package = int(f.read())
        with open(base + "core_id") as f:
            core = int(f.read())
    except (OSError, ValueError):
        return (0, cpu, cpu)
    return (package, core, cpu)


def share(cores: list, local_rank: int, among: int) -> list | None:
    """The cores of local rank ``local_rank`` of ``among`` ranks sharing ``cores``, or None (not bound).

    ``cores`` are taken in order of socket, core and hardware thread (:func:`_topology_key`) and cut
    into ``among`` contiguous parts whose sizes differ by at most one. None when there are fewer cores
    than ranks, or ``local_rank`` is not one of them.
    """
    if among < 1 or among > len(cores) or not 0 <= local_rank < among:
        return None
    ordered = sorted(cores, key=_topology_key)
    part = ordered[local_rank * len(ordered) // among:(local_rank + 1) * len(ordered) // among]
    return sorted(part)


def bind(local_rank: int, among: int | None) -> list | None:
    """Bind every thread of this process to its share of :func:`allowed` (``among`` ranks on this host).

    ``among`` None (``--cpu-bind none``, or GPU engines), or more ranks than cores, gives every thread
    all of :func:`allowed` back (an engine bound before, then resized, is unbound). Returns the share,
    or None when not bound.
    """
    global CORES
    cores = allowed()
    if not cores:  # no affinity on this platform
        return None
    mine = share(cores, local_rank, among) if among else None
    target = set(mine or cores)
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.sched_setaffinity(int(tid), target)
        except OSError:  # a thread that ended meanwhile, or a set the system refuses: that thread stays as it was
            pass
    CORES = mine
    return mine


#: Words in the names (``/proc/self/task/*/comm``) of gloo's threads, which :func:`float_gloo` leaves unbound.
GLOO_THREADS = ("gloo",)


def float_gloo() -> int:
    """Give gloo's threads (:data:`GLOO_THREADS`) all of :func:`allowed` while this rank is bound; how many.

    Call it after a process group forms (gloo starts its threads then, and they inherit the forming
    thread's share). Nothing when the rank is not bound.
    """
    if CORES is None or not os.path.isdir("/proc/self/task"):
        return 0
    floated, everywhere = 0, set(allowed())
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if any(word in name for word in GLOO_THREADS):
                os.sched_setaffinity(int(tid), everywhere)
                floated += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return floated


def describe(cores: list | None, everywhere: bool = False) -> str:
    """``"0-3"``, ``"0,2,4"``: the ``cores`` column of ``%dist status``. ``"all"`` for None, and with
    ``everywhere`` for a set that is every CPU of the machine (a rank not bound, its launcher restricting
    nothing); an unbound rank confined by its launcher (``taskset``, a cpuset) shows that set."""
    if not cores or (everywhere and len(cores) >= (os.cpu_count() or 0)):
        return "all"
    runs, start = [], cores[0]
    for prev, cpu in zip(cores, cores[1:] + [None]):
        if cpu is None or cpu != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cpu
    return ",".join(runs)
