"""Per-engine runtime: environment, device, thread count and the process group.

Every function here runs inside an engine. ``setup`` is called once per engine right
after the cluster starts; ``reform`` forms a fresh process group (on the same store) after a
failure; ``shutdown`` destroys the group and leaves with ``os._exit(0)``, which avoids
the exit-time abort seen after gloo DDP (FIELD-NOTES pitfall 1).
"""

from __future__ import annotations

import ast
import datetime
import gc
import linecache
import os
import socket
import sys
import time
import traceback
import types

from distnb.core import gpus
from distnb.core.net import interface_of, is_loopback, loopback_interface, route_address
from distnb.engine.process import abort, binding, health, lean, ncclfail, postmortem
from distnb.engine.process.collectives import checked
from distnb.engine.process.where import Watchdog
from distnb.engine.transport.report import publish_raw


class _State:
    rank = None
    world_size = None
    local_rank = None
    backend = None
    device = None
    timeout = 60.0
    generation = 0  # bumps every time a process group is formed
    broken = False  # a collective failed; the group must be re-formed before use
    kept = False  # the last %%dist cell failed in its own code and the group was kept (engine/health.py)
    interface = None  # --interface: the network interface rendezvous and gloo use
    node_rank = 0
    host = None  # how errors name this rank's host
    user_env = frozenset()  # interface variables the user set in the engine's environment
    modules_at_init = frozenset()  # sys.modules when the group formed


STATE = _State()
#: Callables that drop references to the process group (e.g. DDP wrappers), see release().
RELEASE_HOOKS = []
#: Callables returning a dict of more facts about this rank for :func:`info` (``%dist status``),
#: e.g. its device-mesh coordinates; one that raises adds nothing.
INFO_HOOKS = []
#: Names ``%%dist`` cells bound (or rebound) in the namespace: what ``%dist scale`` hands added ranks.
CELL_NAMES: set = set()


#: The TCPStore this rank's last group formed on, kept for a re-form on the same port (see :func:`_group_base`).
_BASE = {"key": None, "store": None, "count": [0]}


def _group_base(master_addr: str, master_port: int, timeout, reuse: bool):
    """The TCPStore a group forms on: with ``reuse``, the last group's again when it is on the same port and
    still answers (no new connection), else a new one (rank 0 serves it).

    Every connection torch makes formats its peer's address with ``getnameinfo``, a reverse DNS lookup: a
    resolver that drops some of 32 such queries at once (seen here for ``::ffff:127.0.0.1``) held a re-form
    5 s (the resolver's timeout). A re-form now opens none; its keys are apart by the group's prefix.
    """
    key = (master_addr, master_port, STATE.rank == 0)
    if reuse and _BASE["key"] == key and abort.answers(_BASE["store"], _BASE["count"], STATE.rank):
        return _BASE["store"]
    _forget_store()  # rank 0: the old store stops serving before a new one binds
    store = _store(master_addr, master_port, timeout)
    _BASE.update(key=key, store=store)
    return store


def _forget_store() -> None:
    """Let the last group's store go (rank 0: its port is free again once nothing else holds it)."""
    _BASE.update(key=None, store=None, count=[0])
    abort.forget_store()


def _init_group(master_addr: str, master_port: int, generation: int = 0) -> None:
    """Form the process group on ``master_addr:master_port``; ``generation`` > 0: a re-form, on the last store."""
    import torch.distributed as dist

    abort.disarm()
    if dist.is_initialized():
        drop_captured_group(dist.group.WORLD)
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    else:  # an init that failed (a rendezvous timeout) still counted its group: torch names the next one
        # after that count (its store keys' prefix), so a rank whose last init failed later than another's
        # would wait for keys the others never write; destroy_process_group resets the count to 0, as here
        from torch.distributed import distributed_c10d

        distributed_c10d._world.group_count = 0
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    kwargs = {}
    if STATE.backend == "nccl":
        import torch

        kwargs["device_id"] = STATE.device
    _pin_interface(master_addr)
    timeout = datetime.timedelta(seconds=STATE.timeout)
    base = _group_base(master_addr, master_port, timeout, reuse=generation > 0)
    prefix = f"distnb-group-{generation}/"  # a re-form's keys apart from the last group's (torch's own restart at 0)
    store = dist.PrefixStore(prefix, base)
    before, modules = abort.socket_fds(), frozenset(sys.modules)  # modules loaded before the group cannot hold it
    dist.init_process_group(
        STATE.backend,
        store=store,
        rank=STATE.rank,
        world_size=STATE.world_size,
        timeout=timeout,
        **kwargs,
    )
    abort.arm(base, prefix, before, STATE.backend)  # one rank's failure ends every rank's collective (engine/abort.py)
    binding.float_gloo()  # gloo's threads on every core the rank may use, the rest of the rank on its share
    STATE.modules_at_init = modules  # skipped by drop_captured_group (a preload thread may import meanwhile)
    STATE.generation += 1
    STATE.broken = False


