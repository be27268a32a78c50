"""``%dist start --cpu-bind``: each CPU rank's process, every thread of it but gloo's, on its own share of the cores."""

import glob
import os
import subprocess
import sys

import psutil
import pytest

from distnb import session as session_mod
from distnb.engine.process import binding
from support.worlds import back_to_two_ranks

CORES = sorted(psutil.Process().cpu_affinity())
ALL_REDUCE = "import torch, torch.distributed as dist\nx = torch.ones(1)\ndist.all_reduce(x)\nx.item()"
pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="binding 2 ranks to cores of their own needs 2 cores")


def thread_cpus(pid: int, gloo: bool = False) -> set:
    """The distinct CPU sets (``Cpus_allowed_list``) of the threads of process ``pid``: gloo's (``gloo``), or the
    others."""
    out = set()
    for task in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            with open(task) as f:
                lines = f.read().splitlines()
            name = next(line.split(None, 1)[1] for line in lines if line.startswith("Name:"))
            if any(word in name for word in binding.GLOO_THREADS) == gloo:
                out.add(next(line.split()[1] for line in lines if line.startswith("Cpus_allowed_list")))
        except (OSError, StopIteration, IndexError):
            pass
    return out


def test_cores_binds_every_thread_of_each_rank_to_its_own_share_and_a_scale_shares_them_out_again(dist_session, capsys):
    s = dist_session.restart(quiet=True, cpu_bind="cores")
    try:
        assert s.run(ALL_REDUCE) == ["2.0", "2.0"]
        table = s.status()
        shares = [binding.share(CORES, r, 2) for r in range(2)]
        assert [r["cores"] for r in table] == [binding.describe(x) for x in shares]
        assert [thread_cpus(r["pid"]) for r in table] == [{binding.describe(x)} for x in shares]
        # gloo's threads on every core: FSDP2's many small collectives cost twice the switches on the rank's one
        assert [thread_cpus(r["pid"], gloo=True) for r in table] == [{binding.describe(CORES)}] * 2
        capsys.readouterr()
        out = s.scale(len(CORES) + 1)  # more ranks than cores: none is bound, and the scale says so
        said = capsys.readouterr().out
        assert f"no longer bound to cores: this host has {len(CORES) + 1} ranks now and only {len(CORES)} cores" in said
        assert out["binding"] in said and out["binding"]
        table = s.status()
        assert {r["cores"] for r in table} == {"all"}
        assert all(thread_cpus(r["pid"]) == {binding.describe(CORES)} for r in table)
        assert s.run(ALL_REDUCE) == [f"{len(CORES) + 1.0}"] * (len(CORES) + 1)
        assert "bound to cores of their own now" in s.scale(2, quiet=True)["binding"]  # each to its share
        assert [thread_cpus(r["pid"]) for r in s.status()] == [{binding.describe(x)} for x in shares]
    finally:
        s.restart(n=2, quiet=True, cpu_bind="auto")
        back_to_two_ranks()


def test_none_leaves_every_rank_on_every_core(dist_session):
    s = dist_session.restart(quiet=True, cpu_bind="none")
    try:
        table = s.status()
        assert [r["cores"] for r in table] == ["all", "all"]
        assert all(thread_cpus(r["pid"]) == {binding.describe(CORES)} for r in table)
    finally:
        s.restart(quiet=True, cpu_bind="auto")


def test_auto_leaves_the_ranks_unbound_while_another_process_keeps_the_cores_busy(dist_session, capsys):
    spin = "import time\nt = time.time()\nwhile time.time() - t < 60: pass\n"
    out = subprocess.run(["sh", "-c", '"$0" -c "$1" >/dev/null 2>&1 & echo $!', sys.executable, spin],
                         capture_output=True, text=True, check=True, start_new_session=True)
    pid = int(out.stdout.split()[-1])  # detached: another user's work, not this kernel's
    try:
        capsys.readouterr()
        s = dist_session.restart(cpu_bind="auto")
        said = capsys.readouterr().out
        assert [r["cores"] for r in s.status()] == ["all", "all"]
        assert "not bound to cores: other processes used" in said and "%dist restart --cpu-bind cores" in said
        assert s.cluster.foreign_cores >= 0.25
    finally:
        os.kill(pid, 9)
        session_mod.current().restart(quiet=True, cpu_bind="auto")


def test_a_bad_cpu_bind_is_a_usage_error_naming_the_choices(shell):
    from IPython.core.error import UsageError

    from distnb.core.errors import PlanError

    before = session_mod.current()
    res = shell.run_cell("%dist restart --cpu-bind sockets")
    assert isinstance(res.error_in_exec, UsageError)
    assert "--cpu-bind must be one of auto, cores, none, got 'sockets'" in str(res.error_in_exec)
    with pytest.raises(PlanError, match="--cpu-bind must be one of auto, cores, none"):
        before.restart(quiet=True, cpu_bind="sockets")
    assert session_mod.current() is before and before.running and before.world_size == 2  # nothing was stopped


ROWS = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import Dataset
class Rows(Dataset):
    def __len__(self):
        return 128
    def __getitem__(self, i):
        return torch.full((4,), float(i)), i % 2
rows = Rows()
torch.manual_seed(0)
rows_net = nn.Linear(4, 2)
"""


def test_a_bound_ranks_workers_share_its_cores_without_torchs_worker_count_warning(shell, dist_session, capfd):
    s = dist_session.restart(quiet=True, cpu_bind="cores")
    try:
        assert shell.run_cell(ROWS).error_in_exec is None
        capfd.readouterr()
        res = shell.run_cell("%%distrain --model rows_net --data rows --epochs 2 --batch-size 16 --workers 2 "
                             "--progress none\nx, y = batch\nloss = F.cross_entropy(model(x), y)")
        assert res.error_in_exec is None, res.error_in_exec
        out = capfd.readouterr()
        assert "worker processes in total" not in out.out + out.err  # the workers' share is the rank's by design
        shares = [binding.describe(binding.share(CORES, r, 2)) for r in range(2)]
        assert [r["cores"] for r in s.status()] == shares
    finally:
        session_mod.current().restart(quiet=True, cpu_bind="auto")


def test_cores_says_so_when_the_ranks_outnumber_the_cores(dist_session, capsys):
    capsys.readouterr()
    s = dist_session.restart(n=len(CORES) + 1, cpu_bind="cores")
    try:
        said = capsys.readouterr().out
        assert f"this host has {len(CORES) + 1} ranks and only {len(CORES)} cores for them" in said
        assert {r["cores"] for r in s.status()} == {"all"}
    finally:
        s.restart(n=2, quiet=True, cpu_bind="auto")
        back_to_two_ranks()
