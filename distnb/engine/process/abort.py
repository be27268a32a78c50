"""One rank's failure ends every rank's pending gloo collective at once, at any world size.

When a rank fails, it tears down its process group (:func:`distnb.engine.process.runtime.mark_broken`),
which closes its gloo connections; but only the peers that wait on *that* rank's connections
notice. In a ring all-reduce of 32 ranks, the others wait on peers that are alive and waiting
themselves, so the failure travels one hop at a time, each hop a rank's whole failure path
(measured here: 32 ranks, 6-7 hops in the first 5 s, the rest held until gloo's ``--timeout``,
73 s in all). gloo's own ``ProcessGroupGloo.abort()`` and ``shutdown()`` (torch 2.13) do not end
an operation already waiting (tried: the wait went on).

So, the way the failure already travels, made one step for every rank:

- :func:`arm` records the sockets gloo opened while the group formed (the connections to the
  peers, not the listener and not the store's) and a second connection to the group's TCPStore;
- the failing rank :func:`announce`\\ s it, a key in that store (``distnb/failed`` = its rank);
- every rank running a cell looks for the key in its watchdog thread (:func:`poll`, every
  :data:`distnb.engine.process.where.INTERVAL` seconds, a ``check`` on the store) and, when it is there
  (or the store is gone: rank 0 died or was released), shuts down its own gloo connections
  (``shutdown(SHUT_RDWR)``, the socket stays gloo's to close). Its pending collective then fails
  as if its peer had closed it ("Connection closed by peer"), as do its peers', and each rank
  goes through the usual failure path; the kernel re-forms the group.

gloo does not end every operation so: one whose data was already on its way when the connection
broke waits out ``--timeout`` (measured: 32 ranks, rank 16 raising at step 3, the cell took 60-66 s
in about half the runs, one rank held in DDP's backward or in ``~ProcessGroupGloo``). Hence two more
steps: DDP's backward waits on a future of distnb's (:func:`ddp_allreduce_hook`), which the
watchdog fails at once (:func:`end_pending`), and a failed rank lets its old group's backends go in
a thread of their own (:func:`bury`), not in the cell. A group a strategy forms itself (the ps
group) is armed with the world's (:func:`tracking`).

Stdlib and torch only. On nccl there are no gloo sockets: the store is armed all the same (the
failure is announced and read, and :func:`distnb.engine.train.context.agree_on_steps` has its store), and
:func:`poll` aborts the communicators instead (:mod:`distnb.engine.process.ncclfail`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading

from distnb.core.errors import PeerFailed
from distnb.engine.process import ncclfail

#: The key a failing rank sets in its process group's store.
KEY = "distnb/failed"
#: What a collective ended by :func:`shut_sockets` (here or on a peer) raises with.
SYMPTOMS = ("Connection closed by peer", "Connection reset", "Broken pipe", "Socket closed",
            # nccl, its communicators aborted (ncclfail.abort_groups, or NCCL's watchdog) or a peer gone
            "aborted", "ncclRemoteError", "ncclSystemError")
#: Seconds a store call here may wait (a store that does not answer must not hold a failure up).
STORE_SECONDS = 2.0


class _Armed:
    store = None  # a connection of our own to the group's TCPStore (under the group's key prefix)
    clone = None  # (the TCPStore, that connection, [its answers count]): kept while groups form on that store
    server = None  # the group's store itself, kept while the peers may still read the key (see forget_store)
    sockets: dict = {}  # fd -> "socket:[inode]" of gloo's connections to its peers
    by = None  # the rank whose failure ended this rank's collective, once seen (-1: the store was gone)
    backend = None  # the armed group's backend: gloo (sockets shut) or another (communicators aborted)


ARMED = _Armed()
#: Held while gloo's sockets are shut down or forgotten (never while the group is being destroyed).
LOCK = threading.Lock()
#: Futures :func:`ddp_allreduce_hook` handed to DDP that no collective has settled yet (whoever removes one
#: from the set, the all-reduce's callback or :func:`end_pending`, settles it).
_PENDING: set = set()


def socket_fds() -> dict:
    """``{fd: "socket:[inode]"}`` of this process's open sockets (Linux ``/proc/self/fd``)."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def arm(store, prefix: str, before: dict, backend: str) -> None:
    """After ``init_process_group``: remember gloo's sockets (those not in ``before``) and a store connection.

    Parameters
    ----------
    store : torch.distributed.TCPStore
        The store the group formed on (cloned once: the group keeps its own connection; a group formed
        again on the same store reuses the clone).
    prefix : str
        The group's key prefix in ``store`` (a failure is announced under it).
    before : dict
        :func:`socket_fds` just before the group formed.
    backend : str
        ``gloo``: its sockets are recorded too; another (nccl): the store only (:func:`poll` aborts its
        communicators).
    """
    import torch.distributed as dist

    disarm()
    ARMED.server = store  # rank 0's serves the key: it must outlive this rank's destroy_process_group
    ARMED.backend = backend
    if backend == "gloo":
        port = getattr(store, "port", None)
        ARMED.sockets = {fd: link for fd, link in socket_fds().items()
                         if before.get(fd) != link and _gloo_socket(fd, port)}
    try:
        if ARMED.clone is None or ARMED.clone[0] is not store or not answers(ARMED.clone[1], ARMED.clone[2], -1):
            clone = store.clone()
            clone.set_timeout(datetime.timedelta(seconds=STORE_SECONDS))
            ARMED.clone = (store, clone, [0])
        ARMED.store = dist.PrefixStore(prefix, ARMED.clone[1])
    except Exception:  # a store that cannot be cloned: failures travel as before
        ARMED.store = ARMED.clone = None


