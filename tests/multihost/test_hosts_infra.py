"""Self-test of the multihost infrastructure: namespaces reachable by ssh, cut links, and
ipyparallel's real SSH engine launcher starting one engine in each namespace.

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

import json
import os
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


@pytest.mark.timeout(240)
def test_ssh_engine_launcher_starts_an_engine_per_host(test_hosts, tmp_path):
    """ipyparallel's SSHEngineSetLauncher puts engine i in host i; stop_cluster_sync removes them all."""
    import ipyparallel as ipp
    from traitlets.config import Config

    h = test_hosts
    c = Config()
    c.SSHEngineSetLauncher.engines = {addr: 1 for addr in h.addresses}
    c.SSHEngineSetLauncher.environment = {"IPYTHONDIR": os.environ["IPYTHONDIR"], "OMP_NUM_THREADS": "1"}
    c.SSHLauncher.ssh_cmd = h.ssh_cmd
    c.SSHLauncher.scp_cmd = h.scp_cmd
    c.SSHLauncher.remote_python = sys.executable
    cluster = ipp.Cluster(engine_launcher_class="ssh", controller_ip=h.bridge_address, n=h.n,
                          profile_dir=str(tmp_path / "profile"), config=c)
    rc = None
    try:
        t0 = time.monotonic()
        rc = cluster.start_and_connect_sync(activate=False)
        rc.wait_for_engines(h.n, timeout=90)
        started = time.monotonic() - t0

        # a stdlib function (pickled by reference): the engines cannot import this test module
        seen = [out.split("\n", 1) for out in
                rc[:].apply_sync(subprocess.check_output, ["sh", "-c", "hostname; ip -4 -o addr"], text=True)]
        assert sorted(name for name, _ in seen) == sorted(h.namespaces)
        for name, addrs in seen:
            assert f"inet {h.addresses[h.namespaces.index(name)]}/24" in addrs
        # the scp of the connection files onto themselves left them whole
        security = tmp_path / "profile" / "security"
        for f in security.glob("ipcontroller-*.json"):
            assert "key" in json.loads(f.read_text())
        # the controller listens on the bridge address only
        listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
        assert f"{h.bridge_address}:" in listening
        rc.close()
        rc = None
        t0 = time.monotonic()
        cluster.stop_cluster_sync()
        stopped = time.monotonic() - t0
    finally:
        if rc is not None:
            rc.close()
        if cluster.controller is not None or cluster.engines:
            cluster.stop_cluster_sync()
    assert _wait_only_sshd_left(h) == {}
    print(f"\nssh launcher: {h.n} engines up in {started:.1f} s, cluster stopped in {stopped:.1f} s")
