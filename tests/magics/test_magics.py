"""The magics through a real IPython shell against the real 2-rank cluster (session fixture)."""

import psutil
import pytest
import torch

from distnb import session as session_mod
from distnb.core.errors import PlanError, RankError
from support.cells import interrupted


def run(shell, code):
    """Run a cell; return the ExecutionResult (its error_in_exec is what the user would see)."""
    return shell.run_cell(code, silent=False)


def test_restart_keeps_the_running_cluster(shell, capsys):
    before = session_mod.current()
    generation = before.status()[0]["generation"]
    run(shell, "%dist start")
    assert "already running" in capsys.readouterr().out
    assert session_mod.current() is before
    assert before.status()[0]["generation"] == generation  # no second process group


def test_status_shows_live_ranks(shell):
    table = run(shell, "%dist status").result
    assert [r["rank"] for r in table] == [0, 1]
    assert len({r["engine_id"] for r in table}) == 2
    for r in table:
        assert r["alive"] and r["backend"] == "gloo" and r["device"] == "cpu" and psutil.pid_exists(r["pid"])
        assert r["threads"] == max(1, len(psutil.Process().cpu_affinity()) // 2)
    assert "rank" in repr(table) and "<table" in table._repr_html_()


def test_ranks_have_the_torchrun_environment(shell, capsys):
    run(shell, "%%dist --all-output\nimport os\nprint(sorted((k, os.environ[k]) for k in "
               "('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR')), os.environ['MASTER_PORT'].isdigit())")
    out = capsys.readouterr().out
    assert "[rank 0] [('LOCAL_RANK', '0'), ('MASTER_ADDR', '127.0.0.1'), ('RANK', '0'), ('WORLD_SIZE', '2')] True" in out
    assert "[rank 1] [('LOCAL_RANK', '1'), ('MASTER_ADDR', '127.0.0.1'), ('RANK', '1'), ('WORLD_SIZE', '2')] True" in out


def test_dist_cell_output_tagged_by_rank(shell, capsys):
    run(shell, "%%dist\nprint('hello', rank, world_size, device)")
    out = capsys.readouterr().out
    assert "[rank 0] hello 0 2 cpu" in out and "[rank 1]" not in out
    run(shell, "%%dist --all-output\nprint('hi', rank)\nrank * 10")
    out = capsys.readouterr().out
    assert "[rank 0] hi 0" in out and "[rank 1] hi 1" in out and "[rank 1] 10" in out


def test_dist_cell_error_names_the_rank_and_cluster_survives(shell, capsys):
    res = run(shell, "%%dist\nif rank == 1:\n    raise ValueError('bad shard on purpose')\n")
    err = res.error_in_exec
    assert isinstance(err, RankError) and err.rank == 1 and err.ranks == [1]
    assert "bad shard on purpose" in str(err)
    assert any("ValueError" in line for line in err._render_traceback_())
    run(shell, "%%dist --all-output\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
               "dist.all_reduce(t)\nprint('sum', t.item())")
    assert capsys.readouterr().out.count("[ranks 0-1] sum 2.0") == 1  # printed by both ranks: shown once


def test_push_of_a_notebook_class_and_redefinition(shell, capsys):
    run(shell, "class Greeter:\n    def hello(self):\n        return 'v1'\n")
    run(shell, "%dist push Greeter")
    run(shell, "%%dist\nprint(Greeter().hello())")
    assert "[rank 0] v1" in capsys.readouterr().out
    run(shell, "class Greeter:\n    def hello(self):\n        return 'v2'\n")
    run(shell, "%dist push Greeter")
    run(shell, "%%dist\nprint(Greeter().hello())")
    assert "[rank 0] v2" in capsys.readouterr().out


def test_pull_scatter_gather(shell):
    run(shell, "import torch\nxs = torch.arange(11.).reshape(11, 1) * 3\n%dist scatter xs --seed 2")
    sizes = run(shell, "%%dist\nlen(xs)")
    assert sizes.error_in_exec is None
    shards = run(shell, "%dist pull xs").result
    assert sorted(len(s) for s in shards) == [5, 6]
    assert sorted(torch.cat(shards).flatten().tolist()) == sorted(shell.user_ns["xs"].flatten().tolist())
    one = run(shell, "%dist pull xs --rank 1").result
    assert torch.equal(one, shards[1])
    original = shell.user_ns["xs"].clone()
    back = run(shell, "%dist gather xs").result
    assert torch.equal(back, original)


def test_gather_of_shards_the_ranks_filtered_says_it_returns_them_by_rank(shell, capsys):
    run(shell, "import torch\nfx = torch.arange(10.)\n%dist scatter fx")
    run(shell, "%%dist\nfx = fx[fx > 3]")
    capsys.readouterr()
    back = run(shell, "%dist gather fx").result
    assert isinstance(back, list) and sorted(torch.cat(back).tolist()) == [4., 5., 6., 7., 8., 9.]
    assert "fx on the ranks no longer has the shards' lengths it was scattered with" in capsys.readouterr().out


@pytest.mark.parametrize("num_shards", [3, 0, -1, "2", True])
def test_a_num_shards_that_does_not_divide_the_world_is_refused_and_the_shards_stay(shell, num_shards):
    from distnb import session as session_mod

    run(shell, "import torch\nns_xs = torch.arange(8.)\n%dist scatter ns_xs")
    s = session_mod.current()
    with pytest.raises(PlanError, match=r"num_shards must divide world_size=2 .*one of 1, 2, got"):
        s.scatter("ns_xs", num_shards=num_shards, quiet=True)
    assert sorted(len(x) for x in s.pull("ns_xs")) == [4, 4]  # what the ranks held is still there


def test_a_scattered_dataset_is_a_dataset_on_each_rank_and_gathers_back_as_one(shell):
    run(shell, "import torch\nds_x = torch.arange(22.).reshape(11, 2)\nds_y = torch.arange(11)\n"
               "scat_ds = torch.utils.data.TensorDataset(ds_x, ds_y)\n"
               "class Pairs(torch.utils.data.Dataset):\n    def __len__(self): return 11\n"
               "    def __getitem__(self, i): return ds_x[i], int(ds_y[i])\n"
               "scat_pairs = Pairs()\n%dist scatter scat_ds --seed 2\n%dist scatter scat_pairs --seed 2")
    for name in ("scat_ds", "scat_pairs"):
        res = run(shell, f"%%dist\n_x, _y = {name}[0]\n_kind = (type({name}).__name__, len({name}), "
                         "_x[0].item() == 2 * _y.item())")  # row i of ds_x is (2i, 2i + 1)
        assert res.error_in_exec is None
        kinds = run(shell, "%dist pull _kind").result
        assert sorted(kinds) == [("TensorDataset", 5, True), ("TensorDataset", 6, True)]  # rows stay paired
        back = run(shell, f"%dist gather {name}").result
        assert isinstance(back, torch.utils.data.TensorDataset)
        assert torch.equal(back.tensors[0], shell.user_ns["ds_x"])
        assert torch.equal(back.tensors[1], shell.user_ns["ds_y"])
    run(shell, "%dist scatter ds_x")
    assert type(run(shell, "%dist pull ds_x --rank 0").result) is torch.Tensor  # tensors stay tensors


TRAIN_SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
g = torch.Generator().manual_seed(0)
X = torch.randn(300, 8, generator=g)
Y = (X[:, 0] + X[:, 1] > 0).long()
train_ds = torch.utils.data.TensorDataset(X, Y)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    def forward(self, x):
        return self.fc(x)
torch.manual_seed(0)
mnet = Net()
"""
BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


def test_training_weights_back_continue_and_reset(shell, dist_session):
    assert run(shell, TRAIN_SETUP).error_in_exec is None
    start = [p.detach().clone() for p in shell.user_ns["mnet"].parameters()]
    res = run(shell, f"%%distrain --model mnet --data train_ds --epochs 3 --batch-size 32 --optimizer adam "
                     f"--lr 0.01 --progress none -o r1\n{BODY}")
    assert res.error_in_exec is None, res.error_in_exec
    r1 = shell.user_ns["r1"]
    assert res.result is r1 and r1.epochs == [0, 1, 2] and len(r1.rows) == 2
    assert all(row["steps"] == 3 * 5 and row["samples_per_s"] > 0 for row in r1.rows)
    assert r1.epoch_losses[-1] < r1.epoch_losses[0]
    # weights came back into the kernel's object, equal to the ranks'
    net = shell.user_ns["mnet"]
    assert not all(torch.equal(a, b) for a, b in zip(start, net.parameters()))
    dist_session.run("import torch\n_w = torch.cat([p.detach().flatten() for p in mnet.parameters()])")
    ranks_w = dist_session.pull("_w")
    assert torch.equal(ranks_w[0], torch.cat([p.detach().flatten() for p in net.parameters()]))
    # a second cell continues where the first stopped
    run(shell, f"%%distrain --model mnet --data train_ds --epochs 2 --batch-size 32 --optimizer adam --lr 0.01 "
               f"--progress none -o r2\n{BODY}")
    assert shell.user_ns["r2"].epochs == [3, 4]
    # --reset: re-sent from the kernel, fresh optimizer, epochs from 0
    run(shell, f"%%distrain --model mnet --data train_ds --epochs 1 --batch-size 32 --reset --progress none "
               f"-o r3\n{BODY}")
    assert shell.user_ns["r3"].epochs == [0]


def test_target_loss_stops_early(shell):
    run(shell, TRAIN_SETUP.replace("mnet", "tnet"))
    run(shell, f"%%distrain --model tnet --data train_ds --epochs 50 --batch-size 16 --optimizer adam --lr 0.02 "
               f"--target-loss 0.3 --progress none -o rt\n{BODY}")
    rt = shell.user_ns["rt"]
    assert rt.stopped_early and rt.final_loss <= 0.3 and len(rt.epochs) < 50


def test_loop_mode(shell):
    run(shell, TRAIN_SETUP.replace("mnet", "lnet"))
    body = ("for epoch in ctx.epochs():\n    for x, y in ctx.loader:\n        optimizer.zero_grad()\n"
            "        loss = F.cross_entropy(model(x), y)\n        loss.backward()\n        optimizer.step()\n"
            "        ctx.report(loss)\n")
    res = run(shell, f"%%distrain --model lnet --data train_ds --epochs 2 --batch-size 50 --loop --progress none "
                     f"-o rl\n{body}")
    assert res.error_in_exec is None, res.error_in_exec
    assert shell.user_ns["rl"].epochs == [0, 1] and shell.user_ns["rl"].rows[0]["steps"] == 2 * 3


def test_redefined_function_is_used_by_the_next_training_cell(shell):
    run(shell, TRAIN_SETUP.replace("mnet", "rnet"))
    run(shell, "def lossfn(out, y):\n    return F.cross_entropy(out, y)")
    run(shell, "%%distrain --model rnet --data train_ds --progress none -o ra\nx, y = batch\n"
               "loss = lossfn(model(x), y)")
    run(shell, "def lossfn(out, y):\n    return 0 * out.sum() + 42.0")
    run(shell, "%%distrain --model rnet --data train_ds --progress none -o rb\nx, y = batch\n"
               "loss = lossfn(model(x), y)")
    assert shell.user_ns["ra"].final_loss < 5 and shell.user_ns["rb"].final_loss == pytest.approx(42.0)


def test_training_error_names_rank_and_step_then_next_cell_works(shell):
    run(shell, TRAIN_SETUP.replace("mnet", "enet"))
    res = run(shell, "%%distrain --model enet --data train_ds --epochs 2 --batch-size 32 --progress none\n"
                     "x, y = batch\nif rank == 1 and ctx.step == 2:\n    raise KeyError('broken batch')\n"
                     "loss = F.cross_entropy(model(x), y)")
    err = res.error_in_exec
    assert isinstance(err, RankError) and err.rank == 1 and "broken batch" in str(err)
    assert "step 2" in str(err)
    rendered = err._render_traceback_()
    assert sum(line.startswith("--- traceback from") for line in rendered) == 1  # rank 0 only stopped
    assert "Connection closed" not in "\n".join(rendered)
    ok = run(shell, f"%%distrain --model enet --data train_ds --epochs 1 --batch-size 32 --progress none\n{BODY}")
    assert ok.error_in_exec is None, ok.error_in_exec


@pytest.mark.parametrize("line,needle", [
    ("--model mnet --data train_ds --epochs 0", "--epochs"),
    ("--model mnet --data train_ds --epochs abc", "--epochs"),
    ("--model mnet --data train_ds --bogus 3", "--bogus"),
    ("--data train_ds", "--model"),
    ("--model nosuchnet --data train_ds", "nosuchnet"),
    ("--model mnet --data nosuchdata", "nosuchdata"),
    ("--model train_ds --data train_ds", "not a torch.nn.Module"),
    ("--model mnet --data train_ds --strategy horovod", "--strategy must be one of ddp, fsdp"),
    ("--model mnet --data train_ds --strategy pipeline --microbatches 5", "--microbatches 5 does not divide"),
    ("--model mnet --data train_ds --batch-size 1000 --drop-last", "no full batch"),
    ("--model mnet --data train_ds --optimizer nosuchopt", "nosuchopt"),
])
def test_bad_training_options_are_usage_errors(shell, line, needle):
    from IPython.core.error import UsageError

    run(shell, TRAIN_SETUP)
    res = run(shell, f"%%distrain {line}\n{BODY}")
    assert isinstance(res.error_in_exec, UsageError), res.error_in_exec
    assert needle in str(res.error_in_exec)


@pytest.mark.parametrize("body,needle", [
    ("x, y = batch\nout = model(x)", "left no `loss`"),
    ("x, y = batch\nloss = F.cross_entropy(model(x), y, reduction='none')", "scalar tensor"),
    ("x, y = batch\nloss = 3.0", "scalar tensor"),
])
def test_bad_bodies_explain_the_fix(shell, body, needle):
    run(shell, TRAIN_SETUP.replace("mnet", "bnet"))
    res = run(shell, f"%%distrain --model bnet --data train_ds --progress none\n{body}")
    assert isinstance(res.error_in_exec, RankError) and needle in str(res.error_in_exec)


@pytest.mark.parametrize("line,needle", [
    ("frobnicate", "unknown %dist verb"), ("start -n zero", "-n"), ("start --backend mpi", "--backend"),
    ("pull", "name"), ("pull nosuch", "nosuch"), ("pull xs --rank 7", "--rank"), ("push", "names"),
    ("push not_defined_here", "not_defined_here"),
])
def test_bad_dist_lines(shell, line, needle):
    res = run(shell, f"%dist {line}")
    assert res.error_in_exec is not None and needle in str(res.error_in_exec), res.error_in_exec


def test_help_has_examples(shell):
    dist_doc = shell.find_line_magic("dist").__doc__
    train_doc = shell.find_cell_magic("distrain").__doc__
    assert "Example" in dist_doc and "%dist start -n 2" in dist_doc
    for verb in ("start", "stop", "restart", "status", "push", "pull", "scatter", "gather", "--all-output"):
        assert verb in dist_doc
    assert "Example" in train_doc and "--batch-size" in train_doc and "loss = F.cross_entropy" in train_doc


@pytest.mark.parametrize("cell, shows", [("%%distrain --help", "the cell body is one training step"),
                                         ("%%distrain --model net -h\n\n", "the cell body is one training step"),
                                         ("%%dist --help", "%%dist --unchecked for a loop")])
def test_help_in_a_cell_with_no_body_prints_the_help(shell, capsys, cell, shows):
    """IPython refuses an empty cell magic before the magic sees --help; distnb's input transformer turns it
    into the line magic, which prints the help."""
    capsys.readouterr()
    res = run(shell, cell)
    assert res.error_before_exec is None and res.error_in_exec is None
    assert shows in capsys.readouterr().out


def test_restart_gives_a_fresh_world(shell, capsys):
    old = session_mod.current()
    old_pids = old.cluster.pids["engines"] + [old.cluster.pids["controller"]]
    assert run(shell, "%dist restart").error_in_exec is None
    new = session_mod.current()
    assert new is not old and new.world_size == 2
    assert set(new.cluster.pids["engines"]).isdisjoint(old_pids)
    gone = [p for p in old_pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert gone == []
    capsys.readouterr()
    run(shell, "%%dist --all-output\nimport torch, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\n"
               "dist.all_reduce(t)\nprint('sum', t.item())")
    assert capsys.readouterr().out.count("[ranks 0-1] sum 3.0") == 1  # printed by both ranks: shown once


def test_body_that_bypasses_the_ddp_wrapper_is_an_error(shell):
    run(shell, TRAIN_SETUP.replace("mnet", "bypass"))
    res = run(shell, "%%distrain --model bypass --data train_ds --progress none\nx, y = batch\n"
                     "loss = F.cross_entropy(bypass(x), y)")
    assert isinstance(res.error_in_exec, RankError)
    assert "never called `model`" in str(res.error_in_exec) and "model(x)" in str(res.error_in_exec)


def test_the_live_optimizer_and_lr_are_kept_unless_asked(shell, dist_session, capsys):
    run(shell, TRAIN_SETUP.replace("mnet", "onet"))
    query = "import distnb.engine.train.loop as L\n_o = L.RUNS['onet'].optimizer\n(type(_o).__name__, _o.param_groups[0]['lr'])"
    run(shell, f"%%distrain --model onet --data train_ds --optimizer adam --lr 0.003 --progress none\n{BODY}")
    assert dist_session.run(query)[0] == "('Adam', 0.003)"
    run(shell, f"%%distrain --model onet --data train_ds --progress none\n{BODY}")
    assert dist_session.run(query)[0] == "('Adam', 0.003)"  # no --optimizer/--lr: continue as is
    capsys.readouterr()
    run(shell, f"%%distrain --model onet --data train_ds --lr 0.001 --progress none\n{BODY}")
    assert dist_session.run(query)[0] == "('Adam', 0.001)" and "lr set to 0.001" in capsys.readouterr().out
    run(shell, "def make_opt(params):\n    return torch.optim.SGD(params, lr=0.05, momentum=0.9)")
    run(shell, f"%%distrain --model onet --data train_ds --optimizer make_opt --lr 0.3 --progress none\n{BODY}")
    assert dist_session.run(query)[0] == "('SGD', 0.3)"
    assert "new make_opt optimizer (was adam)" in capsys.readouterr().out


def test_non_finite_loss_stops_before_the_update(shell):
    run(shell, TRAIN_SETUP.replace("mnet", "nnet"))
    before = [p.detach().clone() for p in shell.user_ns["nnet"].parameters()]
    res = run(shell, "%%distrain --model nnet --data train_ds --progress none\nx, y = batch\n"
                     "loss = F.cross_entropy(model(x), y) * (float('nan') if ctx.step == 1 else 1.0)")
    err = res.error_in_exec
    assert isinstance(err, RankError) and "FloatingPointError" in str(err) and "--nan skip" in str(err)
    assert "step 1" in str(err)
    after = list(shell.user_ns["nnet"].parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert not all(torch.equal(a, b) for a, b in zip(before, after))  # step 0 was kept


def test_loop_body_that_runs_no_step_is_an_error(shell):
    run(shell, TRAIN_SETUP.replace("mnet", "lnet2"))
    res = run(shell, "%%distrain --model lnet2 --data train_ds --loop --progress none\npass")
    assert isinstance(res.error_in_exec, RankError) and "ran no step" in str(res.error_in_exec)


def test_unused_parameters_need_the_option(shell):
    run(shell, TRAIN_SETUP.replace("mnet", "unet") + "unet.extra = nn.Linear(3, 3)\n")
    res = run(shell, f"%%distrain --model unet --data train_ds --progress none\n{BODY}")
    assert isinstance(res.error_in_exec, RankError) and "--find-unused-parameters" in str(res.error_in_exec)
    run(shell, TRAIN_SETUP.replace("mnet", "unet") + "unet.extra = nn.Linear(3, 3)\n")
    ok = run(shell, f"%%distrain --model unet --data train_ds --find-unused-parameters --progress none\n{BODY}")
    assert ok.error_in_exec is None, ok.error_in_exec


def test_pull_of_a_notebook_class_instance(shell):
    run(shell, TRAIN_SETUP.replace("mnet", "pnet"))
    run(shell, f"%%distrain --model pnet --data train_ds --progress none\n{BODY}")
    pulled = run(shell, "%dist pull pnet --rank 0").result
    assert type(pulled).__name__ == "Net"
    assert all(torch.equal(a, b) for a, b in zip(pulled.parameters(), shell.user_ns["pnet"].parameters()))


def test_interrupt_stops_every_rank_after_the_same_step(shell, dist_session):
    import os
    import signal
    import threading
    import time

    run(shell, TRAIN_SETUP.replace("mnet", "inet"))
    timer = threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:  # the interrupted cell raises, with the TrainResult of what was trained, marked interrupted
        result = interrupted(dist_session.train, BODY, model="inet", data="train_ds", epochs=10_000, batch_size=4,
                             progress="none", quiet=True).result
    finally:
        timer.cancel()
    import re

    assert result.interrupted and result.stop_reason == "interrupted" and not result.converged
    assert re.search(r"every rank stopped after the same step \(every rank: (epoch \d+, step \d+|after epoch \d+)\)",
                     result.interrupted_message), result.interrupted_message  # one position: the same on each
    assert result.rows[0]["steps"] == result.rows[1]["steps"] > 0 and "interrupted" in result.title
    from distnb.engine.train.stepping import HISTORY_POINTS as cap

    steps, history = result.rows[0]["steps"], result.loss_history[0]  # every step's loss, or (past 2 * cap
    assert (len(history) == steps if steps <= 2 * cap else cap <= len(history) <= 2 * cap)  # points) pairs averaged
    assert result.mean_loss_history
    assert time.monotonic() - t0 < 3.0 + 5.0  # every rank stopped within 5 s of the interrupt
    # identical replicas (no step half-applied), the kernel holds them, the group is still usable
    dist_session.run("import torch\n_w = torch.cat([p.detach().flatten() for p in inet.parameters()])")
    w = dist_session.pull("_w")
    assert torch.equal(w[0], w[1])
    assert torch.equal(w[0], torch.cat([p.detach().flatten() for p in shell.user_ns["inet"].parameters()]))
    ok = dist_session.train(BODY, model="inet", data="train_ds", epochs=1, progress="none", quiet=True)
    assert ok.rows[0]["steps"] > 0


def test_an_interrupted_cell_binds_its_result_and_ends_as_interrupted(shell, dist_session):
    """The interrupted cell ended as a success, so Jupyter ran the cells queued after it (Run All) and a script's
    Ctrl-C only skipped to its next statement; -o still gets what was trained."""
    import os
    import signal
    import threading

    from distnb.core.errors import Interrupted

    run(shell, TRAIN_SETUP.replace("mnet", "onet"))
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        res = run(shell, "%%distrain --model onet --data train_ds --epochs 10000 --batch-size 4 --progress none "
                         f"-o onet_res\n{BODY}")
    finally:
        timer.cancel()
    assert isinstance(res.error_in_exec, Interrupted), res.error_in_exec  # an error: the queue stops here
    assert "every rank stopped after the same step" in str(res.error_in_exec)
    bound = shell.user_ns["onet_res"]
    assert bound is res.error_in_exec.result and bound.interrupted and bound.rows[0]["steps"] > 0


def test_a_cell_that_finished_no_epoch_reports_the_mean_loss_of_its_steps_not_nan(shell, dist_session):
    """Interrupted in its first epoch (rank 0's own SIGINT, as the kernel sends it), and a --loop body that never
    iterates ctx.epochs(): final_loss was NaN although every step reported a loss."""
    import math

    run(shell, TRAIN_SETUP.replace("mnet", "fnet"))
    body = ("import os, signal, time\ntime.sleep(0.02)\nif ctx.rank == 0 and ctx.step == 2:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n" + BODY)
    result = dist_session.train(body, model="fnet", data="train_ds", epochs=3, batch_size=4, progress="none",
                                quiet=True)  # the rank's own SIGINT, not the kernel's: the cell returns
    steps = result.rows[0]["steps"]
    assert result.interrupted and result.epoch_losses == [] and 2 < steps < result.rows[0]["steps_per_epoch"]
    points = [loss for history in result.loss_history.values() for _, loss in history]
    assert len(points) == 2 * steps and result.final_loss_of == "steps"
    assert result.final_loss == pytest.approx(math.fsum(points) / len(points), rel=1e-9)
    assert all(row["final_loss_steps"] == steps and math.isfinite(row["final_loss"]) for row in result.rows)
    assert f"no epoch finished, mean loss of its {steps} steps {result.final_loss:.4f}" in result.title
    loop = ("for batch in ctx.loader:\n    x, y = batch\n    loss = F.cross_entropy(model(x), y)\n"
            "    optimizer.zero_grad()\n    loss.backward()\n    optimizer.step()\n    ctx.report(loss)")
    result = dist_session.train(loop, model="fnet", data="train_ds", loop=True, batch_size=32, progress="none",
                                quiet=True)
    points = [loss for history in result.loss_history.values() for _, loss in history]
    assert result.epoch_losses == [] and result.final_loss_of == "steps" and "nan" not in result.title
    assert result.final_loss == pytest.approx(math.fsum(points) / len(points), rel=1e-9)


def test_the_interrupt_pressed_twice_stops_the_ranks_where_they_are_in_one_message(shell, dist_session, capsys):
    """The second press lands while the ranks are still in a step that ends long after it: they are stopped where they
    are once execute.AGAIN_GRACE has passed (a step that ends sooner is waited for, test_interrupt_presses.py), and
    the cell ends with distnb's one line, not the kernel-side KeyboardInterrupt tracebacks of the stop itself."""
    import os
    import signal
    import threading
    import time

    from distnb.core.errors import Interrupted

    run(shell, TRAIN_SETUP.replace("mnet", "i2net"))
    slow = "import time\ntime.sleep(4.0)\n" + BODY  # the first press waits for a step that takes 4 s
    timers = [threading.Timer(t, lambda: os.kill(os.getpid(), signal.SIGINT)) for t in (2.0, 2.3)]
    for timer in timers:
        timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupted, match=r"ranks stopped where they were \(the interrupt was pressed again\).*"
                                              r"the next cell sends i2net to every rank again"):
            dist_session.train(slow, model="i2net", data="train_ds", epochs=100, batch_size=4, progress="none",
                               quiet=True)
    finally:
        for timer in timers:
            timer.cancel()
    assert time.monotonic() - t0 < 2.3 + 5.0
    ok = dist_session.train(BODY, model="i2net", data="train_ds", epochs=1, progress="none")
    assert ok.rows[0]["steps"] > 0  # the cluster is usable by the next cell
    # the ranks may have stopped a step apart: the next cell sent rank 0's weights to every rank, in step again
    assert "sent i2net" in capsys.readouterr().out
    dist_session.run("import torch\n_w = torch.cat([p.detach().flatten() for p in i2net.parameters()])")
    w = dist_session.pull("_w")
    assert torch.equal(w[0], w[1])


def test_the_interrupt_pressed_again_while_distnb_signals_the_ranks_is_distnbs_message(shell, dist_session):
    """A double press 0.1 s apart landed while the kernel was still sending the ranks their interrupt (in zmq's send,
    or a thread's is_alive): the cell ended with a bare KeyboardInterrupt and those library frames. Here the
    second press comes right after the first signal is sent, every time."""
    import os
    import signal
    import threading

    from distnb.core.errors import Interrupted

    run(shell, TRAIN_SETUP.replace("mnet", "i3net"))
    cluster = dist_session.cluster
    send, sent = cluster.signal, []

    def signal_then_pressed_again(sig, ranks):
        send(sig, ranks)
        if not sent:
            sent.append(ranks)
            os.kill(os.getpid(), signal.SIGINT)  # the button, again, while distnb is still stopping the ranks

    cluster.signal = signal_then_pressed_again
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(Interrupted, match="training interrupted"):
            dist_session.train(BODY, model="i3net", data="train_ds", epochs=10_000, batch_size=4, progress="none",
                               quiet=True)
    finally:
        timer.cancel()
        del cluster.signal
    assert sent
    assert dist_session.train(BODY, model="i3net", data="train_ds", epochs=1, progress="none",
                              quiet=True).rows[0]["steps"] > 0


def test_a_stop_after_an_epochs_last_step_continues_with_the_next_epoch(shell, dist_session):
    """Interrupted after the last batch of an epoch but before its end: the next cell trains the next epoch.

    (It used to "continue" the finished epoch: 0 steps for ``--epochs 1``; seen when an interrupt landed there.)
    """
    run(shell, TRAIN_SETUP.replace("mnet", "lnet"))
    first = dist_session.train(BODY, model="lnet", data="train_ds", epochs=1, progress="none", quiet=True)
    steps = first.rows[0]["steps"]
    # the state an interrupt leaves after the epoch's last step: epoch 0 with every sample trained
    dist_session.run("from distnb.engine.train.loop import RUNS\n_r = RUNS['lnet']\n_r.epoch -= 1\n"
                     f"_r.epoch_step = {steps}\n_r.epoch_samples = 10**9")
    nxt = dist_session.train(BODY, model="lnet", data="train_ds", epochs=1, progress="none", quiet=True)
    assert nxt.rows[0]["steps"] == steps  # a whole epoch, not the empty rest of the finished one
    assert not nxt.rows[0].get("continued")


def test_a_stop_asked_for_at_an_epochs_last_step_lands_after_its_end_and_says_so(shell, dist_session):
    """The summary said "epoch 1, step 8" of an epoch of 8 steps: the stop landed between its last step and its end.

    A step body's stop now lands at the end (the epoch's mean recorded, "after epoch 1"); a --loop body's, which
    distnb cannot end for it there, is named "after the last step of epoch 1". Stop checks at every step (the
    check interval 0) and rank 0's own SIGINT one step before the last make the landing exact.
    """
    from distnb.execute.execute import position

    run(shell, TRAIN_SETUP.replace("mnet", "enet"))
    ask = ("import os, signal\nif ctx.epoch == 1 and ctx.rank == 0 and ctx.epoch_done == ctx.epoch_batches - 2:\n"
           "    os.kill(os.getpid(), signal.SIGINT)\n")
    dist_session.run("import distnb.engine.train.context as _ctx_mod\n_ctx_mod.STOP_CHECK_SECONDS = 0.0")
    try:
        result = dist_session.train(ask + BODY, model="enet", data="train_ds", epochs=3, batch_size=32,
                                    progress="none", quiet=True)
        loop = ("for epoch in ctx.epochs():\n    for batch in ctx.loader:\n" +
                "".join(f"        {line}\n" for line in (ask + BODY).splitlines()) +
                "        optimizer.zero_grad()\n        loss.backward()\n        optimizer.step()\n"
                "        ctx.report(loss)")
        looped = dist_session.train(loop, model="enet", data="train_ds", loop=True, epochs=3, batch_size=32,
                                    reset=True, progress="none", quiet=True)
    finally:
        dist_session.run("import distnb.engine.train.context as _ctx_mod\n_ctx_mod.STOP_CHECK_SECONDS = 0.1")
    steps = result.rows[0]["steps_per_epoch"]
    assert result.interrupted and result.epochs == [0, 1] and len(result.epoch_losses) == 2
    assert [row["where"] for row in result.rows] == [dict(epoch=2, step=0)] * 2 and result.rows[0]["steps"] == 2 * steps
    assert position(result.rows[0]["where"]) == "after epoch 1"
    assert looped.interrupted and looped.epochs == [0] and looped.rows[0]["steps"] == 2 * steps
    assert [row["where"] for row in looped.rows] == [dict(epoch=1, step=steps, last_step=True)] * 2
    assert position(looped.rows[0]["where"]) == "after the last step of epoch 1 (the next cell starts epoch 2)"
    nxt = dist_session.train(BODY, model="enet", data="train_ds", epochs=1, batch_size=32, progress="none", quiet=True)
    assert nxt.epochs == [2] and nxt.rows[0]["steps"] == steps  # the position was true: epoch 1 is done


def test_a_position_partway_through_one_data_set_does_not_carry_to_another(shell, dist_session):
    """Stopped partway through an epoch of ``train_ds``, then trained on other data: that epoch starts at its beginning."""
    import torch as _torch

    run(shell, TRAIN_SETUP.replace("mnet", "pnet"))
    first = dist_session.train(BODY, model="pnet", data="train_ds", epochs=1, progress="none", quiet=True)
    steps = first.rows[0]["steps"]
    # the state an interrupt leaves partway through an epoch: epoch 1 with 2 steps of it trained
    dist_session.run(f"from distnb.engine.train.loop import RUNS\n_r = RUNS['pnet']\n_r.epoch_step = 2\n"
                     f"_r.epoch_samples = 2 * 8")
    x, y = shell.user_ns["train_ds"].tensors
    shell.user_ns["other_ds"] = _torch.utils.data.TensorDataset(x[:40].clone(), y[:40].clone())
    nxt = dist_session.train(BODY, model="pnet", data="other_ds", epochs=1, batch_size=8, progress="none", quiet=True)
    assert not nxt.rows[0].get("continued") and nxt.rows[0]["steps"] == -(-40 // 2 // 8)  # a whole epoch of other_ds
    assert "starts again at the beginning of other_ds" in nxt.rows[0]["note"]
    assert steps > 2


@pytest.mark.parametrize("progress", ["text", "none"])
def test_each_note_on_how_a_cell_starts_is_its_own_line(shell, dist_session, capsys, progress):
    """A cell after an interrupt partway through an epoch, with a new --lr and other data, said
    "lr set to 0.1 epoch 1 had stopped partway through other data ...": two notes run together."""
    import torch as _torch

    name = f"notes_{progress}"
    run(shell, TRAIN_SETUP.replace("mnet", name))
    dist_session.train(BODY, model=name, data="train_ds", epochs=1, optimizer="sgd", lr=0.05, progress="none",
                       quiet=True)
    # the state an interrupt leaves partway through an epoch: epoch 1 with 2 steps of it trained
    dist_session.run(f"from distnb.engine.train.loop import RUNS\n_r = RUNS[{name!r}]\n_r.epoch_step = 2\n"
                     "_r.epoch_samples = 2 * 8")
    x, y = shell.user_ns["train_ds"].tensors
    shell.user_ns["notes_ds"] = _torch.utils.data.TensorDataset(x[:40].clone(), y[:40].clone())
    capsys.readouterr()
    dist_session.train(BODY, model=name, data="notes_ds", epochs=1, batch_size=8, lr=0.1, progress=progress)
    lines = capsys.readouterr().out.splitlines()
    assert "distnb: lr set to 0.1" in lines, lines
    assert any(line.startswith("distnb: epoch 1 had stopped partway through other data (train_ds); it starts again "
                               "at the beginning of notes_ds") for line in lines), lines


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_ranks_stopped_where_they_were_never_claim_weights_the_notebook_lacks(shell, dist_session, strategy):
    """Steps trained, then both presses land in a slow step: the ranks are stopped where they were. The message says
    "now the notebook's" only when the notebook's model did get the trained weights; otherwise (fsdp's shards need the
    process group the stop broke) it says they could not come back and that the cell's steps are lost. A fresh user
    found 54 fsdp steps lost under "now the notebook's"."""
    import os
    import signal
    import threading

    from distnb.core.errors import Interrupted

    name = f"where_{strategy}"
    run(shell, TRAIN_SETUP.replace("mnet", name))
    before = torch.cat([p.detach().flatten().clone() for p in shell.user_ns[name].parameters()])
    slow = "import time\nif ctx.step >= 3:\n    time.sleep(4.0)\n" + BODY  # 3 quick steps, then a slow one
    timers = [threading.Timer(t, lambda: os.kill(os.getpid(), signal.SIGINT)) for t in (2.5, 2.8)]
    for timer in timers:
        timer.start()
    try:
        with pytest.raises(Interrupted) as caught:
            dist_session.train(slow, model=name, data="train_ds", epochs=100, batch_size=4, strategy=strategy,
                               optimizer="sgd", lr=0.5, progress="none", quiet=True)
    finally:
        for timer in timers:
            timer.cancel()
    said = str(caught.value)
    after = torch.cat([p.detach().flatten() for p in shell.user_ns[name].parameters()])
    if "now the notebook's" in said:
        assert not torch.equal(before, after), said  # the trained steps are in the notebook's model
    else:
        assert "could not be brought back" in said and "steps are lost" in said, said
        assert torch.equal(before, after), said
    ok = dist_session.train(BODY, model=name, data="train_ds", epochs=1, strategy=strategy, progress="none")
    assert ok.rows[0]["steps"] > 0  # the cluster is usable by the next cell