def answers(store, count: list, rank) -> bool:
    """Whether a kept store connection still answers in step: its own counter key, added to each time, must
    come back one higher (a reply left over from a timed-out call would not). ``count``: [the last value]."""
    try:
        count[0] += 1
        return store.add(f"distnb/alive/{rank}/{os.getpid()}", 1) == count[0]
    except Exception:
        return False


@contextlib.contextmanager
def tracking():
    """Around a group a strategy forms itself (``new_group``, a device mesh): arm its gloo connections too.

    Its sockets then end with the world's when a failure is announced (:func:`poll`); without it, a
    rank waiting in that group's collective waited until a peer's failure path closed its end, one
    hop at a time, or for ``--timeout``. Nothing is added while this rank is not armed.
    """
    before = socket_fds()
    try:
        yield
    finally:
        if ARMED.store is not None:
            port = getattr(ARMED.server, "port", None)
            new = {fd: link for fd, link in socket_fds().items()
                   if before.get(fd) != link and _gloo_socket(fd, port)}
            with LOCK:
                if ARMED.store is not None and ARMED.by is None:
                    ARMED.sockets.update(new)


def _gloo_socket(fd: int, store_port) -> bool:
    """Whether socket ``fd`` may be one of gloo's: TCP, and not a connection of the group's store.

    The store's connections have its port at one end. On rank 0, the store's server accepts the
    other ranks' second connections (:func:`arm`'s ``clone``) while rank 0 may still be forming the
    group: shutting those down too broke each such rank's store, which then read as "rank 0's store
    is gone" (seen at 32 ranks: 3 to 11 of them on rank 0).
    """
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return False
        if store_port is None:
            return True
        if sock.getsockname()[1] == store_port:  # the store's server side (rank 0)
            return False
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return True  # gloo's listener (shut_sockets leaves it alone)
        return sock.getpeername()[1] != store_port
    except OSError:
        return False
    finally:
        sock.close()


def disarm() -> None:
    """Forget the sockets (call it before the group is destroyed: their numbers may be reused) and the store.

    A shutdown going on in the watchdog thread finishes first.
    """
    with LOCK:
        ARMED.sockets, ARMED.store, ARMED.by, ARMED.backend = {}, None, None, None


def forget_store() -> None:
    """Let the old group's store go (rank 0: stop serving it, its port is free again)."""
    disarm()
    ARMED.server = ARMED.clone = None


def announce(rank: int) -> None:
    """This rank failed: tell every rank of the group (see the module docstring). Never raises."""
    if ARMED.store is None:
        return
    try:
        ARMED.store.compare_set(KEY, "", str(rank))  # the first failure's rank stays
    except Exception:  # the store is gone (rank 0 failed first): the others see that too
        pass


