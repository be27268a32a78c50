"""``%dist scale N`` over ssh: engines added on the namespace hosts (hosts.py) and stopped there.

Two hosts, one rank each; a scale to 3 starts rank 2 on the first host (the hosts run as many
engines, the first of ``--hosts`` wins the tie), ranked after the running ranks; training goes on
and equals one process that does the same world change; a scale back to 2 stops rank 2 on its
host, and no engine process is left in any host's network namespace. A host whose sshd does not
answer during a grow is named, and the old world goes on.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from distnb import session
from distnb.core.errors import ClusterError

from .parity import train_and_check_parity

pytestmark = pytest.mark.timeout(420)


def _engine_processes(test_hosts, i) -> set:
    """Pids of the ipyparallel engine processes (engines and their nannies) in host ``i``'s network namespace."""
    out = set()
    for pid in test_hosts.pids(i):
        try:
            line = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if "distnb.engine.ipengine" in line or "ipyparallel.engine" in line:
            out.add(pid)
    return out


def _expected(sess, test_hosts, i) -> set:
    """The engine processes host ``i`` should run: its ranks' engines and their children (the nannies)."""
    out = set()
    for r in sess.cluster.ranks:
        if r["host"] == test_hosts.namespaces[i]:
            out.add(r["pid"])
            out.update(c.pid for c in psutil.Process(r["pid"]).children(recursive=True))
    return out


def _wait_for(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.1)


def _all_reduce(sess):
    sess.run("import torch, torch.distributed as dist\n_t = torch.ones(1) * (rank + 1)\ndist.all_reduce(_t)")
    n = sess.world_size
    return [t.item() for t in sess.pull("_t")] == [n * (n + 1) / 2] * n


def test_grow_over_ssh_trains_on_with_parity_and_shrink_leaves_nothing(test_hosts, own_shell, ssh_world, capsys):
    sess = ssh_world
    ns = own_shell.user_ns
    import distnb

    sess.run("import distnb\n_tree = distnb.__file__")
    assert sess.pull("_tree") == [distnb.__file__] * 2  # the engines run the code under test (conftest's profile)
    first = train_and_check_parity(ns, sess, "ssc", epochs=1)
    pids = [r["pid"] for r in sess.cluster.ranks]
    capsys.readouterr()
    own_shell.run_line_magic("dist", "scale 3")
    said = capsys.readouterr().out
    assert "scaled the world from 2 ranks to 3" in said and "ssc_model" in said, said
    assert sess.world_size == 3 and [r["pid"] for r in sess.cluster.ranks[:2]] == pids  # the running ranks stay
    rows = sess.status().rows
    assert [r["alive"] for r in rows] == [True] * 3
    h1, h2 = test_hosts.namespaces
    assert [(r["host"], r["node_rank"], r["local_rank"]) for r in rows] == [(h1, 0, 0), (h2, 1, 0), (h1, 0, 1)]
    assert sess.cluster.master_addr == test_hosts.addresses[0]  # rank 0's bridge address, reached from both hosts
    assert sess.run("world_size", all_output=True) == ["3"] * 3
    added = sess.cluster.ranks[2]["pid"]
    assert _engine_processes(test_hosts, 0) == _expected(sess, test_hosts, 0)  # the new engine runs on h1

    second = train_and_check_parity(ns, sess, "ssc", epochs=2, then=first)  # 3 ranks' global batches
    assert second["result"].rows[2]["steps"] == second["result"].rows[0]["steps"]

    leaving = {added} | {c.pid for c in psutil.Process(added).children(recursive=True)}
    out = sess.scale(2)
    assert out["removed"] == [2] and out["unconfirmed"] == [] and sess.world_size == 2
    assert not leaving & _engine_processes(test_hosts, 0)  # gone from its host when scale returned
    for i in (0, 1):  # nothing else is left on either host (nannies exit with their engine)
        _wait_for(lambda: _engine_processes(test_hosts, i) == _expected(sess, test_hosts, i))
    train_and_check_parity(ns, sess, "ssc", epochs=1, then=second)
    assert [(r["host"], r["alive"]) for r in sess.status().rows] == [(h1, True), (h2, True)]


def test_a_host_that_does_not_answer_during_a_grow_is_named_and_the_old_world_goes_on(test_hosts, ssh_world):
    """h1 (where the added engine would go) answers no ssh login: the scale fails naming it; 2 ranks go on."""
    sess = ssh_world
    assert sess.world_size == 2
    pids = [r["pid"] for r in sess.cluster.ranks]
    sshd = test_hosts.sshd_pids[0]
    os.kill(sshd, signal.SIGSTOP)  # TCP still connects (the kernel accepts), the ssh handshake times out
    try:
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as info:
            sess.scale(3)
        took = time.monotonic() - t0
    finally:
        os.kill(sshd, signal.SIGCONT)
    text = str(info.value)
    assert f"on {test_hosts.addresses[0]} (over ssh)" in text and "is as it was" in text, text
    assert took < 60, took
    assert sess.world_size == 2 and [r["pid"] for r in sess.cluster.ranks] == pids
    assert _all_reduce(sess)
    assert _engine_processes(test_hosts, 0) == _expected(sess, test_hosts, 0)
    assert sess.scale(3)["world_size"] == (2, 3) and _all_reduce(sess)  # a scale after the failed one works
    sess.scale(2)


def test_a_scale_beyond_the_hosts_slots_is_refused(test_hosts, ssh_profile, own_shell):
    """--engines-per-node 1 on 2 hosts: no room for a third rank; nothing changes, and the world shrinks fine."""
    if session._CURRENT is not None:
        session._CURRENT.stop(quiet=True)
    sess = session.start(launcher="ssh", hosts=tuple(test_hosts.addresses), engines_per_node=1,
                         profile=ssh_profile, timeout=20, quiet=True)
    try:
        err = own_shell.run_cell("%dist scale 3").error_in_exec
        assert err is not None and "room for 0 more engines" in str(err) and "scale to at most 2" in str(err), err
        assert sess.world_size == 2
        sess.scale(1)
        assert sess.world_size == 1 and _all_reduce(sess)
        _wait_for(lambda: not _engine_processes(test_hosts, 1))
        sess.scale(2)  # back onto h2, the host with room
        assert [r["host"] for r in sess.status().rows] == test_hosts.namespaces and _all_reduce(sess)
    finally:
        sess.stop(quiet=True)
    for i in (0, 1):
        _wait_for(lambda: not _engine_processes(test_hosts, i), timeout=20)
