"""``%dist debug`` and ``Session.debug`` (issue 16, item 3) on the shared real 2-rank cluster.

Real pdb on the ranks' kept tracebacks, with the commands given as a list (the Python API and
``-c``); the notebook's input box (the kernel's stdin channel) is tests/jupyter/test_debug_kernel.py.
A failing rank keeps its frames, and its peers blocked in a collective still fail within seconds.
"""

import time

import pytest
from support.cells import failing_cell
from IPython.core.error import UsageError

from distnb import session as session_mod
from distnb.core.errors import BusyError, PlanError, RankError

pytestmark = pytest.mark.timeout(240)

FAILING = failing_cell("dbg_y")

SETUP = """
import time
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
dbgX = torch.randn(128, 8)
dbg_train = torch.utils.data.TensorDataset(dbgX, (dbgX.sum(1) > 0).long())
dbg_net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
"""


def run(shell, code):
    return shell.run_cell(code, silent=False)


def _fail(shell):
    t0 = time.monotonic()
    err = run(shell, FAILING).error_in_exec
    seconds = time.monotonic() - t0
    assert isinstance(err, RankError) and err.rank == 1 and "bad batch on rank 1" in str(err), err
    assert seconds < 15, f"rank 0 waited {seconds:.1f} s in its all_reduce for the rank that failed"
    return err


def test_without_a_failure_debug_is_a_usage_error_saying_what_to_do(shell):
    assert run(shell, "%%dist\nok = 1").error_in_exec is None  # a cell ran: no rank keeps a traceback
    session_mod.current().last_error = None
    err = run(shell, "%dist debug").error_in_exec
    assert isinstance(err, UsageError) and "no rank has failed" in str(err) and "run the failing cell" in str(err)


def test_the_api_debugs_the_root_cause_rank_with_its_locals_and_tensors(shell, capsys):
    _fail(shell)
    capsys.readouterr()
    s = session_mod.current()
    text = s.debug(commands=["p x.shape", "p x", "pp locals()", "up", "l", "p dbg_y", "where"])
    assert text == capsys.readouterr().out  # printed as it went, and returned
    assert "post-mortem pdb on rank 1" in text and "ValueError: bad batch on rank 1" in text
    assert "step()" in text and 'raise ValueError(f"bad batch on rank {rank}")' in text
    assert "(Pdb) p x.shape\ntorch.Size([2, 3])" in text
    assert "tensor([[ 0.,  2.,  4.],\n        [ 6.,  8., 10.]])" in text
    assert "'scale': 2.0" in text
    assert "->\tdbg_y = step(2.0)" in text  # `up`, then `l`: the cell's lines
    assert "NameError: name 'dbg_y' is not defined" in text  # never bound: the cell failed in step()
    assert text.rstrip().endswith("frames were released")  # the list ran out: q
    err = run(shell, "%dist debug").error_in_exec  # released: a usage error naming the rank and the fix
    assert isinstance(err, UsageError) and "rank 1 keeps no traceback" in str(err)
    assert "ranks [0] keep theirs: %dist debug --rank 0" in str(err)
    capsys.readouterr()
    assert run(shell, '%dist debug --rank 0 -c "where" -c "p rank"').error_in_exec is None
    out = capsys.readouterr().out
    assert "post-mortem pdb on rank 0" in out and "all_reduce" in out and "(Pdb) p rank\n0\n" in out
    assert run(shell, "%%dist --all-output\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())"
               ).error_in_exec is None
    assert "sum 2.0" in capsys.readouterr().out


def test_the_next_cell_releases_the_frames(shell):
    _fail(shell)
    assert run(shell, "%%dist\nz = 1").error_in_exec is None
    for line in ("%dist debug", "%dist debug --rank 0"):
        err = run(shell, line).error_in_exec
        assert isinstance(err, UsageError) and "keeps no traceback" in str(err), (line, err)
        assert "run the failing cell again" in str(err)


def test_a_rank_out_of_range_or_bad_commands_are_errors(shell):
    _fail(shell)
    s = session_mod.current()
    with pytest.raises(PlanError, match="--rank must be between 0 and 1"):
        s.debug(rank=5)
    with pytest.raises(PlanError, match="list of pdb command strings"):
        s.debug(commands="p x")
    assert "step()" in s.debug(rank=1, commands=["q"])


def test_a_training_failure_keeps_the_batch_the_model_and_the_next_training_cell_works(shell, capsys):
    assert run(shell, SETUP).error_in_exec is None
    body = ("%%distrain --model dbg_net --data dbg_train --epochs 1 --batch-size 16\n"
            "x, y = batch\nout = model(x)\n"
            "if ctx.rank == 1 and ctx.step == 2:\n    raise RuntimeError('diverged at step 2')\n"
            "loss = F.cross_entropy(out, y)")
    t0 = time.monotonic()
    err = run(shell, body).error_in_exec
    assert isinstance(err, RankError) and err.rank == 1 and "diverged" in str(err), err
    assert time.monotonic() - t0 < 20
    capsys.readouterr()
    text = session_mod.current().debug(commands=[
        "p x.shape", "p out.shape", "p type(model).__name__", "p model.module[0].weight.shape", "p ctx.step", "q"])
    assert "RuntimeError: diverged at step 2" in text
    assert "(Pdb) p x.shape\ntorch.Size([16, 8])" in text and "(Pdb) p out.shape\ntorch.Size([16, 2])" in text
    assert "(Pdb) p type(model).__name__\n'DistributedDataParallel'" in text
    assert "(Pdb) p model.module[0].weight.shape\ntorch.Size([16, 8])" in text and "(Pdb) p ctx.step\n2\n" in text
    # rank 0 (stopped in DDP's all-reduce) still keeps its frames: the next training cell releases them
    res = run(shell, body.replace("if ctx.rank == 1 and ctx.step == 2", "if False"))
    assert res.error_in_exec is None, res.error_in_exec
    assert [row["steps"] for row in res.result.rows] == [2, 2]  # the rest of the epoch, with a new DDP wrapper


