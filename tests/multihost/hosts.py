"""Several "hosts" on one machine: network namespaces on a bridge, each running a real sshd.

:class:`TestHosts` (needs root) builds, in the root network namespace, a Linux bridge that holds an
address of a random free ``10.X.0.0/24`` (X in 231..254), and N network namespaces joined to it by
veth pairs. Host ``i`` (0-based) is namespace ``dnb-<tok>-h<i+1>`` with ``eth0`` at ``10.X.0.<11+i>``,
``lo`` up and a default route via the bridge address; it runs Debian's OpenSSH server in the
foreground, listening on its own address only, accepting root by a fresh key only. Each host also
gets its own UTS namespace, so ``hostname`` there is the namespace's name (the mount namespace,
hence the filesystem and ``/dev/shm``, stays shared with the machine), and its own ``/etc/hosts``
and ``/etc/resolv.conf`` (``ip netns exec`` binds ``/etc/netns/NAME/*`` over ``/etc``): every host
name, and this machine's name (as the bridge address), resolve to their bridge-side addresses; other
names fail at once instead of waiting for an unreachable DNS server.

Traffic between the root namespace and a host needs no forwarding (the root namespace owns the
bridge address); traffic between hosts is bridged. A host reaches nothing outside the bridge's
subnet (``net.ipv4.ip_forward`` is left alone). Servers a test wants the hosts to reach (an
ipyparallel controller, a rendezvous store) must listen on :attr:`TestHosts.bridge_address`.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SSHD = "/usr/sbin/sshd"
_BRIDGE_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"
_LOCK = os.path.join(tempfile.gettempdir(), "dnb-testhosts.lock")


def _ip(*args, check=True):
    """Run ``ip ARGS`` and return its stdout; raise with its stderr when ``check`` and it fails."""
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {p.stderr.strip()}")
    return p.stdout


def tcp_connects(address, port=22, timeout=1.0):
    """Whether a TCP connection from this process's namespace to ``address:port`` succeeds."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


