"""Security of the shared real cluster (issue 4, behaviour 8).

Every socket that the controller, the engines (and their nannies) and the torch.distributed
store listen on is bound to 127.0.0.1, also after the process group is re-formed; ipyparallel's
message signing is on (the connection files and every party's session carry a key); the
files in the profile's ``security`` folder are readable by the owner only.
"""

import json
import os
import stat

import psutil

from distnb import session as session_mod
from distnb.core.errors import RankError


def run(shell, code):
    return shell.run_cell(code, silent=False)


def _listening(pid):
    """{(ip, port)} that ``pid`` and its descendants listen on (TCP and UDP over IPv4/IPv6)."""
    proc = psutil.Process(pid)
    out = set()
    for p in [proc, *proc.children(recursive=True)]:
        for conn in p.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN or (conn.type == 2 and not conn.raddr):  # TCP listen, bound UDP
                out.add((conn.laddr.ip, conn.laddr.port))
    return out


def _check_loopback_only(shell):
    table = run(shell, "%dist status").result
    session = session_mod.current()
    pids = {"controller": table.controller_pid, **{f"rank {r['rank']}": r["pid"] for r in table}}
    assert all(pids.values()), pids
    seen = {}
    for who, pid in pids.items():
        seen[who] = _listening(pid)
        exposed = sorted(a for a in seen[who] if a[0] != "127.0.0.1")
        assert exposed == [], f"{who} (pid {pid}) listens beyond 127.0.0.1: {exposed}"
    assert seen["controller"], "the controller should listen (on 127.0.0.1)"
    # the torch.distributed store is rank 0's, on the port the status names
    host, port = table.store.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == session.cluster.master_port
    assert ("127.0.0.1", int(port)) in seen["rank 0"]


def test_every_listening_socket_is_on_loopback(shell):
    _check_loopback_only(shell)


def test_still_loopback_only_after_the_group_is_re_formed(shell):
    before = session_mod.current().cluster.master_port
    res = run(shell, "%%dist\nimport torch, torch.distributed as dist\nif rank == 1:\n    raise ValueError('x')\n"
                     "dist.all_reduce(torch.ones(1))")
    assert isinstance(res.error_in_exec, RankError)
    assert session_mod.current().cluster.master_port == before  # the same store (a new key prefix), same port
    _check_loopback_only(shell)


def test_message_signing_is_on(shell):
    cluster = session_mod.current().cluster
    security = os.path.join(cluster._ipp.profile_dir, "security")
    files = [os.path.join(security, f) for f in os.listdir(security) if cluster._ipp.cluster_id in f]
    connection = [f for f in files if f.endswith(("-client.json", "-engine.json"))]
    assert len(connection) == 2, files
    for path in connection:
        info = json.loads(open(path).read())
        assert info["key"] and info["signature_scheme"].startswith("hmac-"), path
    # the kernel's client and every engine sign their messages with that key
    key = cluster.client.session.key
    assert key and cluster.client.session.signature_scheme.startswith("hmac-")
    signed = session_mod.current().run("_k = get_ipython().kernel.session\n(bool(_k.key), _k.signature_scheme)",
                                       all_output=True)
    assert signed == ["(True, 'hmac-sha256')"] * 2


def test_connection_files_are_owner_only(shell):
    cluster = session_mod.current().cluster
    security = os.path.join(cluster._ipp.profile_dir, "security")
    assert stat.S_IMODE(os.stat(security).st_mode) & 0o077 == 0
    names = os.listdir(security)
    assert any(cluster._ipp.cluster_id in n for n in names)
    for name in names:
        mode = stat.S_IMODE(os.stat(os.path.join(security, name)).st_mode)
        assert mode & 0o077 == 0, f"{name} is mode {oct(mode)}: readable by others"
