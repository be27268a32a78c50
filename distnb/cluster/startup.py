"""What ``%dist start`` says: a running cluster kept (and the options it did not apply), or one ready."""

from __future__ import annotations

from distnb.cluster import lease
from distnb.cluster.cpuload import AUTO_MAX_FOREIGN
from distnb.cluster.gpuhost import kernel_cuda_note
from distnb.core import gpus, options
from distnb.core.errors import PlanError
from distnb.core.plan import FAILURE_POLICIES, ClusterSpec, hang_seconds
from distnb.core.tables import count

#: start()'s keyword options (Python keyword -> ClusterSpec field), from ClusterSpec's declarations.
START_OPTIONS = options.keywords(ClusterSpec)


def differences(explicit: dict, asked: ClusterSpec, running: ClusterSpec) -> str:
    """What a ``%dist start`` that keeps the running cluster says about the options it was given."""
    changed = []
    for keyword, value in explicit.items():
        name = START_OPTIONS[keyword]
        if getattr(asked, name) != getattr(running, name):
            f, opt = next((f, o) for f, o in options.declared(ClusterSpec) if f.name == name)
            show = ",".join(value) if isinstance(value, (tuple, list)) else value
            changed.append((options.flags_of(f, opt)[0], show, _running_value(running, name)))
    if not changed:
        return "(%dist restart starts a fresh one)"
    said = ", ".join(f"{flag} {value} (running: {now})" for flag, value, now in changed)
    return (f"and not these options, which differ from it: {said}; apply them with %dist restart "
            + " ".join(f"{flag} {value}" for flag, value, _ in changed))


def _running_value(running: ClusterSpec, name: str) -> str:
    """A running cluster's setting as the user would give it: a default that is None said as what applies
    (``--hang-after``'s "running: None" meant 10 s, or half a short --timeout)."""
    value = getattr(running, name)
    if value is not None:
        return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
    if name == "hang_after":
        return f"{hang_seconds(running):g} s, the default"
    return "not set, the default"


def say_ready(cluster) -> None:
    """``distnb: 2 ranks ready (gloo, cpu, 1 threads/rank) in 0.9 s`` (and the start's note, if any)."""
    spec = cluster.spec
    hosts = f" on {count(cluster.num_nodes, 'host')}" if cluster.num_nodes > 1 else ""
    threads = sorted({r.get("num_threads", spec.num_threads) for r in cluster.ranks})
    print(f"distnb: {count(spec.num_engines, 'rank')}{hosts} ready ({spec.backend}, {spec.device_type}, "
          f"{'-'.join(map(str, threads[::max(1, len(threads) - 1)]))} threads/rank) in "
          f"{cluster.start_seconds:.1f} s")
    if cluster.note:
        print(f"distnb: {cluster.note}")
    if not getattr(cluster, "remote", True):
        said = gpu_note(spec.device_type, gpus.discover(), gpus.driver_present())
        if said:
            print(f"distnb: {said}")
    for note in (binding_note(cluster), kernel_cuda_note(spec.device_type), lease.start_note(cluster)):
        if note:
            print(f"distnb: {note}")


def gpu_note(device_type: str, found: dict, driver: bool) -> str:
    """What GPU discovery found and how (``""``: nothing worth a line: CPU ranks on a machine with no GPU driver).

    A machine whose GPUs distnb could not find (a sandbox without ``/proc/driver/nvidia``) started CPU ranks
    without a word; now the start says what was looked at (:func:`distnb.core.gpus.discover`)."""
    if device_type == "cuda":
        return f"GPUs: {gpus.describe(found)}"
    if driver and not found["gpus"]:
        return (f"{gpus.describe(found)} although an NVIDIA driver is installed: the ranks run on the CPU; set "
                "CUDA_VISIBLE_DEVICES=0,1,... before %dist start to name the GPUs")
    return ""


def binding_note(cluster) -> str:
    """Why the CPU ranks on this host were not bound to cores although binding was asked for (``""``: they were,
    or it was not): other processes' load under ``--cpu-bind auto``, or more ranks than cores."""

    spec = cluster.spec
    here = [r for r in cluster.ranks if r.get("local", True)]
    if spec.cpu_bind == "none" or spec.device_type != "cpu" or not here or bound_here(cluster):
        return ""
    if spec.cpu_bind == "auto" and cluster.foreign_cores >= AUTO_MAX_FOREIGN:
        return (f"the ranks are not bound to cores: other processes used {cluster.foreign_cores:.1f} of this host's "
                "cores while the cluster started (%dist restart --cpu-bind cores, or restart(cpu_bind=\"cores\") in "
                "Python, binds them anyway)")
    if spec.cpu_bind != "cores":  # auto binds what it can without a word
        return ""
    from distnb.cluster.defaults import cpu_cores  # loads psutil: at first use, not when this module is imported

    return (f"the ranks are not bound to cores: this host has {count(len(here), 'rank')} and only "
            f"{count(cpu_cores(), 'core')} for them ({here[0].get('cores', 'all')}), so each may run on any of them")


def bound_here(cluster) -> bool:
    """Whether this host's CPU ranks are bound to cores of their own (``--cpu-bind``)."""
    return any(r.get("bound") for r in cluster.ranks if r.get("local", True))


def rebinding_note(cluster, was_bound: bool) -> str:
    """What a ``%dist scale`` changed about the binding of this host's ranks to cores (``""``: nothing)."""
    now = bound_here(cluster)
    if now == was_bound:
        return ""
    if now:
        return "the ranks are bound to cores of their own now, each to its share of this host's cores"
    from distnb.cluster.defaults import cpu_cores  # loads psutil: at first use, not when this module is imported

    here = [r for r in cluster.ranks if r.get("local", True)]
    return (f"the ranks are no longer bound to cores: this host has {count(len(here), 'rank')} now and only "
            f"{count(cpu_cores(), 'core')} for them, so each may run on any of them (with at most "
            f"{count(cpu_cores(), 'rank')} here they are bound again)")


def failure_policy(auto_restart, on_failure):
    """The ``--on-failure`` policy that ``%dist start`` was given (``--auto-restart`` is ``restart``), or None.

    Raises PlanError for a value that is not one, or for both options disagreeing.
    """
    if auto_restart is not None:
        options.check_flags(auto_restart=auto_restart)
    if on_failure is not None and on_failure not in FAILURE_POLICIES:
        raise PlanError(f"--on-failure must be one of {', '.join(FAILURE_POLICIES)}, got {on_failure!r}")
    if auto_restart and on_failure not in (None, "restart"):
        raise PlanError(f"--auto-restart is --on-failure restart; it cannot go with --on-failure {on_failure}")
    if on_failure is None and auto_restart is not None:
        return "restart" if auto_restart else "stop"
    return on_failure


def say_policy(policy: str, before: str) -> None:
    """What a running cluster does from now on (``policy``, was ``before``) when an engine dies during a cell."""
    if "restart" in (policy, before) and "shrink" not in (policy, before):
        print(f"distnb: automatic restart after an engine death is now {'on' if policy == 'restart' else 'off'}")
        return
    what = {"stop": "the cell fails (%dist restart for a fresh world)",
            "restart": "a fresh world starts at once (automatic restart)",
            "shrink": "the cell goes on on the surviving ranks at the smaller world"}[policy]
    print(f"distnb: when an engine dies during a cell, {what} (--on-failure {policy})")
