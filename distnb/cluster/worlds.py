"""World records: one owner-only file per live distnb world, read by ``%dist attach`` (issue 38).

A world (the controller, the engines and their process group) is found again from a new kernel
through ipyparallel's own connection files (``Cluster(shutdown_atexit=False)``, the cluster file,
the client connection file that holds the HMAC key); the record adds what distnb knows of it:
the notebook, its ranks, the running training cell.

Where: ``jupyter_runtime_dir()/distnb-worlds/<cluster_id>.json`` (where Jupyter keeps its own
kernel connection files), the folder mode 0700, each file 0600, written whole (a temporary file
renamed over it). distnb's ipyparallel profile (its ``security`` folder: the connection files) is
in the same runtime folder (:func:`profile_folder`) unless ``%dist start --profile`` names one.

Fields (the contract with :mod:`distnb.cluster.lease`): cluster_id, cluster_file, client_file,
profile_dir, kernel_pid, keeper_pid, controller_pid, notebook (``JPY_SESSION_NAME`` when Jupyter
sets it), uid, host, world_size, backend, device_type, linger_s, checkpoint_dir, started (unix
time), ranks (rank, pid, host, device per rank), and ``run``: None between cells, else the running
training cell: cell (its source), strategy, model, background, started, msg_ids (the ipyparallel
task ids, rank order), session (the ipyparallel client session that sent them), token (the ranks keep its result under it, :mod:`distnb.engine.train.kept`),
progress (what the dashboard needs: total steps, epochs, view); last_model (the model name the ranks
trained last, for ``%dist attach --model``). ``kernel_state`` holds what the
kernel knew of the ranks (base64 pickle: the ClusterSpec, the placement, what the ranks hold); it
is read only from a file owned by this user and no one else can read or write (:func:`read`).

Written at ``%dist start`` and ``%dist attach``, updated at each training cell's start and end, removed at
``%dist stop``. Every write and removal holds the records' lock (:func:`locked`: ``fcntl.flock`` on a 0600 file
in the same folder, shared by every kernel of this user), and an update rewrites only the record that names this
kernel, checked under the lock: a kernel that a world was taken from (``%dist attach`` in another kernel) or whose
world another kernel stopped never writes its record back.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import itertools
import json
import math
import os
import pickle
import socket
import stat
import threading
import time

import psutil
from jupyter_core.paths import jupyter_runtime_dir

from distnb.core.errors import ClusterError

FOLDER = "distnb-worlds"
#: The records' lock file, in :func:`folder` (not a record: its name does not end with ``.json``).
LOCK_FILE = "records.lock"
PROFILE = "distnb-ipython"
#: The Holdings fields an attached kernel takes over (the rest hold weak references to notebook objects).
HELD_FIELDS = ("models", "distributed", "data", "pushed", "carried", "lr_of", "trained_steps", "names",
               "settings", "generation")
#: Where the lease saves the trained state when no cell named ``--checkpoint-dir`` (relative to the notebook).
DEFAULT_CHECKPOINT_DIR = "distnb-checkpoints"


def _private_folder(path: str) -> str:
    """``path`` created mode 0700 (and made 0700 if it was not); a ClusterError if another user owns it."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise ClusterError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): distnb keeps "
                           "its connection files only in a folder of your own (set JUPYTER_RUNTIME_DIR)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def folder() -> str:
    """The folder of the world records (created, mode 0700)."""
    runtime = _private_folder(jupyter_runtime_dir())
    return _private_folder(os.path.join(runtime, FOLDER))


def profile_folder() -> str:
    """distnb's ipyparallel profile folder, in Jupyter's runtime folder (mode 0700): its ``security`` folder
    holds the connection files with the world's key. ``%dist start --profile NAME`` uses that profile instead."""
    runtime = _private_folder(jupyter_runtime_dir())
    return _private_folder(os.path.join(runtime, PROFILE))