def _pin_interface(master_addr: str) -> None:
    """Make gloo (and nccl's bootstrap) use the interface this host reaches ``master_addr`` over.

    Without it gloo listens on whatever the hostname resolves to, which on one machine
    is not loopback-only and on several hosts may be an address the others cannot reach.
    ``--interface NAME`` (``STATE.interface``) wins; a variable the user set wins over both.
    """
    name = STATE.interface
    if not name:
        name = loopback_interface() if is_loopback(master_addr) else interface_of(route_address(master_addr))
    if name:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if var not in STATE.user_env:
                os.environ[var] = name


def _store(master_addr: str, master_port: int, timeout):
    """The process group's TCPStore; rank 0 serves it on ``master_addr`` only.

    torch's own ``tcp://`` rendezvous makes rank 0's store listen on every interface;
    here rank 0 binds the listening socket itself and hands it to the store
    (``master_listen_fd``). A taken port is a RuntimeError naming it and the fix.
    """
    import torch.distributed as dist

    if STATE.rank != 0:
        _probe_rendezvous(master_addr, master_port, timeout.total_seconds())
        return dist.TCPStore(master_addr, master_port, STATE.world_size, False, timeout)
    family, kind, proto, _, address = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(max(128, STATE.world_size))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"rank 0 cannot listen on {master_addr}:{master_port} for the process group's store "
                           f"({exc.strerror or exc}): pick another --master-port, or leave it out and distnb "
                           "picks a free one") from None
    return dist.TCPStore(master_addr, master_port, STATE.world_size, True, timeout, master_listen_fd=sock.detach())


def _probe_rendezvous(master_addr: str, master_port: int, timeout: float) -> None:
    """Connect to rank 0's store until it answers; an error naming this host, the address and the port.

    torch's own client retries silently for the whole timeout and then names neither the host
    that could not connect nor what to change.
    """
    deadline = time.monotonic() + timeout
    last, pause = None, 0.005  # rank 0 listens within milliseconds of the others asking: retry soon, then less often
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((master_addr, master_port), timeout=max(0.1, min(5.0, left))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() + pause >= deadline:
            break
        time.sleep(pause)
        pause = min(0.1, pause * 2)
    why = last.strerror if getattr(last, "strerror", None) else (str(last) or type(last).__name__)
    raise RuntimeError(
        f"rank {STATE.rank} on host {STATE.host} cannot reach the rendezvous at {master_addr}:{master_port} "
        f"(rank 0's torch.distributed store) within {timeout:.0f} s: {why}. Check that {STATE.host} can reach "
        f"{master_addr} on TCP port {master_port} (routes, firewall), or pick the network with "
        "%dist start --interface NAME or --master-addr ADDR")


def setup(ns: dict, rank: int, world_size: int, local_rank: int, backend: str, device_type: str,
          gpu: str | None, num_threads: int, master_addr: str, master_port: int,
          timeout: float, node_rank: int = 0, host: str | None = None, interface: str | None = None,
          bind_among: int | None = None, local_world_size: int | None = None) -> dict:
    """Make this engine rank ``rank``: env vars, device, threads, CPU binding, process group.

    Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (``local_world_size``: the ranks on this
    host), NODE_RANK, MASTER_ADDR, MASTER_PORT (and for GPU engines, before CUDA is initialised,
    CUDA_VISIBLE_DEVICES with ``gpu`` at position ``local_rank``, :func:`distnb.core.gpus.layout`: the
    device is ``cuda:<local_rank>``, as under torchrun, so ``set_device(int(os.environ["LOCAL_RANK"]))``
    works; an engine its launcher gave one GPU sees it as ``cuda:0``), plus the nccl variables of
    :data:`distnb.engine.process.ncclfail.ENV`,
    GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME (``interface``, else the interface that reaches
    ``master_addr``; unless set by the user), and defines ``rank``, ``world_size``,
    ``local_rank``, ``node_rank`` and ``device`` in the engine namespace ``ns``. ``host``
    names this rank's host in errors. ``bind_among``: the ranks that share this host's cores,
    this one bound to its share (:func:`distnb.engine.process.binding.bind`; None: not bound).

    Returns
    -------
    dict
        rank, pid, host, device, backend, num_threads, seconds (float, set-up time).
    """
    t0 = time.perf_counter()

    lean.apply()  # each later call on this engine costs less (no empty flush round trips, no busy status)
    if STATE.rank is None:  # first set-up: what the user set stays theirs
        STATE.user_env = frozenset(v for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if v in os.environ)
    STATE.node_rank, STATE.interface = node_rank, interface
    STATE.host = host or socket.gethostname()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world_size or 1), NODE_RANK=str(node_rank),
                      OMP_NUM_THREADS=str(num_threads))
    index = 0
    if device_type == "cuda" and gpu is not None:
        order, index = gpus.layout(gpus.discover()["gpus"], gpu, local_rank)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(order)
    if backend == "nccl":
        ncclfail.set_env(os.environ)
    import torch  # torch._dynamo (DDP needs it) loads meanwhile in the engine's preload thread (ipengine)

    torch.set_num_threads(num_threads)
    binding.bind(local_rank, bind_among)  # before the group; gloo's threads are given every core once it formed
    STATE.rank, STATE.world_size, STATE.local_rank = rank, world_size, local_rank
    STATE.backend, STATE.timeout = backend, float(timeout)
    if device_type == "cuda":
        torch.cuda.set_device(index)
        STATE.device = torch.device("cuda", index)
    else:
        STATE.device = torch.device("cpu")
    try:
        _init_group(master_addr, master_port)
    finally:  # distnb's engine (ipengine) goes on importing torch._dynamo and the loop in its thread
        preload = sys.modules.get("distnb.engine.ipengine")
        if preload is not None:
            preload.RESUME.set()
    ns.update(rank=rank, world_size=world_size, local_rank=local_rank, node_rank=node_rank, device=STATE.device)

    postmortem.install_breakpoint_hook()
    return info(seconds=time.perf_counter() - t0)


