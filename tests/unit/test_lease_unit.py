"""The lease's pure parts (issue 38): --linger as a duration, the default folder, claim's refusals, the start line."""

from __future__ import annotations

import dataclasses
import os
import types

import pytest

from distnb.cluster import lease
from distnb.core import options
from distnb.core.errors import ClusterError, PlanError
from distnb.core.plan import ClusterSpec


@pytest.mark.parametrize("given, seconds", [("10m", 600.0), ("90s", 90.0), ("1.5h", 5400.0), ("1d", 86400.0),
                                            ("45", 45.0), (0, 0.0), (20, 20.0), ("0", 0.0), (" 2M ", 120.0)])
def test_linger_takes_durations(given, seconds):
    assert ClusterSpec(num_engines=2, linger=given).linger == seconds


@pytest.mark.parametrize("bad", ["ten minutes", "-5", -1, "5y", "", float("inf"), True, "1h30m"])
def test_a_bad_linger_is_an_error_naming_the_flag(bad):
    with pytest.raises(PlanError, match="--linger"):
        ClusterSpec(num_engines=2, linger=bad)


def test_linger_defaults_to_ten_minutes_and_is_a_start_option():
    assert ClusterSpec(num_engines=2).linger == 600.0
    flags = {f.name: options.flags_of(f, opt) for f, opt in options.declared(ClusterSpec)}
    assert flags["linger"] == ("--linger",)
    assert "linger" in options.keywords(ClusterSpec)
    help_text = dict((f.name, opt.help) for f, opt in options.declared(ClusterSpec))["linger"]
    assert "e.g. --linger 1h" in help_text and "0 ends everything" in help_text


def test_the_default_folder_is_next_to_the_notebook(tmp_path):
    nb = tmp_path / "work" / "train.ipynb"
    nb.parent.mkdir()
    assert lease.default_folder("c1", str(nb), cwd="/elsewhere") == str(tmp_path / "work" / "distnb-lease" / "train-c1")
    # a relative notebook path (Jupyter Server's API path): the kernel runs in its folder
    assert lease.default_folder("c1", "sub/train.ipynb", cwd=str(tmp_path)) == str(
        tmp_path / "distnb-lease" / "train-c1")
    assert lease.default_folder("c1", "", cwd=str(tmp_path)) == str(tmp_path / "distnb-lease" / "kernel-c1")


def test_format_duration():
    assert [lease.format_duration(s) for s in (600, 90, 7200, 86400, 0.5)] == ["10m", "90s", "2h", "1d", "0.5s"]


def test_the_start_line_names_the_linger_and_the_folder():
    spec = ClusterSpec(num_engines=2, linger="20s")
    cluster = types.SimpleNamespace(spec=spec, lease_folder="/nb/distnb-lease/train-c1")
    note = lease.start_note(cluster)
    assert "--linger 20s" in note and "/nb/distnb-lease/train-c1" in note and "--checkpoint-dir" in note
    assert "--linger 0" in lease.start_note(types.SimpleNamespace(spec=dataclasses.replace(spec, linger=0.0)))


def test_claim_without_a_keeper_says_so():
    with pytest.raises(ClusterError, match="no keeper is alive for world nosuchworld"):
        lease.claim("nosuchworld", os.getpid(), timeout=0.5)


def test_claim_of_an_expired_lease_names_where_the_state_went():
    lease.write_private(lease.keeper_file("gone1"), dict(pid=os.getpid(), state="ended", checkpoint_dir="/d",
                                                         saved=[{"path": "/d/step_00000192"}]))
    try:
        with pytest.raises(ClusterError, match=r"already expired.*?/d/step_00000192.*?%dist load"):
            lease.claim("gone1", os.getpid(), timeout=0.5)
    finally:
        os.remove(lease.keeper_file("gone1"))


def test_claim_of_a_dead_process_is_refused():
    with pytest.raises(ClusterError, match="process 999999999 is not running"):
        lease.claim("any", 999999999, timeout=0.5)


def test_claim_that_no_keeper_takes_times_out_and_leaves_no_claim_file():
    lease.write_private(lease.keeper_file("deaf1"), dict(pid=os.getpid(), owner=1, state="watching"))
    try:
        with pytest.raises(ClusterError, match="did not take the claim"):
            lease.claim("deaf1", os.getpid(), timeout=0.3)
        assert not os.path.exists(lease.claim_file("deaf1", os.getpid()))
        assert oct(os.stat(lease.lease_dir()).st_mode & 0o777) == "0o700"
        assert oct(os.stat(lease.keeper_file("deaf1")).st_mode & 0o777) == "0o600"
    finally:
        os.remove(lease.keeper_file("deaf1"))
