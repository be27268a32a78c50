"""``%dist start --launcher mpi``: engines started by Open MPI's mpiexec through ipyparallel's MPI launcher."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal

import pytest
from IPython.core.error import UsageError

from distnb import session
from distnb.engine.process import binding
from distnb.core.errors import RankError

from .parity import train_and_check_parity

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("mpiexec") is None or importlib.util.find_spec("mpi4py") is None,
                                 reason="mpi: needs mpiexec (apt install openmpi-bin) and mpi4py")]


@pytest.fixture(scope="module")
def mpi(own_shell):
    own_shell.run_line_magic("dist", "start --launcher mpi -n 2 --timeout 20")
    assert session._CURRENT is not None
    yield session._CURRENT
    if session._CURRENT is not None:
        session._CURRENT.stop(quiet=True)


def test_ranks_are_mpi_ranks(mpi):
    mpi.run("import os\n_mpi = (int(os.environ['OMPI_COMM_WORLD_RANK']), mpi_rank, sorted(os.sched_getaffinity(0)))")
    got = mpi.pull("_mpi")
    assert [g[:2] for g in got] == [(0, 0), (1, 1)]  # distnb's rank is the rank mpiexec gave, and MPI is joined
    table = mpi.status()
    everywhere = sorted(os.sched_getaffinity(0))
    for (_, _, cpus), row in zip(got, table.rows):  # mpiexec binds nothing (--bind-to none): --cpu-bind decides
        assert binding.describe(cpus) == row["cores"] or (row["cores"] == "all" and cpus == everywhere)
    assert [(r["node_rank"], r["local_rank"]) for r in table.rows] == [(0, 0), (0, 1)]
    assert table.store.startswith("127.0.0.1:")  # one host: the rendezvous stays on loopback


def test_training_under_mpi_matches_one_process(own_shell, mpi):
    train_and_check_parity(own_shell.user_ns, mpi, "mpi")


def test_scale_says_mpiexec_cannot_resize_and_what_to_do(own_shell, mpi):
    pids = [r["pid"] for r in mpi.cluster.ranks]
    for n in (3, 1):
        err = own_shell.run_cell(f"%dist scale {n}").error_in_exec
        assert isinstance(err, UsageError), err
        text = str(err)
        assert "one mpiexec job (--launcher mpi)" in text and "size is fixed when mpiexec starts it" in text, text
        assert f"%dist restart -n {n}" in text and "%dist save" in text, text
    assert [r["pid"] for r in mpi.cluster.ranks] == pids and mpi.run("world_size", all_output=True) == ["2", "2"]


def test_killed_mpi_engine_is_reported_and_restart_recovers(mpi):
    os.kill(mpi.cluster.ranks[1]["pid"], signal.SIGKILL)
    with pytest.raises(RankError) as info:
        mpi.run("import torch, torch.distributed as dist\n_t = torch.ones(1)\ndist.all_reduce(_t)")
    assert info.value.rank == 1 and "died" in str(info.value)
    fresh = mpi.restart(quiet=True)
    fresh.run("import torch, torch.distributed as dist\n_t = torch.ones(1) * (rank + 1)\ndist.all_reduce(_t)")
    assert [t.item() for t in fresh.pull("_t")] == [3.0, 3.0]