def ddp_allreduce_hook(group, bucket):
    """DDP's gradient averaging (as its default), through a future that :func:`poll` can end.

    Registered on gloo DDP wrappers (``register_comm_hook``; ``group`` is the hook's state, None:
    the default group). DDP's backward waits for this future, not for gloo's: when a rank's
    failure is announced, :func:`end_pending` fails it at once, so the backward raises even if
    gloo's own operation waits on (see :func:`bury`: one whose data was on its way when the
    connections were shut ends only at ``--timeout``; seen at 32 ranks in one run of two, a rank held
    in ``Reducer::finalize_backward`` for the whole 60 s). Cost: one Python call per bucket and step,
    kept small (benchmarks/README.md, "the DDP comm hook"; in A/B tests on the digits CNN with the
    ranks bound to cores, no hook at all was 1.048x faster than the hook before these choices):

    - the all-reduce is the process group's own (``ProcessGroup.allreduce``), as DDP's C++ reducer
      calls it, not ``dist.all_reduce`` and its Python wrappers (c10d's logger, distnb's cell check);
    - the future is torch's C++ one (``torch._C.Future``, the base class of ``torch.futures.Future``),
      whose Python subclass cost DDP's backward about 2.5 % here;
    - the pending set is changed by single ``set`` operations, atomic under the GIL, not under a lock:
      a future is settled either here (``remove`` found it) or by :func:`end_pending` (which took it).

    The division before the sum is what DDP does without a hook (and torch's ``allreduce_hook``).
    """
    future_class, dist = _HOOK_TYPES or _hook_types()
    mine = future_class([])
    if ARMED.by is not None:  # a failure seen before this bucket was ready: no new collective
        _fail(mine, RuntimeError(_ended_message()))
        return mine
    tensor = bucket.buffer()
    group = group if group is not None else dist.group.WORLD
    tensor.div_(group.size())
    work = group.allreduce([tensor])  # group device: DDP's bucket, on the model's (the rank's) device
    _PENDING.add(mine)

    def settle(fut):
        if not _take(mine):  # already ended by end_pending
            return
        try:
            fut.value()
        except Exception as exc:
            _fail(mine, exc)
        else:
            mine.set_result(tensor)

    work.get_future().add_done_callback(settle)
    return mine


_HOOK_TYPES: tuple = ()


def _hook_types() -> tuple:
    """(the future class the hook hands DDP, ``torch.distributed``), imported once."""
    global _HOOK_TYPES
    import torch
    import torch.distributed as dist

    _HOOK_TYPES = (getattr(torch._C, "Future", None) or (lambda devices: torch.futures.Future()), dist)
    return _HOOK_TYPES


def _raise(error):
    raise error


def _fail(fut, error: Exception) -> None:
    """Complete ``fut`` with ``error``, as ``torch.futures.Future.set_exception`` does (a method of the
    Python subclass only): its value, when read (by DDP's backward), raises ``error``."""
    unwrap = getattr(fut, "_set_unwrap_func", None)
    if unwrap is not None:
        unwrap(_raise)
    fut.set_result(error)


def _ended_message() -> str:
    # "Connection closed by peer" (one of SYMPTOMS): consequence() names the rank that failed
    who = "rank 0's store is gone" if ARMED.by == -1 else f"rank {ARMED.by} failed"
    return f"Connection closed by peer: distnb ended this rank's pending all-reduce ({who})"


def end_pending() -> int:
    """Fail every future :func:`ddp_allreduce_hook` handed out and not yet settled; how many."""
    pending = [f for f in list(_PENDING) if _take(f)]
    for fut in pending:
        _fail(fut, RuntimeError(_ended_message()))
    return len(pending)


def _take(fut) -> bool:
    """Take ``fut`` out of the pending set; False when its all-reduce settled it first."""
    try:
        _PENDING.remove(fut)
    except KeyError:
        return False
    return True


