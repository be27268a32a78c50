"""What ``%dist start`` picks when it is not told: how many engines, the backend, the device, threads
(and the namespace names are looked up in).

:func:`default_spec` turns the options given (any of them may be missing) into a
:class:`~distnb.core.plan.ClusterSpec`: one engine per visible GPU (nccl), or with no GPU one CPU
engine per core (gloo) with the cores shared out as threads; with engines on other hosts,
hosts (or nodes) times ``--engines-per-node``, the device chosen later from what the hosts
report (:func:`distnb.cluster.placement.fit_to_hosts`).
"""

from __future__ import annotations

import os
import sys

from distnb.cluster import placement
from distnb.core.errors import ClusterError, PlanError
from distnb.core.net import visible_gpus
from distnb.core.options import check_int, split_hosts
from distnb.core.plan import ClusterSpec

#: Most CPU engines ``-n`` may ask for: this many per core, and at least MIN_ENGINE_CAP.
ENGINES_PER_CORE = 16
MIN_ENGINE_CAP = 32


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_spec(n: int | None = None, backend: str | None = None, timeout: float = 60.0,
                 master_port: int | None = None, **where) -> ClusterSpec:
    """One engine per GPU (nccl), or with no GPU one CPU engine per core (gloo); ``n`` overrides.

    ``where`` holds the placement options of :class:`~distnb.core.plan.ClusterSpec` (launcher,
    hosts, nodes, engines_per_node, queue, time_limit, account, profile, interface,
    master_addr). With a launcher other than ``local``, ``n`` defaults to hosts (or nodes)
    times ``engines_per_node``, and the device is chosen once the engines report what their
    hosts have (:class:`distnb.cluster.cluster.Cluster` ``auto_device``).
    """
    where = {k: v for k, v in where.items() if v is not None}
    if "hosts" in where:
        where["hosts"] = split_hosts("--hosts", where["hosts"])
    for name in ("engines_per_node", "nodes"):  # checked before they make -n
        if name in where:
            check_int("--" + name.replace("_", "-"), where[name], 1)
    launcher = where.get("launcher", "local" if "profile" not in where else None)
    where["launcher"] = launcher
    if n is None and "profile" in where and not where.get("hosts") and not where.get("nodes"):
        n = placement.engine_count(placement.profile_config(where["profile"])[1])
    if launcher is None or placement.engines_remote(launcher, where.get("hosts")):
        hosts = len(where.get("hosts", ())) or where.get("nodes")
        if n is None:
            if not hosts and launcher not in (None, "mpi"):
                raise PlanError(f"--launcher {launcher}: say how many engines with -n (or --hosts/--nodes with "
                                "--engines-per-node)")
            n = hosts * where.get("engines_per_node", 1) if hosts else cpu_cores()
        backend = backend or "gloo"
        device_type = "cuda" if backend == "nccl" else "cpu"
        return ClusterSpec(num_engines=n, backend=backend, device_type=device_type, num_threads=1,
                           timeout=timeout, master_port=master_port, **where)
    gpus = visible_gpus()
    device_type = "cuda" if gpus else "cpu"
    if n is None:
        n = len(gpus) if gpus else cpu_cores()
    if device_type == "cuda" and isinstance(n, int) and n > len(gpus):
        raise ClusterError(f"-n {n} asks for more GPU engines than the {len(gpus)} visible GPUs")
    most = max(MIN_ENGINE_CAP, ENGINES_PER_CORE * cpu_cores())
    if device_type == "cpu" and isinstance(n, int) and not isinstance(n, bool) and n > most:
        raise PlanError(f"-n {n} asks for more than {ENGINES_PER_CORE} engines per CPU core ({cpu_cores()} cores): "
                        f"each engine is a process with its own torch; use at most -n {most}")
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    threads = max(1, cpu_cores() // n) if isinstance(n, int) and n > 0 else 1
    return ClusterSpec(num_engines=n, backend=backend, device_type=device_type, num_threads=threads,
                       timeout=timeout, master_port=master_port, **where)


def user_ns() -> dict:
    """The namespace notebook names are looked up in: IPython's user namespace, else ``__main__``'s."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.user_ns
    except ImportError:
        pass
    return sys.modules["__main__"].__dict__
