"""Placement over hosts without processes: rank order, launcher settings, option checks."""

from __future__ import annotations

import pytest
from traitlets.config import Config

from distnb.cluster import placement
from distnb.cluster.defaults import default_spec
from distnb.core.errors import PlanError
from distnb.core.plan import ClusterSpec


def _where(host, address, launch_rank=None, local_rank=None, gpus=()):
    return dict(pid=1, host=host, address=address, boot_id="other-machine", cores=8, gpus=list(gpus),
                launch_rank=launch_rank, launch_local_rank=local_rank)


def test_ranks_follow_hosts_order_then_engine_id():
    where = {0: _where("b", "10.0.0.2"), 1: _where("a", "10.0.0.1"), 2: _where("b", "10.0.0.2"),
             3: _where("a", "10.0.0.1")}
    ranks = placement.assign_ranks(where, hosts=("b", "a"))
    assert [r["engine_id"] for r in ranks] == [0, 2, 1, 3]
    assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["node"] for r in ranks] == ["b", "b", "a", "a"]
    assert not any(r["local"] for r in ranks)


def test_ranks_without_hosts_sort_by_name_and_address():
    where = {5: _where("n", "10.0.0.12"), 6: _where("n", "10.0.0.9"), 7: _where("n", "10.0.0.12")}
    ranks = placement.assign_ranks(where)
    assert [r["engine_id"] for r in ranks] == [6, 5, 7]  # 10.0.0.9 < 10.0.0.12 as addresses, not strings
    # one hostname on every host (network namespaces): hosts are named by their address
    assert [r["node"] for r in ranks] == ["10.0.0.9", "10.0.0.12", "10.0.0.12"]


def test_mpi_ranks_are_kept():
    where = {0: _where("a", "10.0.0.1", 1, 1), 1: _where("a", "10.0.0.1", 0, 0), 2: _where("b", "10.0.0.2", 2, 0)}
    ranks = placement.assign_ranks(where)
    assert [r["engine_id"] for r in ranks] == [1, 0, 2]
    assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0)]


def test_engines_of_this_machine_are_local():
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    where = {0: dict(_where("me", "127.0.0.1"), boot_id=boot)}
    assert placement.assign_ranks(where)[0]["local"]


def test_ssh_settings_run_distnb_engines_on_each_host():
    spec = default_spec(launcher="ssh", hosts=("n1", "u@n2:2222"), engines_per_node=2)
    assert spec.num_engines == 4
    c = placement.launcher_config(spec, "ssh", Config(), {"A": "1"})
    assert c.SSHEngineSetLauncher.engines == {"n1": 2, "u@n2:2222": 2}
    assert c.SSHEngineSetLauncher.engine_cmd[1:] == ["-m", "distnb.engine.ipengine"]
    assert c.EngineLauncher.environment["A"] == "1"


def test_profile_environment_is_added_to_distnbs():
    spec = default_spec(launcher="ssh", hosts=("n1",))
    profile = Config()
    profile.EngineLauncher.environment = {"B": "2", "A": "profile"}
    env = placement.launcher_config(spec, "ssh", profile, {"A": "1", "C": "3"}).EngineLauncher.environment
    assert (env["A"], env["B"], env["C"]) == ("profile", "2", "3")


def test_profile_settings_win_where_no_option_is_given():
    spec = default_spec(launcher="ssh", hosts=("n1",))
    profile = Config()
    profile.SSHLauncher.remote_python = "/opt/py/bin/python"
    profile.EngineLauncher.engine_args = ["--x"]
    c = placement.launcher_config(spec, "ssh", profile, {})
    assert c.SSHEngineSetLauncher.engine_cmd[0] == "/opt/py/bin/python"
    assert "engine_args" not in c.EngineLauncher


def test_slurm_job_script_places_engines_per_node(tmp_path):
    """The job script ipyparallel writes (its own template code) asks for nodes and tasks per node."""
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    spec = default_spec(launcher="slurm", nodes=2, engines_per_node=4, queue="gpu", time_limit="01:00:00",
                        account="proj")
    assert spec.num_engines == 8
    c = placement.launcher_config(spec, "slurm", Config(), {})
    s = c.SlurmEngineSetLauncher
    assert (s.queue, s.timelimit, s.account) == ("gpu", "01:00:00", "proj")
    launcher = SlurmEngineSetLauncher(work_dir=str(tmp_path), config=c, cluster_id="abc", profile_dir=str(tmp_path))
    launcher.write_batch_script(8)
    script = (tmp_path / launcher.batch_file_name).read_text().splitlines()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --ntasks=8", "#SBATCH --partition=gpu",
                 "#SBATCH --time=01:00:00", "#SBATCH --account=proj", "#SBATCH --job-name=ipengine-abc",
                 "#SBATCH --no-requeue"):
        assert line in script
    assert script[-1].startswith("srun ") and "distnb.engine.ipengine" in script[-1]


def test_a_profile_with_its_own_slurm_script_cannot_take_nodes():
    profile = Config()
    profile.SlurmEngineSetLauncher.batch_template = "#!/bin/sh\nsrun {program_and_args}\n"
    with pytest.raises(PlanError, match="batch_template"):
        placement.launcher_config(default_spec(launcher="slurm", nodes=2), "slurm", profile, {})


def test_profile_says_how_many_engines():
    profile = Config()
    profile.SSHEngineSetLauncher.engines = {"a": 2, "b": {"n": 3}}
    assert placement.engine_count(profile) == 5
    assert placement.engine_count(Config()) is None