def drop_captured_group(pg) -> int:
    """Replace ``pg`` where torch captured it as a default argument by None (the default group).

    Functions such as ``torch.distributed.nn.functional.all_reduce(..., group=group.WORLD)`` or
    ``ShardedGradScaler(process_group=dist.group.WORLD)`` evaluate the default when their module
    is imported; imported while a group exists, they hold that group, which then outlives
    ``destroy_process_group`` (its gloo sockets stay open) and would be used after a re-form.
    Only plain functions and the methods of classes in loaded ``torch`` modules are examined, by
    type, without attribute access (which could initialise CUDA). Modules already loaded when the
    group formed cannot hold it and are skipped (walking all of torch's took 0.1 s, 1.2 s on a
    loaded machine, on every failure). Returns how many were changed.
    """

    if pg is None:
        return 0
    changed = 0

    def fix(fn):
        nonlocal changed
        if type(fn) in (staticmethod, classmethod):
            fn = fn.__func__
        if type(fn) is not types.FunctionType:
            return
        if fn.__defaults__ and any(x is pg for x in fn.__defaults__):
            fn.__defaults__ = tuple(None if x is pg else x for x in fn.__defaults__)
            changed += 1
        if fn.__kwdefaults__ and any(v is pg for v in fn.__kwdefaults__.values()):
            fn.__kwdefaults__ = {k: None if v is pg else v for k, v in fn.__kwdefaults__.items()}
            changed += 1

    old = STATE.modules_at_init
    for name, module in list(sys.modules.items()):
        if name in old or type(module) is not types.ModuleType or not (name == "torch" or name.startswith("torch.")):
            continue
        for value in list(vars(module).values()):
            if issubclass(type(value), type):
                for member in list(vars(value).values()):
                    fix(member)
            else:
                fix(value)
    return changed


def info(**extra) -> dict:
    """This rank's identity: rank, pid, host, device, backend, group generation (and :data:`INFO_HOOKS`' facts)."""
    import torch

    out = dict(rank=STATE.rank, pid=os.getpid(), host=STATE.host or socket.gethostname(), device=str(STATE.device),
               local_rank=STATE.local_rank, node_rank=STATE.node_rank,
               backend=STATE.backend, generation=STATE.generation, broken=STATE.broken,
               num_threads=torch.get_num_threads(), bound=binding.CORES is not None,
               cores=binding.describe(binding.CORES or binding.allowed(), everywhere=binding.CORES is None))
    for hook in INFO_HOOKS:
        try:
            out.update(hook())
        except Exception:  # a fact we cannot tell never hides the rank's identity
            pass
    out.update(extra)
    return out


