"""``%dist attach`` / :func:`attach`: list this user's live worlds, and join one from a new kernel (issue 38).

A world started by ``%dist start`` in one kernel is found again from another through its record
(:mod:`distnb.cluster.worlds`) and ipyparallel's connection files: the new kernel gets a
:class:`~distnb.session.Session` that talks to the same controller and engines, so ``%dist status``,
``%dist where``, ``%dist wait``, ``%dist stop-training``, ``%dist stop`` and the next ``%%distrain``
cells work as in the kernel that started it. A training cell still running is followed to its end
(:mod:`distnb.train.following`): the dashboard resumes, ``%dist wait`` returns its TrainResult.

Security: only the user who started a world can attach. The record and the connection files are
readable by their owner only (0600, in a 0700 folder under Jupyter's runtime folder), and every
message is signed with the world's key (HMAC-SHA256): a client without the key gets no answer from
the controller, which :func:`connect` turns into an error after ``timeout`` seconds, never a hang.

The idea follows ipyparallel's own reconnection (``Cluster.from_file``, a client made from the
controller's connection file); Ray's detached actors and Monarch's job reload are the same kind of thing.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import time
import types
import weakref

import ipyparallel as ipp

from distnb import session as sessions
from distnb.cluster import launchers, lease, worlds
from distnb.cluster.cluster import Cluster
from distnb.core.errors import ClusterError, PlanError
from distnb.core.tables import Table
from distnb.train import background, following
from distnb.train.homecoming import weights_back

#: Seconds a listing listens for each running cell's progress (the ranks publish every 0.1-2 s).
LISTEN_SECONDS = 2.5


class FollowingClient(ipp.Client):
    """An ipyparallel Client that also takes the IOPub messages (printed output, progress) of tasks sent by
    another client of the same world: those of the kernel that started the training cell running now.

    ipyparallel's controller broadcasts every task's IOPub messages to all clients, and a Client drops those
    whose parent message came from another client session; the followed sessions' messages are taken as this
    client's own (their signatures are checked first, as for every message).
    """

    followed: frozenset = frozenset()

    def _dispatch_iopub(self, msg):
        _, parts = self.session.feed_identities(msg, copy=False)
        try:
            msg = self.session.deserialize(parts, content=True, copy=False)
        except Exception:  # a bad signature, or not a message: ipyparallel drops it too
            return None
        parent = msg.get("parent_header") or {}
        if parent.get("session") in self.followed:
            msg["parent_header"] = dict(parent, session=self.session.session)
        return ipp.Client._dispatch_iopub.__wrapped__(self, msg)


class WorldsTable(Table):
    """``%dist attach`` with no world named: this user's live worlds, one row each (newest first).

    Columns: world (the id ``%dist attach ID`` takes), notebook, ranks, backend, strategy and cell
    (the running training cell's strategy and first line, or ``between cells``), progress (its
    last reported place: epoch and step), kernel (its pid, ``ended`` once it died), started.
    ``records[i]``: each world's record (:mod:`distnb.cluster.worlds`).
    """

    columns = ("world", "notebook", "ranks", "backend", "strategy", "cell", "progress", "kernel", "started")


def _cell_line(source: str) -> str:
    lines = [ln.strip() for ln in (source or "").splitlines() if ln.strip() and not ln.strip().startswith("%%")]
    first = lines[0] if lines else ""
    return first if len(first) <= 50 else first[:47] + "..."


def _progress_of(record: dict, seconds: float) -> str:
    """Where the running cell of ``record`` is (rank 0's last progress message), heard for up to ``seconds``."""
    run = record.get("run")
    if not run:
        return ""
    try:
        client = connect(record, timeout=min(5.0, seconds + 2.0))
    except ClusterError as exc:
        return f"unknown ({exc})"[:80]
    try:
        md = client.metadata[run["msg_ids"][0]]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (md.get("data") or {}).get("distnb"):
            time.sleep(0.1)
        msg = (md.get("data") or {}).get("distnb")
        if isinstance(msg, bytes):  # the ranks' own encoding of a progress message (distnb.engine.transport.report.encode)
            msg = pickle.loads(msg)
        if not msg:
            done = client.metadata[run["msg_ids"][0]].get("status") == "idle"
            return "finished" if done else "running (no report heard)"
        total = (run.get("progress") or {}).get("total_steps")
        if msg.get("epoch") is None:
            return str(msg.get("status") or "")
        return (f"epoch {msg['epoch']} of {msg.get('epochs', '?')}, step {msg.get('step', 0)}"
                + (f" of {total}" if total else "") + (f" ({msg['status']})" if msg.get("status") != "running" else ""))
    finally:
        client.close()


def list_worlds(listen: float = LISTEN_SECONDS) -> WorldsTable:
    """This user's live worlds (stale records removed), with each running cell's progress.

    Parameters
    ----------
    listen : float
        Seconds to listen for each running cell's progress (0: read only the records).

    Returns
    -------
    WorldsTable
    """
    records = worlds.live()
    rows = []
    for rec in records:
        run = rec.get("run") or {}
        kernel_alive = worlds._same_process(rec.get("kernel_pid"), rec.get("kernel_started"))
        rows.append(dict(
            world=rec["cluster_id"], notebook=rec.get("notebook") or "", ranks=rec.get("world_size"),
            backend=f"{rec.get('backend')} on {rec.get('device_type')}", strategy=run.get("strategy") or "",
            cell=_cell_line(run.get("cell")) if run else "between cells",
            progress=_progress_of(rec, listen) if run and listen > 0 else "",
            kernel=f"{rec.get('kernel_pid')}" + ("" if kernel_alive else " (ended)"),
            started=time.strftime("%H:%M:%S", time.localtime(rec.get("started") or 0))))
    table = WorldsTable(rows, title=f"{len(rows)} live distnb world{'s' if len(rows) != 1 else ''} of yours"
                        if rows else "no live distnb world of yours")
    table.records = records
    table.notes = ["join one: %dist attach ID (or distnb.attach('ID')); --model NAME takes the trained weights"] \
        if rows else [f"worlds are recorded in {worlds.folder()} by %dist start"]
    return table


def _find(world) -> dict:
    """The record of ``world``: an id (or its unique prefix), a record file's path, or None for the only one."""
    if world is not None and (os.sep in str(world) or str(world).endswith(".json")):
        return worlds.read(str(world))
    records = worlds.live()
    if world is not None:
        records = [r for r in records if r["cluster_id"].startswith(str(world))]
    if len(records) == 1:
        return records[0]
    if not records:
        named = f" named {world!r}" if world is not None else ""
        raise ClusterError(f"no live distnb world{named} of yours to attach to (%dist attach lists them; worlds are "
                           f"recorded in {worlds.folder()})")
    ids = ", ".join(r["cluster_id"] for r in records)
    raise ClusterError(f"{len(records)} live worlds match: {ids}; name one: %dist attach ID")


def connect(record: dict, timeout: float = 10.0):
    """An ipyparallel Client of the world of ``record``, signed with the key of its connection file.

    Raises
    ------
    ClusterError
        The connection file cannot be read (another user's), or the controller did not answer within
        ``timeout`` seconds: it ignores every message not signed with the world's key (a wrong key),
        or it has ended.
    """
    path = record.get("client_file") or ""
    try:
        with open(path) as f:
            info = json.load(f)
        key = info.get("key")
    except PermissionError:
        raise ClusterError(f"cannot read the connection file {path}: permission denied. Only the user who started "
                           "the world can attach to it") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise ClusterError(f"cannot read the connection file {path} ({exc})") from None
    if not key:
        raise ClusterError(f"the connection file {path} has no key: distnb does not attach to unsigned worlds")
    # launchers.connect_client keeps ipyparallel's %px magics out of the notebook; it asks for the client itself
    maker = types.SimpleNamespace(connect_client_sync=lambda: FollowingClient(info, timeout=timeout))
    try:
        client = launchers.connect_client(maker)
    except (TimeoutError, ipp.error.TimeoutError) as exc:
        raise ClusterError(f"the controller of world {record['cluster_id']} did not answer within {timeout:g} s "
                           f"({exc}): it ignores messages not signed with the world's key (HMAC-SHA256), so the key in "
                           f"{path} is not the world's, or the controller has ended; attach refused") from None
    sender = (record.get("run") or {}).get("session")
    client.followed = frozenset([sender] if sender else [])
    return client


def _cluster(record: dict, client, state: dict) -> Cluster:
    """A distnb Cluster in this kernel for the running world of ``record`` (its engines, ranks, process group)."""
    with open(record["cluster_file"]) as f:
        info = json.load(f)
    for part in ("controller", "engines"):  # ipyparallel writes "module:Class", and imports only "module.Class"
        if isinstance(info.get(part), dict) and "class" in info[part]:
            info[part]["class"] = info[part]["class"].replace(":", ".")
    cluster = Cluster(state["spec"])
    cluster._ipp = ipp.Cluster.from_dict(info, log=logging.getLogger("distnb.ipyparallel"))
    cluster.client = client
    for name in ("ranks", "engine_ids", "placement", "where", "master_addr", "master_port", "generation",
                 "num_nodes", "remote", "launcher", "controller_ip", "family", "job_id"):
        setattr(cluster, name, state[name])
    cluster.reaper = None  # the keeper was started by the world's first kernel
    missing = [r for r, e in enumerate(cluster.engine_ids) if e not in client.ids]
    if missing:
        raise ClusterError(f"ranks {missing} of world {record['cluster_id']} are no longer registered with its "
                           "controller; attach, then %dist restart for a fresh world (or %dist stop)")
    return cluster


def attach(world=None, model=None, ns=None, timeout: float = 10.0, quiet: bool = False):
    """List this user's live worlds, or join one in this kernel (``%dist attach``).

    Parameters
    ----------
    world : str, optional
        The world's id (``%dist attach`` lists them; a unique prefix will do) or its record file.
        Left out with ``model`` left out too: the listing (a :class:`WorldsTable`), joining nothing.
        Left out with ``model`` given: the only live world.
    model : str or torch.nn.Module, optional
        A notebook module of the same structure as the ranks' model (or its name in ``ns``): the
        trained weights go into it in place when the running training cell ends (at once when none
        runs), and the cell's TrainResult is returned. Later cells with this object as ``--model``
        continue the ranks' live model (it is not sent again).
    ns : dict, optional
        The namespace names are looked up in (default: the IPython user namespace).
    timeout : float
        Seconds the controller has to answer (a wrong key never gets an answer).
    quiet : bool
        Print nothing.

    Returns
    -------
    WorldsTable, Session or TrainResult
        The listing; the joined Session (a running cell is followed in the background: ``%dist
        wait`` returns its TrainResult); with ``model``, the TrainResult (None when no cell ran since
        the attach and none was running).

    Raises
    ------
    ClusterError
        No such world, several match, this kernel runs a world already, the record or connection
        files are another user's, or the controller did not answer (a wrong key, it ended).
    """
    if world is None and model is None:
        return list_worlds()
    if sessions._CURRENT is not None and sessions._CURRENT.running:
        raise ClusterError(f"this kernel runs a world of {sessions._CURRENT.world_size} ranks already; %dist stop it "
                           "before attaching to another")
    record = _find(world)
    why = worlds.why_stale(record)
    if why:
        raise ClusterError(f"world {record['cluster_id']} cannot be attached to: {why}")
    state = worlds.kernel_state(record)
    s = sessions.Session(None, ns=ns)
    model_obj = s._lookup(model, "--model") if isinstance(model, str) else model
    client = connect(record, timeout)
    try:
        s.cluster = _cluster(record, client, state)
        lease.claim(record["cluster_id"], os.getpid(), timeout=timeout)  # this kernel owns the world from now on
    except BaseException:  # no keeper for it, its lease expired, ranks gone: this kernel holds nothing of it
        client.close()
        raise
    _adopt(s, record, state)
    if not quiet:
        print(f"distnb: attached to world {record['cluster_id']} ({s.world_size} ranks, {s.cluster.spec.backend} on "
              f"{s.cluster.spec.device_type}{', notebook ' + record['notebook'] if record.get('notebook') else ''})"
              + ("; following its running training cell" if record.get("run") else ""))
    if record.get("run"):
        s._background = background.BackgroundRun(following.follow, dict(session=s, record=record, model_obj=model_obj))
        s._background.start()
        return s.wait() if model_obj is not None else s
    if model_obj is not None:
        _weights_now(s, record, model_obj, quiet)
        return None
    return s


def _adopt(s, record: dict, state: dict) -> None:
    """Make ``s`` this kernel's session, holding what the ranks hold, and rewrite the record with this kernel."""
    for name, value in state.get("held", {}).items():
        setattr(s.holdings, name, value)
    s.on_failure = state.get("on_failure") or "stop"
    s.started_at = record.get("started") or time.time()
    s.last_model = record.get("last_model")
    sessions._CURRENT = s
    atexit.register(sessions._stop_at_exit)
    try:  # this kernel owns the world now: the record says so (the first kernel, if alive, leaves it to this one)
        worlds.write(s, record.get("run"))
    except (OSError, ClusterError):
        pass


def _weights_now(s, record: dict, model_obj, quiet: bool) -> None:
    """No training cell runs: the ranks' live model (the last one trained) into ``model_obj`` now."""
    name = record.get("last_model")
    if not name:
        raise PlanError("--model: the ranks of this world have trained no model yet, so there are no weights to take")
    weights_back(s, name, model_obj)
    s.holdings.objects[name] = weakref.ref(model_obj)  # this object is the ranks' live model from now on
    if not quiet:
        steps = s.holdings.trained_steps.get(name)
        print(f"distnb: the ranks' {name} (no training cell running{f', {steps} steps trained' if steps else ''}) is "
              "now in the notebook's model")