def test_a_rank_stopped_in_ddps_backward_is_debugged_from_the_frame_that_ran_its_step(shell):
    """Rank 0 fails in the gradient all-reduce of the backward distnb runs after the body returned (rank 1 raised):
    no frame of the cell's code is left, so pdb starts at the frame that ran it, with the cell's names, not in
    torch's autograd frames."""
    assert run(shell, SETUP).error_in_exec is None
    body = ("%%distrain --model dbg_net --data dbg_train --epochs 1 --batch-size 16\n"
            "x, y = batch\nout = model(x)\n"
            "if ctx.rank == 1 and ctx.step == 2:\n    raise RuntimeError('diverged at step 2')\n"
            "loss = F.cross_entropy(out, y)")
    err = run(shell, body).error_in_exec
    assert isinstance(err, RankError) and err.rank == 1 and 0 in err.ranks, err
    text = session_mod.current().debug(rank=0, commands=["p x.shape", "p out.shape", "down", "up", "p x.shape", "q"])
    start = text.split("(Pdb)")[0]
    assert "your cell's code had returned: this rank stopped in what distnb runs after it" in start, text
    assert "-> ctx.backward(loss)" in start and "autograd" not in start, text
    assert text.count("(Pdb) p x.shape\ntorch.Size([16, 8])") == 2 and "(Pdb) p out.shape\ntorch.Size([16, 2])" in text
    res = run(shell, body.replace("if ctx.rank == 1 and ctx.step == 2", "if False"))
    assert res.error_in_exec is None, res.error_in_exec


def test_debug_during_a_background_run_is_busy(shell, capsys):
    assert run(shell, SETUP).error_in_exec is None
    run(shell, "%%distrain --model dbg_net --data dbg_train --epochs 500 --batch-size 16 --background\n"
               "x, y = batch\ntime.sleep(0.01)\nloss = F.cross_entropy(model(x), y)")
    try:
        for line in ("%dist debug", "%dist debug --rank 1"):
            err = run(shell, line).error_in_exec
            assert isinstance(err, BusyError) and "%dist stop-training" in str(err), (line, err)
    finally:
        run(shell, "%dist stop-training")
    assert session_mod.current()._background is None


def test_help_explains_the_verb_with_an_example(shell, capsys):
    for line in ("help debug", "debug --help"):
        run(shell, f"%dist {line}")
        out = capsys.readouterr().out
        assert "%dist debug [--rank RANK] [-c CMD]" in out and "Example" in out and "(Pdb) p x.shape" in out


def test_after_a_hang_debug_opens_the_rank_that_raised_not_the_one_that_never_arrived(shell):
    import contextlib
    import dataclasses

    from distnb.core.errors import HangError

    cluster = session_mod.current().cluster
    spec = cluster.spec
    cluster.spec = dataclasses.replace(spec, hang_after=2.0)
    with contextlib.ExitStack() as undo:
        undo.callback(setattr, cluster, "spec", spec)
        err = run(shell, "%%dist\nimport torch, torch.distributed as dist\nhung = torch.ones(3)\n"
                         "if rank == 1:\n    dist.all_reduce(hung)\n").error_in_exec
    assert isinstance(err, HangError) and err.rank == 0  # rank 0 never arrived: the root cause, but it raised nothing
    out = session_mod.current().debug(commands=["p rank", "p hung.shape"])
    assert "1" in out and "torch.Size([3])" in out  # rank 1's frames: it waited, and its collective failed
    with pytest.raises(PlanError, match="rank 0 keeps no traceback to debug \\(it raised nothing"):
        session_mod.current().debug(rank=0, commands=["p rank"])


def test_a_dataset_that_raises_is_debugged_in_its_own_getitem(shell):
    run(shell, "import torch\nclass DbgSet(torch.utils.data.Dataset):\n    def __len__(self):\n        return 64\n"
               "    def __getitem__(self, i):\n        scale = i * 2\n        if i == 37:\n"
               "            raise KeyError(f'sample {i} is missing')\n        return torch.ones(8) * scale, i % 2\n"
               "dbg_set = DbgSet()\ndbg_set_net = torch.nn.Linear(8, 2)")
    err = run(shell, "%%distrain --model dbg_set_net --data dbg_set --batch-size 8 --progress none\nx, y = batch\n"
                     "loss = torch.nn.functional.cross_entropy(model(x), y)").error_in_exec
    assert isinstance(err, RankError), err
    out = session_mod.current().debug(commands=["p i, scale", "q"])
    assert "at its cause in your code: KeyError" in out and "(37, 74)" in out, out


def test_breakpoint_on_a_rank_says_it_was_skipped_and_names_dist_debug(shell, capsys):
    """A rank has no terminal: ``breakpoint()`` in a cell read EOF and went on without a word (pdb's quit). It
    now says so once, where, and what works from the notebook; the cell still runs to its end."""
    capsys.readouterr()
    res = shell.run_cell("%%dist\nbreakpoint()\nafter_breakpoint = rank")
    assert res.error_in_exec is None, res.error_in_exec
    out = capsys.readouterr()
    said = "distnb: breakpoint() at cell line 1 was skipped: a rank has no terminal for pdb"
    assert (out.out + out.err).count(said) == 1 and "%dist debug" in out.out + out.err, out
    assert session_mod.current().run("after_breakpoint") == ["0", "1"]
