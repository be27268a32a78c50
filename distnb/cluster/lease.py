"""The lease: how long a world outlives its kernel, and how a new kernel takes it over (stdlib only).

A world's keeper process (:mod:`distnb.cluster.keeper`, started by ``%dist start`` through
:func:`distnb.cluster.reaper.spawn`) watches the kernel that owns the world. When that kernel dies
(killed, restarted, culled by Jupyter Server), the keeper lets the training that runs on the
ranks finish, then keeps the world for the lease, ``%dist start --linger 10m``: a new kernel
that calls :func:`claim` within it becomes the owner. If none does, the keeper saves the trained
state (``%dist save``'s DCP checkpoint) into the cell's ``--checkpoint-dir`` or the world's default
folder (:func:`default_folder`, named by the start line) and ends every process, shared-memory
file and port of the world. ``--linger 0`` ends everything with the kernel, as before the lease.

The keeper and the kernels talk through files in :func:`lease_dir` (Jupyter's runtime folder,
mode 0700, files 0600): ``<cluster_id>.keeper.json``, written by the keeper (its pid, the owner,
its state), and ``<cluster_id>.claim-<pid>``, written by a claiming kernel and removed by the
keeper once it took the claim.

Example::

    from distnb.cluster import lease
    lease.claim(cluster_id, os.getpid())  # this kernel owns the world from now on
"""

from __future__ import annotations

import json
import os
import time

from distnb.core.errors import ClusterError

#: Keeper states: the owner kernel lives; the kernel died and the ranks still run what it sent; waiting for a
#: new kernel; saving the trained state; everything ended.
STATES = ("watching", "training", "lingering", "saving", "ended")

#: Seconds between two looks of a claiming kernel at the keeper's answer.
CLAIM_POLL = 0.1