def reform(ns: dict, master_addr: str, master_port: int, generation: int = 0) -> dict:
    """Form a new process group on ``master_port`` after a failure (the last group's store when it is on that
    port: ``generation``, counted by the kernel, keeps the new group's keys apart).

    What still references the old group (strategy wrappers, the last traceback the engine
    kept, with its frames) is dropped first: a DDP wrapper left alive keeps its gradient
    hooks on the parameters, and the next wrapper over the same parameters would fail.
    """
    mark_broken(ns, announce=False)
    _init_group(master_addr, master_port, generation)
    return info()


def clear_exception_frames(exc: BaseException) -> None:
    """Clear the locals of every finished frame in ``exc``'s traceback and its chained exceptions.

    A traceback keeps its frames' locals alive (a DDP wrapper, the batch, the graph); the
    process group can only close once nothing references it.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def mark_broken(ns: dict | None = None, announce: bool = True) -> None:
    """Tear down this rank's process group after a failure so peers blocked in a collective fail fast.

    ``destroy_process_group`` alone does not close gloo's sockets while a DDP wrapper
    (or a traceback frame holding one) still references the group, and a peer blocked
    in a collective then waits for the full timeout. So every reference distnb holds is
    dropped first (:data:`RELEASE_HOOKS`, ``model``/``ctx`` in the namespace, the last
    traceback); the peers' pending collectives then fail at once with "Connection
    closed by peer", and the kernel re-forms the group (same store, new key prefix). A traceback kept for
    ``%dist debug`` keeps its frames: the objects in them let go of the group instead
    (:func:`distnb.engine.process.postmortem.free_groups`). With ``announce`` (a failure, not a re-form), the
    group's first failure is told to every rank, whose pending collectives then fail at once as well
    (:mod:`distnb.engine.process.abort`).
    """

    import torch.distributed as dist


    if announce and not STATE.broken:
        abort.announce(STATE.rank)
    STATE.broken = True
    for hook in RELEASE_HOOKS:
        hook(ns)
    if ns is not None:  # the wrapper, and tensors whose autograd graph may reach it
        for key in ("model", "ctx", "loss", "batch"):
            ns.pop(key, None)
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None
    with abort.LOCK:  # this rank's own connections too: a group a cell made and still references (g =
        abort.shut_sockets()  # dist.new_group(...)) stays open at the destroy, and a peer waiting in it waited on
    abort.disarm()  # before the destroy: the watchdog thread must not shut sockets that are being closed
    backends = abort.hold_backends()  # the last references, let go in a thread: a gloo worker may still wait
    if dist.is_initialized():
        groups = postmortem.live_groups()  # frames kept for %dist debug: their objects must let go of the group
        drop_captured_group(dist.group.WORLD)
        if STATE.backend == "nccl":  # destroy would finalise: a flush that hangs while a peer is gone or stuck
            ncclfail.abort_groups()
        else:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        postmortem.free_groups(groups)
    gc.collect()
    abort.bury(backends)


def release(ns: dict, drop_store: bool = False, failed_cell: bool = False) -> None:
    """Called by the kernel on a failed rank: drop what still holds the broken group.

    ``drop_store``: rank 0 stops serving the old group's store too (its port is free again, for a
    re-form on the same ``--master-port``); otherwise it serves it until the next group forms, so that
    ranks still running read which rank failed (:mod:`distnb.engine.process.abort`). ``failed_cell``: the
    kernel saw this rank's cell fail; nothing is done when the rank kept its group (every rank had
    finished that cell with no collective half-done: :mod:`distnb.engine.process.health`).
    """
    if failed_cell and STATE.kept and not STATE.broken:
        return
    mark_broken(ns)
    if drop_store:
        _forget_store()


_CELLS = [0]


def cell_filename(code: str, kind: str) -> str:
    """A unique name for a cell's code, registered in linecache so tracebacks show its lines."""

    _CELLS[0] += 1
    filename = f"<{kind}-cell-{_CELLS[0]}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    return filename


def compile_cell(code: str, kind: str):
    """Compile a cell's code (see :func:`cell_filename`)."""
    return compile(code, cell_filename(code, kind), "exec")


#: What distnb binds in every rank's namespace (:func:`setup`), from :data:`STATE`
OWN_NAMES = ("rank", "world_size", "local_rank", "node_rank", "device")


