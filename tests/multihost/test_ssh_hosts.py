"""Training across hosts: engines in network namespaces, started by ipyparallel's SSH launcher.

The kernel and the controller stay in the root namespace; each test host (hosts.py) is a
network namespace with its own address, hostname and a real sshd. ``%dist start --launcher
ssh --hosts ... --profile P`` starts one engine per host through ssh (the profile only tells
ipyparallel which ssh client configuration to use), and the ranks rendezvous over the bridge.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from distnb import session
from distnb.core.errors import ClusterError, RankError

from .parity import train_and_check_parity

pytestmark = pytest.mark.timeout(240)


def test_ranks_are_placed_one_per_host(test_hosts, ssh_world):
    cluster = ssh_world.cluster
    table = ssh_world.status()
    assert [r["alive"] for r in table.rows] == [True, True]
    assert [r["node_rank"] for r in table.rows] == [0, 1]  # --hosts order
    assert [r["local_rank"] for r in table.rows] == [0, 0]
    assert [r["host"] for r in table.rows] == test_hosts.namespaces  # each namespace has its own hostname
    # the rendezvous is rank 0's address on the bridge, never loopback
    assert cluster.master_addr == test_hosts.addresses[0]
    assert table.store.startswith(test_hosts.addresses[0] + ":")
    # the controller listens on the bridge address only (engines are remote)
    listening = {c.laddr.ip for c in psutil.Process(cluster.pids["controller"]).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert listening == {test_hosts.bridge_address}
    # what the kernel may kill by pid (at stop, or its watchdog when the kernel dies) is on this machine only:
    # remote ranks' pids are pids on their own hosts (here one pid space hides the difference)
    remote_pids = {r["pid"] for r in cluster.ranks}
    assert not remote_pids & set(cluster.family)
    # each rank's gloo traffic goes over its host's bridge link
    ssh_world.run("import os\n_ifname = os.environ['GLOO_SOCKET_IFNAME']")
    assert ssh_world.pull("_ifname") == ["eth0", "eth0"]


def test_training_across_hosts_matches_one_process(own_shell, ssh_world):
    train_and_check_parity(own_shell.user_ns, ssh_world, "mh")


def test_rank_error_on_one_host_leaves_the_cluster_usable(own_shell, ssh_world):
    with pytest.raises(RankError) as info:
        ssh_world.run("if rank == 1:\n    raise ValueError('bad shard')\n")
    assert info.value.rank == 1 and "bad shard" in str(info.value)
    ssh_world.run("import torch, torch.distributed as dist\n_t = torch.ones(1) * (rank + 1)\ndist.all_reduce(_t)")
    assert [t.item() for t in ssh_world.pull("_t")] == [3.0, 3.0]


def test_interrupt_reaches_ranks_on_other_hosts(own_shell, ssh_world):
    """The kernel's interrupt reaches each remote engine through its ipyparallel nanny (no pid to signal here)."""
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ssh_world.run("import time\nfor _ in range(600):\n    time.sleep(0.1)\n")
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 2.0 + 10.0
    ssh_world.run("import torch, torch.distributed as dist\n_t = torch.ones(1) * (rank + 1)\ndist.all_reduce(_t)")
    assert [t.item() for t in ssh_world.pull("_t")] == [3.0, 3.0]


def test_lost_host_is_reported_by_name_and_stop_stays_bounded(test_hosts, ssh_profile, own_shell, ssh_world):
    """h2's link goes down under a live cluster: the cell fails naming rank 1 and its host; stop does not hang."""
    test_hosts.cut(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            ssh_world.run("import torch, torch.distributed as dist\n_t = torch.ones(1)\ndist.all_reduce(_t)")
        took = time.monotonic() - t0
        text = str(info.value)
        assert info.value.rank == 1 and test_hosts.namespaces[1] in text and "heartbeat" in text, text
        assert took < ssh_world.cluster.spec.timeout + 30, took
        assert [r["alive"] for r in ssh_world.status().rows] == [True, False]
        t0 = time.monotonic()
        ssh_world.stop(quiet=True)  # h2 cannot be reached to stop its engine: bounded, not minutes
        assert time.monotonic() - t0 < 45, time.monotonic() - t0
        assert session._CURRENT is None
    finally:
        test_hosts.restore(1)
    fresh = session.start(launcher="ssh", hosts=tuple(test_hosts.addresses), profile=ssh_profile, timeout=20,
                          quiet=True)
    fresh.run("import torch, torch.distributed as dist\n_t = torch.ones(1) * (rank + 1)\ndist.all_reduce(_t)")
    assert [t.item() for t in fresh.pull("_t")] == [3.0, 3.0]
    fresh.stop(quiet=True)


def test_host_that_cannot_be_reached_by_ssh_is_named(test_hosts, ssh_profile, own_shell):
    nobody = test_hosts.addresses[0].rsplit(".", 1)[0] + ".99"  # on the bridge's network, no host there
    with pytest.raises(ClusterError, match=f"on {nobody} \\(over ssh\\)"):
        session.start(launcher="ssh", hosts=(test_hosts.addresses[0], nobody), profile=ssh_profile, timeout=10,
                      quiet=True)
    assert session._CURRENT is None


def test_host_that_cannot_reach_the_rendezvous_is_named(test_hosts, ssh_profile, own_shell, ssh_world):
    """h2 loses its route to h1 (rank 0) but still reaches the controller: the error names h2, the address, the port."""
    if session._CURRENT is not None:
        session._CURRENT.stop(quiet=True)
    rank0 = test_hosts.addresses[0]
    test_hosts.run(1, ["ip", "route", "add", "prohibit", f"{rank0}/32"], check=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as info:
            session.start(launcher="ssh", hosts=tuple(test_hosts.addresses), profile=ssh_profile, timeout=8,
                          quiet=True)
        took = time.monotonic() - t0
    finally:
        test_hosts.run(1, ["ip", "route", "del", "prohibit", f"{rank0}/32"], check=True)
    text = str(info.value)
    assert f"on host {test_hosts.namespaces[1]} cannot reach the rendezvous at {rank0}:" in text, text
    assert "--interface" in text
    assert session._CURRENT is None
    assert took < 8 + 60, took  # the rendezvous timeout, not a hang


def test_loopback_interface_across_hosts_is_refused(test_hosts, ssh_profile, own_shell):
    with pytest.raises(ClusterError, match="--interface lo is loopback"):
        session.start(launcher="ssh", hosts=tuple(test_hosts.addresses), profile=ssh_profile, timeout=8,
                      interface="lo", quiet=True)
    assert session._CURRENT is None
