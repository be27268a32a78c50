"""Addresses, interfaces and ports: what the kernel and the engines both ask of the network.

Stdlib and psutil only (no torch), so the kernel imports it at once and an engine calls
:func:`whereami`, :func:`interface_address` and :func:`free_port` before it is a rank
(through :mod:`distnb.core.calls`); :mod:`distnb.engine.process.runtime` uses it to pin gloo's interface.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time

from distnb.core import gpus
from distnb.core.errors import ClusterError


def visible_gpus() -> list[str]:
    """GPU ids this process may use, found without initialising CUDA (or importing torch).

    ``CUDA_VISIBLE_DEVICES`` when set, else ``/proc/driver/nvidia/gpus``, ``nvidia-smi -L``, the
    ``/dev/nvidia<N>`` nodes (:func:`distnb.core.gpus.discover`).
    """
    return gpus.discover()["gpus"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` (an address of this machine) a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def route_address(host: str) -> str | None:
    """The local address this process uses to reach ``host`` (no packet is sent), or None."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str | None) -> str | None:
    """Name of the interface that holds ``address``, if any."""
    if not address:
        return None
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def ipv4_of(name: str) -> str | None:
    """The IPv4 address of this host's interface ``name``, or None."""
    import psutil

    for a in psutil.net_if_addrs().get(name, ()):
        if a.family == socket.AF_INET:
            return a.address
    return None


def interface_address(name: str) -> str:
    """:func:`ipv4_of`, or a RuntimeError naming this host and the interfaces it has."""
    addr = ipv4_of(name)
    if addr:
        return addr
    import psutil

    have = ", ".join(f"{n} ({', '.join(a.address for a in v if a.family == socket.AF_INET) or 'no IPv4'})"
                     for n, v in sorted(psutil.net_if_addrs().items()))
    raise RuntimeError(f"--interface {name}: host {socket.gethostname()} has no IPv4 address on "
                       f"{name}; its interfaces: {have}")


def boot_id() -> str | None:
    """This machine's Linux boot id (the same for every process on it), or None."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def whereami(controller_ip: str) -> dict:
    """Where this engine runs, before it becomes a rank (no torch import).

    Returns
    -------
    dict
        pid; host (hostname); address (the local address that reaches the controller,
        which tells apart hosts that share a hostname); boot_id (Linux boot id); cores;
        gpus (visible GPU ids), gpus_how (how they were found: :func:`distnb.core.gpus.discover`);
        launch_rank, launch_local_rank (the rank MPI or Slurm gave
        the process, if launched by one; else None).
    """
    env = os.environ
    def first(*names):
        for name in names:
            if env.get(name, "").isdigit():
                return int(env[name])
        return None

    found = gpus.discover()
    return dict(pid=os.getpid(), host=socket.gethostname(), address=route_address(controller_ip),
                boot_id=boot_id(), cores=len(os.sched_getaffinity(0)), gpus=found["gpus"], gpus_how=found["how"],
                launch_rank=first("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"),
                launch_local_rank=first("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"))


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` is a loopback address (or ``localhost``)."""

    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def loopback_interface() -> str | None:
    """Name of the network interface that carries 127.0.0.1 (``lo`` on Linux), if any."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == "127.0.0.1" for a in addrs):
                return name
    except Exception:
        pass
    return None


def check_port_free(port: int, host: str = "127.0.0.1", option: str = "--master-port", wait: float = 0.0) -> None:
    """Raise ClusterError naming ``port``, who holds it (when psutil can tell) and the fix, if it is taken.

    With ``wait``, keep trying that many seconds (a store that was just closed lets go of it).
    """
    deadline = time.monotonic() + wait
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds it: TIME_WAIT is fine
            try:
                s.bind((host, port))
                return
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise ClusterError(f"{option} {port}: cannot listen on {host}:{port} ({exc})") from None
                code = exc.errno
        why = "needs privileges (ports below 1024)" if code == errno.EACCES else "is already in use"
        if code == errno.EACCES or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    holder = ""
    try:
        import psutil

        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                words = psutil.Process(conn.pid).cmdline() or [psutil.Process(conn.pid).name()]  # name(): 15 chars
                holder = f" by pid {conn.pid} ({' '.join(words)[:100]})"
                break
    except (psutil.Error, OSError):
        pass
    raise ClusterError(f"{option} {port} {why}{holder} on {host}: pick another port, or leave out {option} and "
                       "distnb picks a free one")