def own_names(ns: dict) -> list:
    """Set distnb's names of this rank (:data:`OWN_NAMES`) in ``ns`` again; those a cell had rebound or deleted
    (``rank = 0``, ``for rank in ...``), which every later cell would have read instead of this rank's."""
    own = {k: getattr(STATE, k) for k in OWN_NAMES}
    changed = [k for k, v in own.items() if v is not None and (k not in ns or type(ns[k]) is not type(v)
                                                              or ns[k] != v)]
    ns.update({k: own[k] for k in changed})
    return changed


def _assigned_own(tree) -> list:
    """The names of :data:`OWN_NAMES` that a cell's code binds or deletes in its namespace (the same on every
    rank); the bodies of its functions, classes, lambdas and comprehensions have scopes of their own."""
    scoped = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
              ast.DictComp, ast.GeneratorExp)
    bound, todo = set(), list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        if not isinstance(node, scoped):
            todo.extend(ast.iter_child_nodes(node))
    return [k for k in OWN_NAMES if k in bound]


def _say_restored(names: list) -> None:
    """One line on stderr (the same on every rank: shown once) when a cell rebound distnb's names."""
    if names:
        listed = ", ".join(f"`{k}`" for k in names)
        print(f"distnb: this cell assigned {listed}, which distnb sets on each rank (this rank's own); set back "
              "for the next cells: give your own values other names", file=sys.stderr)


def run_cell(ns: dict, code: str, targets=None, unchecked=False):
    """Run a ``%%dist`` cell in the engine namespace; return repr of a final expression.

    ``unchecked``: the cell's own collectives skip the cross-rank check (``%%dist --unchecked``).

    ``targets``: the ranks that run it (None: all); another rank returns None at once, and
    on the targets a collective of the default group is an error (the others never join it).
    On an exception the process group is torn down (see :func:`mark_broken`) so that
    ranks waiting for this one in a collective fail at once; the kernel re-forms it. The
    exception's frames are kept for ``%dist debug`` until the next cell (:mod:`.postmortem`).
    """

    postmortem.drop(ns)  # the next cell releases the frames the last failure kept
    own_names(ns)  # a training body's `rank = ...`: this cell reads this rank's again
    STATE.kept = False
    if targets is not None and STATE.rank not in targets:
        health.cell_ended(STATE.rank, STATE.world_size)  # its part is done: a failing target may keep the group
        return None
    filename = cell_filename(code, "dist")
    tree = ast.parse(code, filename=filename, mode="exec")
    assigned = _assigned_own(tree)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)

    watchdog = Watchdog(publish_raw)
    watchdog.start()
    before = {k: id(v) for k, v in ns.items()}
    try:
        with checked(only=targets, off=unchecked, timeout=STATE.timeout):  # mismatched tensors: an error, not an abort
            exec(compile(tree, filename, "exec"), ns)
            if last is not None:
                value = eval(compile(last, filename, "eval"), ns)
                value = None if value is None else repr(value)
            else:
                value = None
        health.cell_ended(STATE.rank, STATE.world_size)
        return value
    except BaseException as caught:
        exc = abort.printable(caught)  # formatted below
        postmortem.keep(exc, ns, "%%dist cell")  # its frames stay for %dist debug, until the next cell
        stopped = abort.consequence(exc, STATE.rank)  # another rank failed first: say so, briefly
        # every rank finished the cell with no collective half-done: the group is kept (engine/health.py)
        STATE.kept = health.cell_ended(STATE.rank, STATE.world_size, exc)
        if not STATE.kept:
            mark_broken(ns)
        if stopped is not None:
            raise stopped from None
        if exc is not caught:
            raise exc from caught
        raise
    finally:  # no flush here: ipyparallel's apply_request flushes stdout and stderr before it replies
        watchdog.stop()  # (each flush is a round trip to ipykernel's IOPub thread)
        changed = own_names(ns)
        _say_restored([k for k in OWN_NAMES if k in changed or k in assigned])
        CELL_NAMES.update(k for k, v in ns.items() if before.get(k) != id(v))


def shutdown() -> None:
    """:func:`leave`, then exit the engine process at once with status 0."""
    leave()
    os._exit(0)


def leave() -> None:
    """Destroy the process group and drop weights the kernel never collected (the engine stays up)."""
    from distnb.engine.transport import wire  # loads numpy, torch: at first use, not when this module is imported

    wire.drop_outstanding()  # weights written for the kernel that it never collected
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    abort.disarm()
    sys.stdout.flush()
    sys.stderr.flush()