def test_gpu_per_local_rank_or_the_one_the_launcher_gave():
    from distnb.cluster.placement import _gpu_for

    assert _gpu_for(["0", "1"], 1) == "1"
    assert _gpu_for(["3"], 2) == "3"  # --gpus-per-task=1: each engine sees only its own
    assert _gpu_for([], 0) is None and _gpu_for(["0", "1"], 2) is None


def test_mpi_settings_with_hosts():
    spec = default_spec(launcher="mpi", hosts=("a", "b"), engines_per_node=1)
    c = placement.launcher_config(spec, "mpi", Config(), {})
    args = c.MPIEngineSetLauncher.mpi_args
    assert args[args.index("--host") + 1] == "a:1,b:1"


@pytest.mark.parametrize("kwargs, words", [
    (dict(launcher="ssh"), "--hosts"),
    (dict(launcher="slurm", hosts=("a",)), "--nodes"),
    (dict(launcher="local", nodes=2), "batch"),
    (dict(launcher="ssh", hosts=("a", "a")), "twice"),
    (dict(launcher="ssh", hosts=("a", "b"), engines_per_node=2, num_engines=3), "does not match"),
    (dict(launcher="nope"), "--launcher must be one of"),
    (dict(launcher="local", interface=""), "--interface"),
    (dict(launcher="pbs", time_limit="1:00"), None),
])
def test_bad_placement_names_the_option(kwargs, words):
    kwargs.setdefault("num_engines", 2)
    if words is None:  # valid spec; pbs cannot take --time: said when its settings are made
        spec = ClusterSpec(**kwargs)
        with pytest.raises(PlanError, match="--profile"):
            placement.launcher_config(spec, "pbs", Config(), {})
        return
    with pytest.raises(PlanError, match=words.replace("-", r"\-")):
        ClusterSpec(**kwargs)


def test_profile_by_name_gives_its_launcher_and_engines(tmp_path, monkeypatch):
    """``--profile NAME`` finds profile_NAME in the IPython directory and reads its ipcluster_config.py."""
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    folder = tmp_path / "profile_mycluster"
    folder.mkdir()
    (folder / "ipcluster_config.py").write_text(
        "c.Cluster.engine_launcher_class = 'ssh'\nc.SSHEngineSetLauncher.engines = {'n1': 2, 'n2': 2}\n")
    kwargs, config = placement.profile_config("mycluster")
    assert kwargs == {"profile": "mycluster"}
    spec = default_spec(profile="mycluster")
    assert spec.launcher is None and spec.num_engines == 4
    assert placement.launcher_name(spec, config) == "ssh"
    with pytest.raises(PlanError, match="no ipyparallel profile named nosuchprofile"):
        placement.profile_config("nosuchprofile")


@pytest.mark.parametrize("kwargs, words", [
    (dict(launcher="mpi", engines_per_node=4), "--engines-per-node needs --hosts"),
    (dict(launcher="ssh", hosts=("a", "b"), engines_per_node=0), "--engines-per-node must be at least 1"),
    (dict(launcher="local", hosts=("a",)), "add --launcher ssh"),
])
def test_placement_option_errors_name_the_option(kwargs, words):
    with pytest.raises(PlanError, match=words.replace("-", r"\-")):
        default_spec(**kwargs)


def test_growth_fills_the_hosts_with_fewest_engines_first():
    assert placement.spread(("a", "b"), [1, 1], [None, None], 3, 5) == {"a": 2, "b": 1}  # a, b, a
    assert placement.spread(("a", "b", "c"), [2, 1, 0], [None] * 3, 2, 5) == {"c": 1, "b": 1}
    assert placement.spread(("a", "b"), [2, 1], [2, 4], 2, 5) == {"b": 2}  # a is full
    with pytest.raises(PlanError, match=r"room for 1 more engines \(a: 1 of 1, b: 0 of 1.*scale to at most 2"):
        placement.spread(("a", "b"), [1, 0], [1, 1], 2, 3)


def test_host_caps_come_from_slots_else_cores_or_gpus():
    infos = [_where("a", "10.0.0.1"), _where("b", "10.0.0.2", gpus=("0", "1"))]
    assert placement.host_caps(("a", "b", "c"), infos, "cpu") == [128, 128, None]  # 16 per core; c: not known
    assert placement.host_caps(("a", "b"), infos, "cuda") == [0, 2]
    assert placement.host_caps(("a", "b"), infos, "cpu", 3) == [3, 3]
    assert placement.host_caps(("a", "b"), infos, "cpu", {"a": 2}) == [2, 128]
    assert placement.host_counts(("10.0.0.2", "a"), infos + [_where("a", "10.0.0.1")]) == [1, 2]


def test_added_engines_are_ranked_after_the_running_ones():
    where = {0: _where("a", "10.0.0.1"), 1: _where("b", "10.0.0.2"), 2: _where("a", "10.0.0.1"),
             3: _where("c", "10.0.0.3")}
    running = placement.assign_ranks({e: where[e] for e in (0, 1)}, hosts=("a", "b", "c"))
    grown = placement.extend_ranks(running, where, [3, 2], hosts=("a", "b", "c"))
    assert grown[:2] == running  # the running ranks keep their numbers
    assert [(p["engine_id"], p["node"], p["node_rank"], p["local_rank"]) for p in grown] == [
        (0, "a", 0, 0), (1, "b", 1, 0), (2, "a", 0, 1), (3, "c", 2, 0)]