def lease_dir() -> str:
    """The folder of the keepers' and claims' files: ``<jupyter runtime dir>/distnb-lease`` (created, 0700)."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir  # where Jupyter keeps its connection files
        base = jupyter_runtime_dir()
    except ImportError:  # jupyter_core comes with ipykernel; a bare interpreter still gets a private folder
        base = os.path.join(os.path.expanduser("~"), ".local", "share", "jupyter", "runtime")
    folder = os.path.join(base, "distnb-lease")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def keeper_file(cluster_id: str) -> str:
    return os.path.join(lease_dir(), f"{cluster_id}.keeper.json")


def claim_file(cluster_id: str, pid: int) -> str:
    return os.path.join(lease_dir(), f"{cluster_id}.claim-{int(pid)}")


def write_private(path: str, data: dict) -> None:
    """``data`` as JSON into ``path``, mode 0600, replaced atomically (a reader never sees half of it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_keeper(cluster_id: str) -> dict | None:
    """The keeper's record of world ``cluster_id`` (see :data:`STATES`), or None when there is none."""
    try:
        with open(keeper_file(cluster_id)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:  # a zombie (dead, not yet waited for) is gone for us
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def claim(cluster_id: str, kernel_pid: int, timeout: float = 10.0) -> None:
    """Make ``kernel_pid`` the owner of world ``cluster_id``: its keeper watches that process from now on.

    Called kernel-side by ``%dist attach`` (or any process that takes the world over). A world
    whose kernel died keeps its training and its trained state while its new owner lives; the
    lease counts again only once that owner dies too.

    Parameters
    ----------
    cluster_id : str
        The world's ipyparallel cluster id.
    kernel_pid : int
        The pid of the new owner (usually ``os.getpid()`` of the attaching kernel).
    timeout : float
        Seconds to wait for the keeper's acknowledgement.

    Raises
    ------
    ClusterError
        When no keeper is alive for that world, its lease already expired (it is saving or has
        ended), ``kernel_pid`` is not a live process, or the keeper did not answer within ``timeout``.
    """
    if not _pid_alive(kernel_pid):
        raise ClusterError(f"cannot claim world {cluster_id}: process {kernel_pid} is not running")
    record = read_keeper(cluster_id)
    waited = time.monotonic() + timeout
    while record is None and time.monotonic() < waited:  # a keeper just spawned writes its record once it runs
        time.sleep(CLAIM_POLL)
        record = read_keeper(cluster_id)
    if record is not None and record.get("state") in ("saving", "ended"):
        raise ClusterError(f"the lease of world {cluster_id} already expired: its trained state was saved to "
                           f"{_saved_to(record)} and the world ends; load it with %dist load")
    if record is None or not _pid_alive(record.get("pid", -1)):
        raise ClusterError(f"no keeper is alive for world {cluster_id}: it has ended (or was started with "
                           "--linger 0 and ended with its kernel); start a new one with %dist start")
    path = claim_file(cluster_id, kernel_pid)
    write_private(path, dict(pid=int(kernel_pid), at=time.time()))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = read_keeper(cluster_id) or {}
        if record.get("owner") == int(kernel_pid) and not os.path.exists(path):
            return
        if record.get("state") in ("saving", "ended") or not _pid_alive(record.get("pid", -1)):
            break
        time.sleep(CLAIM_POLL)
    try:
        os.remove(path)
    except OSError:
        pass
    record = read_keeper(cluster_id) or {}
    if record.get("state") in ("saving", "ended") or not _pid_alive(record.get("pid", -1)):
        raise ClusterError(f"the lease of world {cluster_id} expired before the claim was taken: its trained state "
                           f"goes to {_saved_to(record)}; load it with %dist load")
    raise ClusterError(f"the keeper of world {cluster_id} (pid {record.get('pid')}) did not take the claim of "
                       f"process {kernel_pid} within {timeout:g} s")


def _saved_to(record: dict) -> str:
    """Where the keeper of ``record`` saved (or saves) the trained state: the checkpoints, else its default folder."""
    saved = record.get("saved") or []
    return ", ".join(s["path"] for s in saved) if saved else str(record.get("checkpoint_dir"))


def default_folder(cluster_id: str, notebook: str | None = None, cwd: str | None = None) -> str:
    """Where an expiring lease saves a cell's trained state when the cell named no ``--checkpoint-dir``.

    ``<notebook's folder>/distnb-lease/<notebook name>-<cluster_id>``: next to the notebook
    (``JPY_SESSION_NAME``, set by Jupyter Server), else in the kernel's working folder (Jupyter
    starts a kernel in its notebook's folder).
    """
    notebook = notebook if notebook is not None else os.environ.get("JPY_SESSION_NAME", "")
    cwd = cwd or os.getcwd()
    stem = "kernel"
    if notebook:
        stem = os.path.splitext(os.path.basename(notebook))[0] or stem
        if os.path.isabs(notebook) and os.path.isdir(os.path.dirname(notebook)):
            cwd = os.path.dirname(notebook)
    return os.path.join(cwd, "distnb-lease", f"{stem}-{cluster_id}")


def keeper_args(cluster) -> dict:
    """What :func:`distnb.cluster.reaper.spawn` gives the keeper of ``cluster`` (a started distnb Cluster)."""
    ipp_cluster = cluster._ipp
    cluster_id = getattr(ipp_cluster, "cluster_id", None) or ""
    if getattr(cluster, "lease_folder", None) is None:
        cluster.lease_folder = default_folder(cluster_id)
    return dict(linger=cluster.spec.linger, cluster_id=cluster_id,
                cluster_file=getattr(ipp_cluster, "cluster_file", None) or "",
                engines=list(cluster.engine_ids), folder=cluster.lease_folder)


def start_note(cluster) -> str:
    """The start line's word on the lease: how long the world outlives its kernel and where it saves."""
    linger = cluster.spec.linger
    if not linger:
        return "--linger 0: the ranks end with this kernel"
    return (f"a run outlives this kernel by its end plus --linger {format_duration(linger)}, then its trained state "
            f"is saved to the cell's --checkpoint-dir or {getattr(cluster, 'lease_folder', None)}")


def format_duration(seconds: float) -> str:
    """``600`` -> ``10m``, ``90`` -> ``90s``, ``7200`` -> ``2h``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def outlives_kernel(session, cell_running: bool = False) -> bool:
    """Whether the exiting kernel must leave ``session``'s world to its keeper instead of stopping it: started
    with linger > 0, and a ``--background`` run goes on (or ``cell_running``: a foreground cell runs)."""
    run = getattr(session, "_background", None)
    return bool(session.cluster.spec.linger) and (cell_running or (run is not None and run.active))
