"""World records (distnb.cluster.worlds, issue 38): private files, signed connection files, stale records cleaned."""

from __future__ import annotations

import json
import os
import threading
import types

import pytest

from distnb.cluster import worlds
from distnb.core.errors import ClusterError


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    return tmp_path / "runtime"


def _connection_files(tmp_path, key):
    profile = tmp_path / "profile"
    (profile / "security").mkdir(parents=True)
    for kind in ("client", "engine"):
        (profile / "security" / f"ipcontroller-abc-{kind}.json").write_text(
            json.dumps({"key": key, "signature_scheme": "hmac-sha256"}))
    return types.SimpleNamespace(profile_dir=str(profile), cluster_id="abc")


def _client(key):
    return types.SimpleNamespace(session=types.SimpleNamespace(key=key, signature_scheme="hmac-sha256"))


def test_folders_are_private_and_in_the_runtime_folder(runtime):
    assert worlds.folder() == os.path.join(str(runtime), "distnb-worlds")
    assert worlds.profile_folder() == os.path.join(str(runtime), "distnb-ipython")
    for path in (runtime, runtime / "distnb-worlds", runtime / "distnb-ipython"):
        assert os.stat(path).st_mode & 0o777 == 0o700
    os.chmod(worlds.folder(), 0o755)  # loosened by hand: made private again
    assert os.stat(worlds.folder()).st_mode & 0o777 == 0o700


def test_a_record_is_written_0600_and_a_shared_one_is_refused(runtime):
    path = worlds.record_path("abc")
    worlds._write(path, {"cluster_id": "abc", "run": None})
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert worlds.read(path)["cluster_id"] == "abc"
    os.chmod(path, 0o640)
    with pytest.raises(ClusterError, match="not private to you"):
        worlds.read(path)


def test_unsigned_connection_files_are_refused(tmp_path):
    worlds.check_signed(_connection_files(tmp_path / "ok", "k3y"), _client(b"k3y"))
    with pytest.raises(ClusterError, match="no message key"):
        worlds.check_signed(_connection_files(tmp_path / "empty", ""), _client(b"k3y"))
    with pytest.raises(ClusterError, match="does not sign"):
        worlds.check_signed(_connection_files(tmp_path / "client", "k3y"), _client(b""))


def test_stale_records_are_removed_from_the_listing(runtime, tmp_path):
    client_file = tmp_path / "client.json"
    client_file.write_text("{}")
    me = dict(pid=os.getpid(), started=worlds._process_start(os.getpid()))
    live = dict(cluster_id="live", controller_pid=me["pid"], controller_started=me["started"],
                client_file=str(client_file), kernel_pid=me["pid"], kernel_started=me["started"], run=None, started=2)
    dead = dict(live, cluster_id="dead", controller_started=me["started"] - 100)  # the pid reused since
    gone = dict(live, cluster_id="gone", client_file=str(tmp_path / "nothing.json"))
    for rec in (live, dead, gone):
        worlds._write(worlds.record_path(rec["cluster_id"]), rec)
    assert [r["cluster_id"] for r in worlds.live()] == ["live"]
    assert sorted(os.listdir(worlds.folder())) == ["live.json"]
    assert "controller" in worlds.why_stale(dead) and "connection file" in worlds.why_stale(gone)


def test_a_kernel_that_another_attached_to_leaves_the_record_to_it(runtime):
    other = os.getppid()  # a live process that is not this one: the kernel that attached
    worlds._write(worlds.record_path("abc"), dict(cluster_id="abc", kernel_pid=other,
                                                  kernel_started=worlds._process_start(other)))
    assert not worlds.owned_here("abc")
    session = types.SimpleNamespace(cluster=types.SimpleNamespace(_ipp=types.SimpleNamespace(cluster_id="abc", cluster_file="c.json")))
    assert worlds.note_run(session, {"cell": "x"}) is None  # not rewritten (nor made: this stand-in has no more)
    assert worlds.read(worlds.record_path("abc"))["kernel_pid"] == other
    worlds._write(worlds.record_path("abc"), _mine("abc"))
    assert worlds.owned_here("abc")
    worlds.remove("abc")  # (this process writes no record of "abc" after this: each test here has its own world id)
    assert not worlds.owned_here("abc")  # stopped: no record names this kernel any more


def _mine(cid, **more):
    """A record of world ``cid`` that names this process as its kernel."""
    return dict(cluster_id=cid, kernel_pid=os.getpid(), kernel_started=worlds._process_start(os.getpid()), **more)


def _other_kernel(cid):
    """The record another live kernel writes when it attaches to world ``cid`` (it owns the world from then on)."""
    other = os.getppid()
    return dict(cluster_id=cid, kernel_pid=other, kernel_started=worlds._process_start(other))


def test_a_record_write_never_brings_back_a_world_another_kernel_stopped(runtime):
    """The race of the attach test: this kernel's cell ends (its record write is on its way), another kernel stops
    the world meanwhile (the record is removed from that process, whose removal this one's memory knows nothing of);
    the late write must not make the record again."""
    path = worlds.record_path("stopped")
    worlds._write(path, _mine("stopped", run={"cell": "x"}))
    assert worlds.read(path)["kernel_pid"] == os.getpid()  # so note_run's first check passes: its thread is on its way
    os.remove(path)  # the other kernel's %dist stop (worlds.remove in that process)
    worlds._write_newest("stopped", next(worlds._TICKETS), _mine("stopped", run=None))  # the writing thread's turn comes
    assert not os.path.exists(path)


def test_a_record_write_never_takes_back_a_world_another_kernel_attached_to(runtime):
    path = worlds.record_path("attached")
    worlds._write(path, _mine("attached", run={"cell": "x"}))
    assert worlds.read(path)["kernel_pid"] == os.getpid()
    worlds._write(path, _other_kernel("attached"))  # %dist attach in another kernel, after this one's check
    worlds._write_newest("attached", next(worlds._TICKETS), _mine("attached", run=None))
    assert worlds.read(path)["kernel_pid"] == os.getppid()


def test_the_owner_check_and_the_write_hold_the_lock_that_a_stop_takes(runtime):
    """Whoever holds the records' lock (here: this test, as another kernel's stop does) keeps a writer out until it
    is done; the writer then checks the record under the lock and finds it gone."""
    path = worlds.record_path("locked")
    worlds._write(path, _mine("locked"))
    with worlds.locked():
        writer = threading.Thread(target=worlds._write_newest, args=("locked", next(worlds._TICKETS), _mine("locked")))
        writer.start()
        writer.join(0.3)
        assert writer.is_alive()  # waiting for the lock: no write in between
        os.remove(path)  # the stop, under the lock
    writer.join(10.0)
    assert not writer.is_alive() and not os.path.exists(path)
    lock = os.path.join(worlds.folder(), worlds.LOCK_FILE)
    assert os.stat(lock).st_mode & 0o777 == 0o600 and not lock.endswith(".json")  # private, and never read as a record


def test_this_kernels_own_record_is_still_rewritten_and_a_stop_removes_it(runtime):
    path = worlds.record_path("own")
    worlds._write(path, _mine("own", run={"cell": "x"}))
    worlds._write_newest("own", next(worlds._TICKETS), _mine("own", run=None))
    assert worlds.read(path)["run"] is None and os.stat(path).st_mode & 0o777 == 0o600
    worlds.remove("own")
    assert not os.path.exists(path)
