"""World records (distnb.cluster.worlds, issue 38): private files, signed connection files, stale records cleaned."""

from __future__ import annotations

import json
import os
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
    assert worlds.owned_elsewhere("abc")
    session = types.SimpleNamespace(cluster=types.SimpleNamespace(_ipp=types.SimpleNamespace(cluster_id="abc", cluster_file="c.json")))
    assert worlds.note_run(session, {"cell": "x"}) is None  # not rewritten (nor made: this stand-in has no more)
    assert worlds.read(worlds.record_path("abc"))["kernel_pid"] == other
    worlds._write(worlds.record_path("abc"), dict(cluster_id="abc", kernel_pid=os.getpid()))
    assert not worlds.owned_elsewhere("abc")