def poll() -> bool:
    """Whether a rank announced a failure (or the store is gone); if so, end this rank's collectives.

    Called from a rank's watchdog thread while a cell runs. True once this rank's gloo
    connections were shut down (``ARMED.by`` names the rank that failed, -1 if the store was gone).
    """
    if ARMED.store is None or (ARMED.backend == "gloo" and not ARMED.sockets) or ARMED.by is not None:
        return False
    by = _failed_rank()
    if by is None:
        return False
    if ARMED.backend != "gloo":  # nccl: the main thread may be blocked in CUDA; abort its communicators
        with LOCK:
            if ARMED.store is None or ARMED.by is not None:  # disarmed meanwhile, or already done
                return False
            ARMED.by = by
        ncclfail.abort_groups()
        end_pending()
        return True
    with LOCK:
        if not ARMED.sockets:  # disarmed meanwhile: this rank's own failure path destroys the group
            return False
        ARMED.by = by
        shut_sockets()
    end_pending()
    return True


def _failed_rank():
    """The rank announced in the store, None if none, -1 if the store is gone (rank 0 died)."""
    try:
        if not ARMED.store.check([KEY]):
            return None
        return int(ARMED.store.get(KEY))
    except Exception:
        return -1


def shut_sockets() -> None:
    """``shutdown(SHUT_RDWR)`` each of gloo's connections still open (listening sockets left alone).

    Call it holding ``LOCK``.
    """
    sockets, ARMED.sockets = ARMED.sockets, {}
    for fd, link in sockets.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:  # closed, and the number reused
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)  # gloo's listener must stay: shutting it aborts the process
        except OSError:
            pass
        finally:
            sock.close()  # our duplicate only


def hold_backends() -> list:
    """Strong references to the gloo backends of every process group torch knows now (for :func:`bury`)."""
    if "torch.distributed" not in sys.modules:
        return []
    import torch
    from torch.distributed import distributed_c10d as c10d

    if not c10d.is_initialized():
        return []
    out = []
    for pg in list(c10d._world.pg_map):
        try:
            out.append(pg._get_backend(torch.device("cpu")))
        except Exception:  # no CPU backend (nccl only): nothing of gloo's to wait for
            pass
    return out


def bury(backends: list) -> None:
    """Let the last references to ``backends`` go in a thread of their own, not in the failing cell.

    ``~ProcessGroupGloo`` joins its worker threads, and a worker can still be in an operation that
    the shut connections did not end: gloo signals an error to the buffers of the operations
    pending on a pair (:func:`shut_sockets`), but not to one whose data was already on its way,
    which then waits out the group's ``--timeout`` (seen at 32 ranks: one rank in two runs held in
    ``free_groups`` for the whole 60 s, the kernel waiting for it). The destructor releases the GIL
    (tried: Python ran on while a buried backend waited), so the rank answers at once and the old
    group's threads end at their timeout, after the group was re-formed.
    """
    if backends:
        threading.Thread(target=backends.clear, name="distnb-bury-group", daemon=True).start()


def consequence(exc: BaseException, rank: int):
    """The error to raise instead of ``exc`` when ``exc`` only says another rank's failure ended a collective.

    Returns a :class:`~distnb.core.errors.PeerFailed` naming the rank that failed first, or None
    (``exc`` is this rank's own error, or no rank announced a failure). Call it before
    :func:`disarm`. Its traceback is short: formatting the gloo error's (torch's frames, each
    file parsed by IPython) took seconds per rank with 32 ranks on 2 cores, and the kernel
    only names such ranks.
    """

    if not isinstance(exc, Exception) or not any(m in str(exc) for m in SYMPTOMS):
        return None
    by = ARMED.by
    if by is None and ARMED.store is not None:  # a peer's shutdown reached this rank before its own look
        by = _failed_rank()
    if by is None or by == rank:
        return None
    who = "another rank failed (the group's store on rank 0 is gone)" if by < 0 else f"rank {by} failed"
    return PeerFailed(f"rank {rank} stopped because {who}: its pending collective was ended at once")


def printable(exc: BaseException) -> BaseException:
    """``exc``, or when its ``str()`` raises (a notebook exception class whose ``__str__`` fails) a RuntimeError naming
    it, with its traceback and ``exc`` as the cause. A failing cell's path formats the error many times (the report,
    :func:`consequence`, the hints), and a raise there skipped the rest of it: the group's teardown, the failing step
    (reported as step 0)."""
    try:
        str(exc)
        return exc
    except Exception as inner:
        new = RuntimeError(f"the cell raised {type(exc).__name__}, whose str() raised {type(inner).__name__}: {inner}")
        new.__cause__ = exc
        return new.with_traceback(exc.__traceback__)
