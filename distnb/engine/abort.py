"""One rank's failure ends every rank's pending gloo collective at once, at any world size.

When a rank fails, it tears down its process group (:func:`distnb.engine.runtime.mark_broken`),
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
  :data:`distnb.engine.where.INTERVAL` seconds, a ``check`` on the store) and, when it is there
  (or the store is gone: rank 0 died or was released), shuts down its own gloo connections
  (``shutdown(SHUT_RDWR)``, the socket stays gloo's to close). Its pending collective then fails
  as if its peer had closed it ("Connection closed by peer"), as do its peers', and each rank
  goes through the usual failure path; the kernel re-forms the group.

Stdlib and torch only; gloo only (nccl has ``abort`` of its own, not done here).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading

#: The key a failing rank sets in its process group's store.
KEY = "distnb/failed"
#: What a collective ended by :func:`shut_sockets` (here or on a peer) raises with.
SYMPTOMS = ("Connection closed by peer", "Connection reset", "Broken pipe", "Socket closed")
#: Seconds a store call here may wait (a store that does not answer must not hold a failure up).
STORE_SECONDS = 2.0


class _Armed:
    store = None  # a connection of our own to the group's TCPStore
    server = None  # the group's store itself, kept while the peers may still read the key (see forget_store)
    sockets: dict = {}  # fd -> "socket:[inode]" of gloo's connections to its peers
    by = None  # the rank whose failure ended this rank's collective, once seen (-1: the store was gone)


ARMED = _Armed()
#: Held while gloo's sockets are shut down or forgotten: never while the group is being destroyed.
_LOCK = threading.Lock()


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


def arm(store, before: dict, backend: str) -> None:
    """After ``init_process_group``: remember gloo's sockets (those not in ``before``) and a store connection.

    Parameters
    ----------
    store : torch.distributed.TCPStore
        The group's store (cloned: the group keeps its own connection).
    before : dict
        :func:`socket_fds` just before the group formed.
    backend : str
        Only ``gloo`` is armed.
    """
    disarm()
    ARMED.server = store  # rank 0's serves the key: it must outlive this rank's destroy_process_group
    if backend != "gloo":
        return
    ARMED.sockets = {fd: link for fd, link in socket_fds().items() if before.get(fd) != link}
    try:
        ARMED.store = store.clone()
        ARMED.store.set_timeout(datetime.timedelta(seconds=STORE_SECONDS))
    except Exception:  # a store that cannot be cloned: failures travel as before
        ARMED.store = None


def disarm() -> None:
    """Forget the sockets (call it before the group is destroyed: their numbers may be reused) and the store.

    A shutdown going on in the watchdog thread finishes first.
    """
    with _LOCK:
        ARMED.sockets, ARMED.store, ARMED.by = {}, None, None


def forget_store() -> None:
    """Let the old group's store go (rank 0: stop serving it, its port is free again)."""
    disarm()
    ARMED.server = None


def announce(rank: int) -> None:
    """This rank failed: tell every rank of the group (see the module docstring). Never raises."""
    if ARMED.store is None:
        return
    try:
        ARMED.store.compare_set(KEY, "", str(rank))  # the first failure's rank stays
    except Exception:  # the store is gone (rank 0 failed first): the others see that too
        pass


def poll() -> bool:
    """Whether a rank announced a failure (or the store is gone); if so, end this rank's collectives.

    Called from a rank's watchdog thread while a cell runs. True once this rank's gloo
    connections were shut down (``ARMED.by`` names the rank that failed, -1 if the store was gone).
    """
    if ARMED.store is None or not ARMED.sockets:
        return False
    by = _failed_rank()
    if by is None:
        return False
    with _LOCK:
        if not ARMED.sockets:  # disarmed meanwhile: this rank's own failure path destroys the group
            return False
        ARMED.by = by
        shut_sockets()
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

    Call it holding ``_LOCK``.
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


def consequence(exc: BaseException, rank: int):
    """The error to raise instead of ``exc`` when ``exc`` only says another rank's failure ended a collective.

    Returns a :class:`~distnb.errors.PeerFailed` naming the rank that failed first, or None
    (``exc`` is this rank's own error, or no rank announced a failure). Call it before
    :func:`disarm`. Its traceback is short: formatting the gloo error's (torch's frames, each
    file parsed by IPython) took seconds per rank with 32 ranks on 2 cores, and the kernel
    only names such ranks.
    """
    from ..errors import PeerFailed

    if not isinstance(exc, Exception) or not any(m in str(exc) for m in SYMPTOMS):
        return None
    by = ARMED.by
    if by is None and ARMED.store is not None:  # a peer's shutdown reached this rank before its own look
        by = _failed_rank()
    if by is None or by == rank:
        return None
    who = "another rank failed (the group's store on rank 0 is gone)" if by < 0 else f"rank {by} failed"
    return PeerFailed(f"rank {rank} stopped because {who}: its pending collective was ended at once")