def record_path(cluster_id: str) -> str:
    """The record file of the world ``cluster_id``."""
    return os.path.join(folder(), f"{cluster_id}.json")


def _write(path: str, record: dict) -> None:
    """Write ``record`` to ``path`` whole, mode 0600 from its creation (never readable by others)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def client_file(ipp_cluster) -> str:
    """The client connection file of ``ipp_cluster`` (an ``ipyparallel.Cluster``): the controller's
    addresses and the HMAC key."""
    return os.path.join(ipp_cluster.profile_dir, "security", f"ipcontroller-{ipp_cluster.cluster_id}-client.json")


def check_signed(ipp_cluster, client) -> None:
    """ClusterError unless every connection file of the cluster and the client sign with a non-empty key.

    ipyparallel signs each message with HMAC-SHA256 over the key in the connection files; an empty key
    turns signing off, and then anyone who reaches the controller's ports could run code on the ranks.
    """
    security = os.path.join(ipp_cluster.profile_dir, "security")
    for kind in ("client", "engine"):
        path = os.path.join(security, f"ipcontroller-{ipp_cluster.cluster_id}-{kind}.json")
        try:
            with open(path) as f:
                info = json.load(f)
        except (OSError, ValueError) as exc:
            raise ClusterError(f"the {kind} connection file {path} cannot be read ({exc})") from None
        if not info.get("key") or info.get("signature_scheme", "hmac-sha256") != "hmac-sha256":
            raise ClusterError(f"the {kind} connection file {path} has no message key (or no HMAC-SHA256 "
                               "signing): distnb does not run unsigned worlds; remove any Session.key='' setting "
                               "from the ipyparallel profile")
    session = client.session
    if not session.key or session.signature_scheme != "hmac-sha256":
        raise ClusterError("the ipyparallel client does not sign its messages (an empty Session.key): distnb does "
                           "not run unsigned worlds; remove any Session.key='' setting from the ipyparallel profile")


def _kernel_state(session) -> str:
    """What the kernel knows of the ranks, for an attached kernel (base64 of a pickle)."""
    c = session.cluster
    held = {}
    for name in HELD_FIELDS:
        value = getattr(session.holdings, name)
        try:
            pickle.dumps(value)
        except Exception:  # a fingerprint that does not pickle: the attached kernel sends that again
            continue
        held[name] = value
    state = dict(spec=c.spec, ranks=c.ranks, engine_ids=c.engine_ids, placement=getattr(c, "placement", None),
                 where=getattr(c, "where", None), master_addr=getattr(c, "master_addr", None),
                 master_port=c.master_port, generation=c.generation, num_nodes=c.num_nodes, remote=c.remote,
                 launcher=getattr(c, "launcher", "local"), controller_ip=getattr(c, "controller_ip", None),
                 family=list(getattr(c, "family", [])), job_id=c.job_id, held=held,
                 on_failure=session.on_failure)
    return base64.b64encode(pickle.dumps(state)).decode()


def _process_start(pid) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, TypeError, ValueError):
        return None


def record_of(session, run=None) -> dict:
    """The record of ``session``'s world (``run``: the running cell's dict, or None)."""
    c = session.cluster
    ipp_cluster = c._ipp
    spec = c.spec
    keeper = getattr(c, "reaper", None)
    controller = c.pids["controller"]
    return dict(
        cluster_id=ipp_cluster.cluster_id, cluster_file=ipp_cluster.cluster_file, client_file=client_file(ipp_cluster),
        profile_dir=ipp_cluster.profile_dir, kernel_pid=os.getpid(), kernel_started=_process_start(os.getpid()),
        keeper_pid=getattr(keeper, "pid", None), controller_pid=controller,
        controller_started=_process_start(controller), notebook=os.environ.get("JPY_SESSION_NAME"),
        uid=os.getuid(), host=socket.gethostname(), world_size=c.world_size, backend=spec.backend,
        device_type=spec.device_type, linger_s=getattr(spec, "linger", None),
        checkpoint_dir=getattr(c, "lease_folder", None) or os.path.abspath(DEFAULT_CHECKPOINT_DIR),  # the keeper's
        started=getattr(session, "started_at", time.time()),
        ranks=[dict(rank=r["rank"], pid=r["pid"], host=r["host"], device=r["device"]) for r in c.ranks],
        run=run, last_model=(run or {}).get("model") or getattr(getattr(session.last_result, "plan", None), "model",
                                                                   None) or getattr(session, "last_model", None),
        kernel_state=_kernel_state(session))


def write(session, run=None) -> str | None:
    """Write (or rewrite) the record of ``session``'s world; its path. None for a world on other hosts' launchers
    that has no ipyparallel cluster file (nothing to attach to)."""
    c = session.cluster
    if c._ipp is None or not c._ipp.cluster_file:
        return None
    path, record = record_path(c._ipp.cluster_id), record_of(session, run)
    with _LOCK, locked():  # newer than any record a thread of note_run still has to write
        _write(path, record)
        _NEWEST[c._ipp.cluster_id] = next(_TICKETS)
    return path


@contextlib.contextmanager
def locked():
    """Hold the records' lock, which every kernel of this user takes to write or remove a record.

    An exclusive ``fcntl.flock`` on :data:`LOCK_FILE` (mode 0600, in the 0700 :func:`folder`); it is released when
    the block ends, or by the operating system when the holder dies. Held for a read and a rename (milliseconds).

    Raises
    ------
    ClusterError
        The records' folder belongs to another user (see :func:`folder`).
    OSError
        The lock file cannot be made (a full disk, a read-only runtime folder).
    """
    fd = os.open(os.path.join(folder(), LOCK_FILE), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor of this open file releases the lock


def owned_here(cluster_id: str) -> bool:
    """Whether the record of world ``cluster_id`` names this kernel as its owner (False when there is none:
    the world was stopped). Another kernel that attached since owns the world, and writes its record itself."""
    try:
        record = read(record_path(cluster_id))
    except ClusterError:
        return False
    return record.get("kernel_pid") == os.getpid() and _same_process(os.getpid(), record.get("kernel_started"))


def note_run(session, run) -> threading.Thread | None:
    """A training cell started (``run``: its dict, see the module doc) or ended (None): the record says so.

    The record is made here and written by a thread (a rename took 1-4 ms on this machine's disk, a cell's
    kernel-side cost is tens of ms); the newest of a world's records is the one that stays, whatever order
    the threads run in. The record is rewritten only while it names this kernel, checked under the records'
    lock (:func:`locked`) together with the write: none is written once any kernel's :func:`remove` removed the
    world's, and a kernel that another kernel attached to since (it owns the world now, and follows the cell
    itself) leaves the record to that one. A record that cannot be written (a full disk) costs the cell
    nothing: attaching sees the last one.

    Returns
    -------
    threading.Thread or None
        The writing thread (join it to wait for the write), None when nothing is written.
    """
    try:
        ipp_cluster = session.cluster._ipp
        if ipp_cluster is None or not ipp_cluster.cluster_file or not owned_here(ipp_cluster.cluster_id):
            return None  # checked again under the lock by the writing thread: this is only the cheap early answer
        cid, record = ipp_cluster.cluster_id, record_of(session, run)
    except (OSError, ClusterError):
        return None
    ticket = next(_TICKETS)
    thread = threading.Thread(target=_write_newest, args=(cid, ticket, record), name="distnb-world-record",
                              daemon=True)
    thread.start()
    return thread


_TICKETS = itertools.count()
_NEWEST: dict = {}  # cluster_id -> the ticket of the newest record written (math.inf once removed)
_LOCK = threading.Lock()


def _write_newest(cid: str, ticket: int, record: dict) -> None:
    """Write ``record`` (a :func:`note_run` record of world ``cid``, numbered ``ticket``) unless a newer one of this
    kernel was written, or the record no longer names this kernel (stopped, or taken by another kernel)."""
    with _LOCK:
        if ticket < _NEWEST.get(cid, -1):
            return
        try:
            with locked():
                if not owned_here(cid):
                    return
                _write(record_path(cid), record)
        except (OSError, ClusterError):
            return
        _NEWEST[cid] = ticket


def remove(cluster_id: str | None) -> None:
    """Remove the record of ``cluster_id`` (its world stopped)."""
    if not cluster_id:
        return
    with _LOCK:
        _NEWEST[cluster_id] = math.inf  # a record still being written for it is not written after this
        try:
            with locked():  # the other kernels' writers see it gone (their check and write hold this lock)
                os.remove(record_path(cluster_id))
        except (OSError, ClusterError):
            pass


def read(path: str) -> dict:
    """The record at ``path``, checked to be this user's own and private.

    Raises
    ------
    ClusterError
        It cannot be read (another user's: permission denied), or it is not owner-only, or not a record.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except PermissionError:
        raise ClusterError(f"cannot read the world record {path}: permission denied. Only the user who started a "
                           "world can attach to it") from None
    except OSError as exc:
        raise ClusterError(f"cannot read the world record {path}: {exc.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ClusterError(f"the world record {path} is not private to you (owner uid {st.st_uid}, mode "
                               f"{stat.S_IMODE(st.st_mode):o}): refused; a record must be yours and mode 0600")
        try:
            record = json.load(f)
        except ValueError as exc:
            raise ClusterError(f"{path} is not a distnb world record ({exc})") from None
    if not isinstance(record, dict) or "cluster_id" not in record:
        raise ClusterError(f"{path} is not a distnb world record (no cluster_id)")
    record["path"] = path
    return record


def kernel_state(record: dict) -> dict:
    """The kernel-side state a record carries (see :func:`_kernel_state`); the record was checked by :func:`read`."""
    return pickle.loads(base64.b64decode(record["kernel_state"]))


def _same_process(pid, started) -> bool:
    """Whether ``pid`` runs and is the process that started at ``started`` (not a reused pid)."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.Error:
        return False


def why_stale(record: dict) -> str:
    """Why the world of ``record`` is gone ('' while it lives): its controller ended, its connection file is
    gone, or both its kernel and its keeper ended (nothing can attach to it or keep it)."""
    if not _same_process(record.get("controller_pid"), record.get("controller_started")):
        return f"its controller (pid {record.get('controller_pid')}) has ended"
    if not os.path.exists(record.get("client_file") or ""):
        return "its connection file is gone"
    kernel = _same_process(record.get("kernel_pid"), record.get("kernel_started"))
    if not kernel and not _same_process(record.get("keeper_pid"), None):
        return f"its kernel (pid {record.get('kernel_pid')}) and its keeper have ended"
    return ""


def live(clean: bool = True) -> list:
    """The records of this user's live worlds (newest first); stale ones are removed when ``clean``."""
    out = []
    base = folder()
    for name in sorted(os.listdir(base)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(base, name)
        try:
            record = read(path)
        except ClusterError:
            continue
        if why_stale(record):
            if clean:
                try:
                    os.remove(path)
                except OSError:
                    pass
            continue
        out.append(record)
    return sorted(out, key=lambda r: -(r.get("started") or 0))


def opened(session) -> None:
    """``%dist start`` made ``session``: check that its messages are signed, then write its record.

    Raises
    ------
    ClusterError
        The cluster does not sign its messages (it is stopped first).
    """
    c = session.cluster
    try:
        check_signed(c._ipp, c.client)
    except ClusterError:
        session.stop(quiet=True)
        raise
    session.started_at = time.time()
    try:
        write(session)
    except (OSError, ClusterError):  # no runtime folder of our own: the world runs, it cannot be attached to
        pass


def closed(session) -> None:
    """``%dist stop``: the record of ``session``'s world goes."""
    ipp_cluster = getattr(session.cluster, "_ipp", None)
    remove(getattr(ipp_cluster, "cluster_id", None))