class TestHosts:
    """N network namespaces on a bridge, each a "host" with its own address and a real sshd.

    Parameters
    ----------
    n : int
        Number of hosts.
    ssh_timeout : float
        Seconds to wait, in all, for every sshd to accept a login in :meth:`start`.
    resolve_names : bool
        Give the hosts the ``/etc/hosts`` described above. With False they share the machine's
        ``/etc/hosts`` and resolver (their own hostnames then do not resolve, and lookups of unknown
        names can hang for the resolver's timeout).

    Attributes
    ----------
    bridge : str
        Name of the bridge in the root namespace (``dnbbr<tok>``).
    bridge_address : str
        The bridge's address (``10.X.0.1``): the root namespace as the hosts see it.
    addresses : list of str
        Address of host ``i`` at index ``i``.
    namespaces : list of str
        Network namespace (and hostname) of host ``i`` at index ``i``.
    ssh_config : str
        OpenSSH client config file: root, the test key, no host key checks, batch mode.
    ssh_cmd, scp_cmd : list of str
        ``['ssh', '-F', ssh_config]`` and ``['scp', '-F', ssh_config]``.
    tmpdir : str
        Keys, configs and sshd logs (``h<i+1>/sshd.log``); removed by :meth:`stop`.

    Examples
    --------
    >>> hosts = TestHosts(2).start()          # doctest: +SKIP
    >>> hosts.ssh(0, "hostname -I").stdout     # doctest: +SKIP
    '10.237.0.11 \\n'
    >>> hosts.stop()                           # doctest: +SKIP
    """

    __test__ = False  # not a pytest test class

    def __init__(self, n=2, *, ssh_timeout=30.0, resolve_names=True):
        self.n = n
        self.ssh_timeout = ssh_timeout
        self.resolve_names = resolve_names
        tok = secrets.token_hex(3)
        self.bridge = f"dnbbr{tok}"
        self.namespaces = [f"dnb-{tok}-h{i + 1}" for i in range(n)]
        self.veths = [f"dnb{tok}v{i + 1}" for i in range(n)]  # root-side ends; eth0 inside
        self._etc = [f"/etc/netns/{ns}" for ns in self.namespaces]
        self.bridge_address = None
        self.addresses = []
        self.tmpdir = None
        self.ssh_config = None
        self._sshd = []
        self._bridge_nf_old = None
        self._made_etc_netns = False
        self._started = False

    # ------------------------------------------------------------------ availability

    @staticmethod
    def available():
        """Whether this machine can host :class:`TestHosts`.

        Returns
        -------
        (bool, str)
            ``(True, "")``, or ``(False, reason)`` naming what is missing.
        """
        if os.geteuid() != 0:
            return False, "needs root (network namespaces, a bridge, sshd)"
        for tool in ("ip", "ssh", "scp", "ssh-keygen", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                return False, f"`{tool}` not found (run .ci/install-multihost.sh)"
        if not os.access(SSHD, os.X_OK):
            return False, f"{SSHD} not found (openssh-server; run .ci/install-multihost.sh)"
        try:
            with open("/etc/shadow") as f:
                root = next((ln.split(":")[1] for ln in f if ln.startswith("root:")), "")
        except OSError:
            root = ""
        if root.startswith("!"):
            return False, "root's password is locked ('!' in /etc/shadow): sshd without PAM refuses root"
        probe = f"dnbprobe{secrets.token_hex(3)}"
        try:
            _ip("netns", "add", probe)
            _ip("netns", "del", probe)
            _ip("link", "add", probe, "type", "bridge")
            _ip("link", "del", probe)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            return False, f"cannot create network namespaces or a bridge here: {e}"
        return True, ""

    # ------------------------------------------------------------------ lifecycle

    def start(self):
        """Build the bridge and namespaces, start every sshd and wait until each accepts a login.

        Returns
        -------
        TestHosts
            ``self``. On any failure everything built so far is torn down before the error propagates.
        """
        if self._started:
            return self
        self._started = True
        atexit.register(self.stop)
        try:
            self.tmpdir = tempfile.mkdtemp(prefix="dnb-hosts-")
            self._keys()
            self._network()
            self._check_bridging()
            self._sshds()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        """Kill every process in the namespaces and remove namespaces, veths, bridge and tmpdir.

        Idempotent and safe after a partial :meth:`start`; also registered with :mod:`atexit`.
        """
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        for p in self._sshd:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        self._sshd = []
        for ns in self.namespaces:
            self._kill_namespace(ns)
            _ip("netns", "del", ns, check=False)
        for d in self._etc:
            shutil.rmtree(d, ignore_errors=True)
        if self._made_etc_netns:
            try:
                os.rmdir("/etc/netns")  # only when no other namespace uses it
            except OSError:
                pass
        for veth in self.veths:
            if os.path.exists(f"/sys/class/net/{veth}"):
                _ip("link", "del", veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        if self._bridge_nf_old is not None:
            with open(_BRIDGE_NF, "w") as f:
                f.write(self._bridge_nf_old)
            self._bridge_nf_old = None
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ using the hosts

    @property
    def sshd_pids(self):
        """PID of host ``i``'s sshd (the listener) at index ``i``."""
        return [p.pid for p in self._sshd]

    def pids(self, i):
        """PIDs of every process in host ``i``'s network namespace (sshd included)."""
        return [int(p) for p in _ip("netns", "pids", self.namespaces[i], check=False).split()]

    def run(self, i, cmd, *, timeout=60, check=False, **kwargs):
        """Run ``cmd`` (a list) directly inside host ``i`` (its network and UTS namespaces).

        Returns
        -------
        subprocess.CompletedProcess
            With text ``stdout``/``stderr`` captured unless ``kwargs`` say otherwise.
        """
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        full = ["ip", "netns", "exec", self.namespaces[i], "nsenter", "-t", str(self._sshd[i].pid), "-u", "--", *cmd]
        return subprocess.run(full, timeout=timeout, check=check, **kwargs)

    def ssh(self, i, command, *, timeout=60, check=False, **kwargs):
        """Run the shell ``command`` (a string) on host ``i`` over ssh, as the SSH launcher would."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self.ssh_cmd, self.addresses[i], command], timeout=timeout, check=check, **kwargs)

    @property
    def ssh_cmd(self):
        """``['ssh', '-F', ssh_config]``."""
        return ["ssh", "-F", self.ssh_config]

    @property
    def scp_cmd(self):
        """``['scp', '-F', ssh_config]``."""
        return ["scp", "-F", self.ssh_config]

    def cut(self, i):
        """Cut host ``i``'s link: its bridge port goes down, packets to and from it are dropped.

        Open TCP connections stay open (nothing is reset) until :meth:`restore` or a timeout.
        Raises if the root namespace can still connect to the host's sshd afterwards.
        """
        _ip("link", "set", self.veths[i], "down")
        if tcp_connects(self.addresses[i], timeout=1.0):
            raise RuntimeError(f"host {i} ({self.addresses[i]}) still reachable after cut")

    def restore(self, i, timeout=10.0):
        """Bring host ``i``'s link back up and wait until its sshd port answers again."""
        _ip("link", "set", self.veths[i], "up")
        deadline = time.monotonic() + timeout
        while not tcp_connects(self.addresses[i], timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"host {i} ({self.addresses[i]}) unreachable {timeout} s after restore")
            time.sleep(0.1)

    # ------------------------------------------------------------------ building blocks

    def _keys(self):
        """A client key (authorized for root on every host) and the client config."""
        key = os.path.join(self.tmpdir, "id_ed25519")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dnb-test", "-f", key], check=True)
        shutil.copy(key + ".pub", os.path.join(self.tmpdir, "authorized_keys"))
        self.ssh_config = os.path.join(self.tmpdir, "ssh_config")
        with open(self.ssh_config, "w") as f:
            f.write(
                "Host *\n"
                "  User root\n"
                f"  IdentityFile {key}\n"
                "  IdentitiesOnly yes\n"
                "  UserKnownHostsFile /dev/null\n"
                "  GlobalKnownHostsFile /dev/null\n"
                "  StrictHostKeyChecking no\n"
                "  LogLevel ERROR\n"
                "  BatchMode yes\n"
                "  ConnectTimeout 5\n"
                "  ServerAliveInterval 5\n"
                "  ServerAliveCountMax 3\n"
            )

    def _free_subnet(self):
        """A random ``10.X.0.0/24`` (X in 231..254) overlapping no address or route of the root namespace."""
        used = []
        for line in _ip("-4", "-o", "addr", "show").splitlines():
            used.append(ipaddress.ip_interface(line.split()[3]).network)
        for line in _ip("-4", "route", "show", "table", "all").splitlines():
            for dest in line.split()[:2]:  # "10.1.0.0/16 dev ..." or "local 10.1.2.3 dev ..."
                try:
                    used.append(ipaddress.ip_network(dest, strict=False))
                    break
                except ValueError:
                    pass
        candidates = [ipaddress.ip_network(f"10.{x}.0.0/24") for x in range(231, 255)]
        free = [c for c in candidates if not any(c.overlaps(u) for u in used)]
        if not free:
            raise RuntimeError("no free 10.231-254.0.0/24 subnet for the test bridge")
        return free[secrets.randbelow(len(free))]

    def _network(self):
        """Bridge (with a free subnet, chosen under a lock against concurrent runs) and the namespaces."""
        with open(_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            net = self._free_subnet()
            base = str(net.network_address).rsplit(".", 1)[0]
            self.bridge_address = f"{base}.1"
            _ip("link", "add", self.bridge, "type", "bridge", "stp_state", "0")
            _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.addresses = [f"{base}.{11 + i}" for i in range(self.n)]
        if self.resolve_names:
            self._name_files()
        for ns, veth, addr in zip(self.namespaces, self.veths, self.addresses):
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", "default", "via", self.bridge_address)

    def _name_files(self):
        """``/etc/netns/NS/{hosts,resolv.conf}``: the hosts and this machine by name, no DNS server."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 f"{self.bridge_address} {socket.gethostname()}"]
        lines += [f"{addr} {ns}" for addr, ns in zip(self.addresses, self.namespaces)]
        self._made_etc_netns = not os.path.exists("/etc/netns")
        for d in self._etc:
            os.makedirs(d)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")
            with open(os.path.join(d, "resolv.conf"), "w") as f:
                # nothing listens on the namespace's own port 53: lookups fail at once
                f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def _ns_connects(self, ns, address, port):
        """Whether a TCP connect from namespace ``ns`` to ``address:port`` gets an answer (even a refusal)."""
        code = (
            "import socket,sys\n"
            "s=socket.socket(); s.settimeout(2)\n"
            f"e=s.connect_ex(({address!r},{port}))\n"
            "sys.exit(0 if e in (0,111) else 1)\n"
        )
        p = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, timeout=30)
        return p.returncode == 0

    def _check_bridging(self):
        """Host to root and host to host traffic must pass; br_netfilter's iptables hook may drop the latter.

        If host-to-host fails while ``bridge-nf-call-iptables`` is 1, turn it off until :meth:`stop`.
        """
        if not self._ns_connects(self.namespaces[0], self.bridge_address, 9):
            raise RuntimeError(f"{self.namespaces[0]} cannot reach the bridge address {self.bridge_address}")
        if self.n < 2 or self._ns_connects(self.namespaces[0], self.addresses[1], 9):
            return
        if os.path.exists(_BRIDGE_NF) and open(_BRIDGE_NF).read().strip() == "1":
            self._bridge_nf_old = "1"
            with open(_BRIDGE_NF, "w") as f:
                f.write("0")
            if self._ns_connects(self.namespaces[0], self.addresses[1], 9):
                return
        raise RuntimeError("bridged traffic between the test namespaces is dropped (firewall?)")

    def _sshds(self):
        """One foreground sshd per host, in its own UTS namespace named after the host; wait for logins."""
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        for ns, addr in zip(self.namespaces, self.addresses):
            d = os.path.join(self.tmpdir, ns.rsplit("-", 1)[1])
            os.mkdir(d)
            hostkey = os.path.join(d, "ssh_host_ed25519_key")
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", hostkey], check=True)
            cfg = os.path.join(d, "sshd_config")
            with open(cfg, "w") as f:
                f.write(
                    f"ListenAddress {addr}\n"
                    f"HostKey {hostkey}\n"
                    f"PidFile {os.path.join(d, 'sshd.pid')}\n"
                    "PermitRootLogin prohibit-password\n"
                    "PubkeyAuthentication yes\n"
                    "PasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\n"
                    "UsePAM no\n"
                    f"AuthorizedKeysFile {os.path.join(self.tmpdir, 'authorized_keys')}\n"
                    "StrictModes no\n"
                    "Subsystem sftp internal-sftp\n"
                )
            with open(os.path.join(d, "sshd.log"), "w") as log:
                # unshare execs sh, which execs sshd: the Popen pid is sshd's
                self._sshd.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, "unshare", "--uts", "/bin/sh", "-c",
                     f'hostname "$0" && exec {SSHD} -D -e -f "$1"', ns, cfg],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                ))
        deadline = time.monotonic() + self.ssh_timeout
        for i, ns in enumerate(self.namespaces):
            while True:
                if self._sshd[i].poll() is not None:
                    raise RuntimeError(f"sshd in {ns} exited: {self._sshd_log(i)}")
                p = self.ssh(i, "true", timeout=15)
                if p.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sshd in {ns} refused logins: {p.stderr.strip()} / {self._sshd_log(i)}")
                time.sleep(0.2)

    def _sshd_log(self, i):
        with open(os.path.join(self.tmpdir, self.namespaces[i].rsplit("-", 1)[1], "sshd.log")) as f:
            return f.read().strip()[-2000:]

    @staticmethod
    def _kill_namespace(ns, timeout=10.0):
        """TERM, then KILL, every process in namespace ``ns`` until none is left (bounded)."""
        deadline = time.monotonic() + timeout
        sig = signal.SIGTERM
        term_until = time.monotonic() + 2.0
        while True:
            pids = [int(p) for p in _ip("netns", "pids", ns, check=False).split()]
            if not pids or time.monotonic() > deadline:
                return
            if time.monotonic() > term_until:
                sig = signal.SIGKILL
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
