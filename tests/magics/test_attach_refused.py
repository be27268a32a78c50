"""The world record of ``%dist attach`` (issue 38) and who is refused: it is private, another uid can neither
read it nor attach, and a connection file with an altered key gets no answer from the controller.

None of these tests changes the world: they share one first kernel (test_attach.py's
:func:`~test_attach.first_kernel`, its run ungated), started once for this file, where a world of its own for
each test cost a world's start each.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import tempfile
import time

import psutil
import pytest

import distnb
from distnb import session as sessions
from distnb.attaching import connect
from distnb.core.errors import ClusterError

from test_attach import claims, first_kernel  # noqa: F401 - claims is a fixture these tests use


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The first kernel's world (:func:`~test_attach.first_kernel`), its run ungated, for every test here."""
    with first_kernel(tmp_path_factory.mktemp("first_kernel"), gate_open=True) as info:
        yield info


def test_the_record_is_private_and_in_jupyters_runtime_folder(claims, world):
    from jupyter_core.paths import jupyter_runtime_dir

    rec = world["record_data"]
    assert os.path.dirname(world["record"]) == os.path.join(jupyter_runtime_dir(), "distnb-worlds")
    assert os.stat(os.path.dirname(world["record"])).st_mode & 0o777 == 0o700
    for path in (world["record"], rec["cluster_file"], rec["client_file"]):
        assert os.stat(path).st_mode & 0o777 == 0o600, path
        assert path.startswith(jupyter_runtime_dir())
    for kind in ("client", "engine"):  # signed: a key in every connection file
        with open(os.path.join(rec["profile_dir"], "security", f"ipcontroller-{rec['cluster_id']}-{kind}.json")) as f:
            info = json.load(f)
        assert info["key"] and info["signature_scheme"] == "hmac-sha256"
    for field in ("cluster_id", "cluster_file", "profile_dir", "kernel_pid", "notebook", "uid", "host", "world_size",
                  "backend", "device_type", "linger_s", "checkpoint_dir", "started", "run"):
        assert field in rec, field
    assert rec["kernel_pid"] == world["proc"].pid and rec["world_size"] == 2


def test_a_record_whose_key_was_altered_is_refused_within_its_timeout(claims, world, tmp_path):
    rec = world["record_data"]
    forged = tmp_path / "forged"
    forged.mkdir(mode=0o700)
    with open(rec["client_file"]) as f:
        info = json.load(f)
    info["key"] = "0" * len(info["key"])
    client_file = forged / "client.json"
    client_file.write_text(json.dumps(info))
    client_file.chmod(0o600)
    copied = {k: v for k, v in json.load(open(world["record"])).items()}
    copied["client_file"] = str(client_file)
    record = forged / "world.json"
    record.write_text(json.dumps(copied))
    record.chmod(0o600)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="did not answer within 3 s.*key.*attach refused"):
        distnb.attach(str(record), timeout=3)
    assert time.monotonic() - t0 < 15
    assert sessions._CURRENT is None
    record.chmod(0o644)  # a record others could read is refused before anything else
    with pytest.raises(ClusterError, match="not private to you"):
        distnb.attach(str(record), timeout=3)


def _as_nobody(check, *args) -> dict:
    """``check(*args)`` (a dict) in a forked child that runs as uid ``nobody``.

    Forked, not exec'd: the interpreter lives under /root, which ``nobody`` cannot read, so the child
    keeps the modules this process imported (everything ``check`` needs is imported before the fork).
    """
    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, check, report, and end without running any atexit of pytest's
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            os.write(write_end, json.dumps(check(*args)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child running as nobody failed"
    return json.loads(data)


def _what_nobody_can_do(record: str, forged: str) -> dict:
    out = {"uid": os.getuid()}
    try:
        with open(record) as f:
            f.read()
        out["read"] = "read it"
    except PermissionError:
        out["read"] = "denied"
    try:
        distnb.attach(record, quiet=True)
        out["attach"] = "attached"
    except ClusterError as exc:
        out["attach"] = str(exc)
    t0 = time.monotonic()
    try:
        connect({"client_file": forged, "cluster_id": "x"}, timeout=3).close()
        out["connect"] = "connected"
    except ClusterError as exc:
        out["connect"] = str(exc)
    out["seconds"] = time.monotonic() - t0
    return out


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another uid")
def test_another_uid_can_neither_read_the_record_nor_attach(claims, world):
    nobody = pwd.getpwnam("nobody")
    home = tempfile.mkdtemp(prefix="distnb-nobody-")
    os.chmod(home, 0o755)
    try:
        with open(world["record_data"]["client_file"]) as f:
            info = json.load(f)  # the controller's addresses, which another uid could find; not its key
        info["key"] = os.urandom(16).hex()
        forged = os.path.join(home, "client.json")
        with open(forged, "w") as f:
            json.dump(info, f)
        os.chmod(forged, 0o644)
        with pytest.raises(ClusterError, match="did not answer"):  # as root too: the key is what counts
            connect({"client_file": forged, "cluster_id": "x"}, timeout=3)
        out = _as_nobody(_what_nobody_can_do, world["record"], forged)
        assert out["uid"] == nobody.pw_uid
        assert out["read"] == "denied"
        assert "permission denied" in out["attach"] and "Only the user who started" in out["attach"]
        assert "did not answer within 3 s" in out["connect"] and out["seconds"] < 15
        assert psutil.pid_exists(world["record_data"]["controller_pid"])  # the world is unharmed
        assert sessions._CURRENT is None
    finally:
        shutil.rmtree(home, ignore_errors=True)
