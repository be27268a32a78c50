"""distnb.cluster.slurm without a scheduler: what Slurm's commands print, turned into distnb's messages."""

from __future__ import annotations

import pytest

from distnb.cluster import slurm
from distnb.cluster.defaults import default_spec
from distnb.core.errors import ClusterError

SHOW_JOB = ("JobId=12 JobName=ipengine-abc UserId=root(0) GroupId=root(0) Priority=1 JobState=PENDING "
            "Reason=PartitionDown Dependency=(null) TimeLimit=1:00 Partition=down NodeList=(null) "
            "Command=/tmp/a b/slurm_engine.sbatch")


def test_scontrol_show_job_is_read():
    assert slurm.parse_job(SHOW_JOB) == dict(state="PENDING", reason="PartitionDown", nodes="(null)",
                                             time_limit="1:00", partition="down")
    assert slurm.parse_job("JobId=3 JobState=CANCELLED+ Reason=None")["state"] == "CANCELLED"


def test_pending_note_has_squeues_reason():
    assert slurm.pending_note("12", dict(reason="Resources")) == "job 12 pending: Resources (waiting for nodes to be free)"
    assert slurm.pending_note("7", dict(reason="QOSMaxJobsPerUserLimit")) == "job 7 pending: QOSMaxJobsPerUserLimit"


@pytest.mark.parametrize("given, stderr, words", [
    (dict(queue="gpu"), "sbatch: error: Batch job submission failed: Invalid partition name specified",
     "--partition gpu: Slurm has no such partition (it has: debug, down)"),
    (dict(nodes=5), "sbatch: error: Batch job submission failed: Node count specification invalid",
     "--nodes 5 x --engines-per-node 1 is more than Slurm can give (partition debug has 2 nodes"),
    (dict(), "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
     "sbatch could not reach slurmctld, the Slurm controller"),
    (dict(time_limit="9-00:00:00"), "sbatch: error: Batch job submission failed: Requested time limit is invalid",
     "--time 9-00:00:00: sbatch refused it"),
    (dict(), "sbatch: error: something new", "sbatch refused the engines' job: something new"),
])
def test_sbatch_refusals_name_the_option(monkeypatch, given, stderr, words):
    monkeypatch.setattr(slurm, "partitions", lambda: {"debug": 2, "down": 2})
    spec = default_spec(launcher="slurm", nodes=given.pop("nodes", 2), engines_per_node=1, **given)
    message = slurm.submit_error(slurm.SubmitError(["sbatch", "x"], 1, stderr), spec)
    assert words in message and message.endswith("no job was submitted"), message


def test_why_engines_stopped_is_slurms_account(monkeypatch):
    monkeypatch.setattr(slurm, "node_state", lambda name: ("down", "distnb test") if name == "n2" else ("idle", ""))
    monkeypatch.setattr(slurm, "job_info", lambda job: dict(state="TIMEOUT", time_limit="1:00"))
    assert slurm.why_gone("12", "1", ["n1"]) == "Slurm job 12 reached its time limit (--time 1) and was killed"
    monkeypatch.setattr(slurm, "job_info", lambda job: dict(state="NODE_FAIL"))
    assert slurm.why_gone("12", None, ["n1", "n2", "n2"]) == \
        "Slurm job 12 was ended by a node failure; node n2 is down (distnb test)"
    monkeypatch.setattr(slurm, "job_info", lambda job: dict(state="COMPLETING", reason="TimeLimit"))
    assert slurm.why_gone("12", "1", []) == "Slurm job 12 reached its time limit (--time 1) and was killed"
    monkeypatch.setattr(slurm, "job_info", lambda job: dict(state="RUNNING"))
    assert slurm.why_gone("12", None, ["n1"]) == ""


def test_queue_watch_says_each_reason_once_and_fails_when_the_job_ends(monkeypatch, tmp_path):
    states = iter([dict(state="PENDING", reason="Priority"), dict(state="PENDING", reason="Priority"),
                   dict(state="PENDING", reason="Resources"), dict(state="FAILED")])
    monkeypatch.setattr(slurm, "job_info", lambda job: next(states))
    out = tmp_path / "job.log"
    out.write_text("srun: error: something broke\n")
    said = []
    watch = slurm.QueueWatch("12", said.append, str(out), every=0)
    for _ in range(3):
        watch.check()
    assert said == ["distnb: job 12 pending: Priority (other jobs come first); waiting (interrupt to cancel it)",
                    "distnb: job 12 pending: Resources (waiting for nodes to be free); waiting (interrupt to cancel "
                    "it)"]
    assert watch.summary() == "job 12 still pending: Resources (waiting for nodes to be free)"
    with pytest.raises(ClusterError, match="Slurm job 12 ended \\(FAILED\\) before its engines registered; its output"):
        watch.check()


def test_a_request_that_could_never_start_is_refused_before_sbatch(monkeypatch):
    monkeypatch.setattr(slurm, "partitions", lambda: {"debug": 2, "gpu": 1})
    monkeypatch.setattr(slurm, "default_partition", lambda: "debug")
    spec = lambda **kw: default_spec(launcher="slurm", engines_per_node=1, **kw)  # noqa: E731
    assert slurm.check_request(spec(nodes=2)) == ""
    assert slurm.check_request(spec(nodes=3)) == \
        "--nodes 3 x --engines-per-node 1 is more than Slurm can give (partition debug has 2 nodes)"
    assert "partition gpu has 1 node)" in slurm.check_request(spec(nodes=2, queue="gpu"))
    assert slurm.check_request(spec(nodes=1, queue="big")) == \
        "--partition big: Slurm has no such partition (it has: debug, gpu)"
    monkeypatch.setattr(slurm, "partitions", lambda: {})  # sinfo could not tell: sbatch decides
    assert slurm.check_request(spec(nodes=9)) == ""


def test_a_reason_that_never_passes_ends_the_wait(monkeypatch):
    monkeypatch.setattr(slurm, "job_info", lambda job: dict(state="PENDING", reason="PartitionConfig"))
    with pytest.raises(ClusterError, match="job 5 pending: PartitionConfig: Slurm will not start it as asked"):
        slurm.QueueWatch("5", None, None, every=0).check()


def test_a_missing_command_is_an_exit_status():
    assert slurm.run(["distnb-no-such-command"]).returncode == 127
