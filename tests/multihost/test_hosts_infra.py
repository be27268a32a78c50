"""Self-test of the multihost infrastructure: namespaces reachable by ssh, cut links. distnb's own
use of ipyparallel's SSH launcher over them is tested in test_ssh_hosts.py.

What the launcher test established (ipyparallel 9.2, 2 hosts, this 2-core machine):

- Config that works: ``Cluster(engine_launcher_class="ssh", controller_ip=hosts.bridge_address,
  n=2)`` with ``SSHEngineSetLauncher.engines = {addr: 1, ...}``, ``SSHLauncher.ssh_cmd =
  hosts.ssh_cmd``, ``SSHLauncher.scp_cmd = hosts.scp_cmd``, ``SSHLauncher.remote_python =
  sys.executable``. ``controller_ip`` must be the bridge address: the controller then listens there
  only, and the engines connect to the ``interface`` of ``$IPP_CONNECTION_INFO``
  (``tcp://<bridge address>``).
- The engines get the environment of an sshd login (HOME, PATH from root's .bashrc) plus
  ``IPP_CLUSTER_ID``, ``IPP_PROFILE_DIR``, ``IPP_CONNECTION_INFO`` and whatever
  ``SSHEngineSetLauncher.environment`` holds; nothing else of the caller's (no IPYTHONDIR, no
  OMP_NUM_THREADS). Passing IPYTHONDIR there lets the suite's leak check see stray engines.
- The launcher scp's both connection files (client and engine JSON) onto themselves (same path,
  same filesystem); scp (SFTP and ``-O`` legacy mode alike) rewrites them intact, so it is harmless.
  With ``send_engines_connection_env`` True (the default) the engines never read them; with False
  they read the engine file from the shared filesystem. Both start alike.
- ``stop_cluster_sync`` stops the engines through ssh (``cmd_kill`` SIGTERM by remote pid, then a
  remote waitpid); afterwards only each namespace's sshd is left.
- Each engine costs about 7 sequential ssh/scp round trips (~0.4 s each here: shell info, python
  --version, ``IPython profile create``, 2 x (mkdir check + scp), start), then a long-poll ssh
  session per engine (``ssh_waitpid``, 60 s) stays open while it runs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from .hosts import tcp_connects


def _wait_only_sshd_left(hosts, timeout=15.0):
    """Poll until each namespace holds only its sshd; return what is left over otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        extra = {i: sorted(set(hosts.pids(i)) - {hosts.sshd_pids[i]}) for i in range(hosts.n)}
        if not any(extra.values()) or time.monotonic() > deadline:
            return {i: pids for i, pids in extra.items() if pids}
        time.sleep(0.2)


@pytest.mark.timeout(120)
def test_each_host_has_its_address_and_name(test_hosts):
    """ssh into each host lands in its namespace: its address, its hostname, no other address."""
    h = test_hosts
    for i, (addr, name) in enumerate(zip(h.addresses, h.namespaces)):
        p = h.ssh(i, "hostname; hostname -I; ip -4 -o addr show", check=True, timeout=30)
        hostname, ips, addrs = p.stdout.split("\n", 2)
        assert hostname == name
        assert ips.split() == [addr]
        assert f"inet {addr}/24" in addrs and "127.0.0.1" in addrs
        assert h.run(i, ["hostname"]).stdout.strip() == name
    # host to host over the bridge, by name (each host's /etc/hosts lists the others)
    p = h.ssh(0, f"{' '.join(h.ssh_cmd)} {h.namespaces[1]} hostname -I", check=True, timeout=30)
    assert p.stdout.split() == [h.addresses[1]]
    # the machine's own name resolves, on a host, to the bridge address
    p = h.ssh(0, f"getent hosts {socket.gethostname()}", check=True, timeout=30)
    assert p.stdout.split()[0] == h.bridge_address


@pytest.mark.timeout(120)
def test_root_loopback_unaffected(test_hosts):
    """The root namespace's 127.0.0.1 still works, and a host's 127.0.0.1 is its own."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        assert tcp_connects("127.0.0.1", port)
        code = f"import socket; print(socket.socket().connect_ex(('127.0.0.1', {port})))"
        assert test_hosts.run(0, [sys.executable, "-c", code]).stdout.strip() == "111"  # refused


@pytest.mark.timeout(120)
def test_cut_and_restore(test_hosts):
    """A cut host is unreachable (from the root and from the other host); restore brings it back."""
    h = test_hosts
    h.cut(1)
    try:
        cmd = [*h.ssh_cmd, "-o", "ConnectTimeout=1", h.addresses[1], "true"]
        p = subprocess.run(cmd, capture_output=True, timeout=30)
        assert p.returncode != 0
        assert h.ssh(0, "true", timeout=30).returncode == 0
        code = f"import socket; s=socket.socket(); s.settimeout(1); print(s.connect_ex(({h.addresses[1]!r}, 22)))"
        assert h.run(0, [sys.executable, "-c", code]).stdout.strip() != "0"
    finally:
        h.restore(1)
    assert h.ssh(1, "true", timeout=30).returncode == 0
