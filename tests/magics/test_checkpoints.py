"""Checkpoints with torch.distributed.checkpoint: save, load, resume after an engine dies.

Every check compares against an uninterrupted run: the data order is a function of the
seed, epoch and step, so a resumed run must reach the same parameters to float tolerance.
"""

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb import session
from support.data import blobs, mlp

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


def make_data():
    return blobs(96, num_features=10, num_classes=2, num_summed=3)


def make_model():
    return mlp(10, 12, 2, seed=3)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(s, name, epochs, **kw):
    kw.setdefault("optimizer", None)
    return s.train(BODY, model=name, data="ck_data", epochs=epochs, batch_size=8, seed=5, progress="none",
                   quiet=True, **kw)


def uninterrupted(s, ns, epochs):
    ns["ck_ref"] = make_model()
    train(s, "ck_ref", epochs, optimizer="adam", lr=0.01)
    return params(ns["ck_ref"])


def test_save_load_restores_model_optimizer_and_position(dist_session, shell, tmp_path):
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    want = uninterrupted(dist_session, ns, 3)

    ns["ck_net"] = make_model()
    train(dist_session, "ck_net", 1, optimizer="adam", lr=0.01)
    shell.run_line_magic("dist", f"save {tmp_path / 'ck'} --model ck_net")
    saved = params(ns["ck_net"]).clone()
    meta = json.loads(next((tmp_path / "ck").glob("step_*/distnb.json")).read_text())
    assert meta["epoch"] == 1 and meta["epoch_step"] == 0 and meta["steps"] == 6  # 96 / 2 ranks / 8
    assert meta["plan"]["strategy"] == "ddp" and meta["optimizer"] == "adam"

    train(dist_session, "ck_net", 1, lr=0.5)  # wander off: a different rate, more steps
    assert not torch.allclose(params(ns["ck_net"]), saved)

    shell.run_line_magic("dist", f"load {tmp_path / 'ck'} --model ck_net")
    torch.testing.assert_close(params(ns["ck_net"]), saved)  # the kernel's model is restored too
    dist_session.run("import torch\n_ck = torch.cat([p.detach().flatten() for p in ck_net.parameters()])")
    for flat in dist_session.pull("_ck"):
        torch.testing.assert_close(flat, saved)

    result = train(dist_session, "ck_net", 2)  # Adam state (moments, step count) came back too
    assert result.epochs == [1, 2]
    torch.testing.assert_close(params(ns["ck_net"]), want, atol=1e-5, rtol=1e-5)


def test_checkpoint_every_n_steps_keeps_the_newest(dist_session, shell, tmp_path):
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_every"] = make_model()
    r = train(dist_session, "ck_every", 2, optimizer="sgd", lr=0.1, checkpoint_dir=str(tmp_path), checkpoint_every=4)
    assert [row["steps"] for row in r.rows] == [12, 12]
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["step_00000008", "step_00000012"]  # saved at 4, 8, 12; the two newest kept
    assert all((tmp_path / k / "distnb.json").exists() for k in kept)


def test_training_resumes_from_the_last_checkpoint_after_an_engine_dies(dist_session, shell, tmp_path):
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    want = uninterrupted(dist_session, ns, 3)

    marker = tmp_path / "killed"
    ns["ck_marker"] = str(marker)
    body = ("import os, signal\n"
            "if rank == 1 and ctx.epoch == 1 and ctx.step == 9 and not os.path.exists(ck_marker):\n"
            "    open(ck_marker, 'w').close()\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n" + BODY)
    ns["ck_resume"] = make_model()
    ckdir = str(tmp_path / "ck")
    opts = dict(model="ck_resume", data="ck_data", batch_size=8, seed=5, progress="none", quiet=True,
                checkpoint_dir=ckdir, checkpoint_every=5)
    try:
        dist_session.train(body, epochs=3, optimizer="adam", lr=0.01, **opts)
    except Exception as exc:  # the dead engine is named
        assert "rank 1" in str(exc), str(exc)
    else:
        raise AssertionError("the killed engine was not reported")
    assert marker.exists()
    # steps 1-6 were epoch 0, the kill came at the 10th step of the cell: the last checkpoint is step 5
    shell.run_line_magic("dist", "restart")
    s = session.current()
    assert s.world_size == 2
    result = s.train(body, epochs=2, **opts)  # epoch 0 step 5 of 6 was saved: finish it, then epochs 1-2
    assert result.epochs == [0, 1]
    assert result.rows[0]["steps"] == 1 + 6
    final = s.train(body, epochs=1, **opts)
    assert final.epochs == [2]
    torch.testing.assert_close(params(ns["ck_resume"]), want, atol=1e-5, rtol=1e-5)
    assert os.path.isdir(ckdir)


def test_load_after_a_restart_finds_the_checkpoints_model_or_names_the_fix(dist_session, shell, tmp_path):
    from IPython.core.error import UsageError

    from distnb.core.errors import PlanError

    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_rs"] = make_model()
    train(dist_session, "ck_rs", 1, optimizer="adam", lr=0.01, checkpoint_dir=str(tmp_path))
    saved = params(ns["ck_rs"]).clone()
    shell.run_line_magic("dist", "restart")  # no training cell on the new ranks yet
    with torch.no_grad():
        ns["ck_rs"][0].weight.zero_()
    shell.run_line_magic("dist", f"load {tmp_path}")  # no --model: the one the checkpoint was saved from
    torch.testing.assert_close(params(ns["ck_rs"]), saved)
    shell.run_line_magic("dist", "restart")
    ns["ck_other"] = ns.pop("ck_rs")
    res = shell.run_cell(f"%dist load {tmp_path}")
    assert isinstance(res.error_in_exec, UsageError)
    for why in (str(res.error_in_exec), str(pytest.raises(PlanError, session.current().load, str(tmp_path)).value)):
        assert f"ck_rs (the model the checkpoint in {tmp_path} was saved from) is not defined in the notebook: name " \
               "the notebook model to load it into with --model NAME (model=NAME in Python)" in why
    session.current().load(str(tmp_path), model="ck_other", quiet=True)
    torch.testing.assert_close(params(ns["ck_other"]), saved)


def test_load_restores_the_optimizer_of_a_cell_that_kept_it(dist_session, shell, tmp_path):
    """A checkpoint taken after a cell without --optimizer still records (and restores) Adam."""
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    want = uninterrupted(dist_session, ns, 3)
    ns["ck_keep"] = make_model()
    train(dist_session, "ck_keep", 1, optimizer="adam", lr=0.01)
    train(dist_session, "ck_keep", 1)  # keeps the live Adam: this cell's plan has no optimizer
    dist_session.save(str(tmp_path), model="ck_keep", quiet=True)
    train(dist_session, "ck_keep", 1, optimizer="sgd", lr=0.3)  # a different optimizer replaces Adam
    meta = dist_session.load(str(tmp_path), model="ck_keep", quiet=True)
    assert meta["optimizer"] == "adam" and meta["plan"]["optimizer"] == "adam"
    train(dist_session, "ck_keep", 1)  # no --optimizer: the restored Adam continues
    torch.testing.assert_close(params(ns["ck_keep"]), want, atol=1e-5, rtol=1e-5)


def test_the_chosen_optimizer_and_rate_survive_a_resend(dist_session, shell):
    """A model sent again (here: a strategy switch) gets the optimizer and lr the user chose, not SGD 0.01."""
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_opt"] = make_model()
    train(dist_session, "ck_opt", 1, optimizer="adam", lr=0.02)
    train(dist_session, "ck_opt", 1, strategy="fsdp")  # re-distributed: a new optimizer on the ranks
    dist_session.run("_opt = (type(optimizer).__name__, optimizer.param_groups[0]['lr'])")
    assert dist_session.pull("_opt", rank=0) == ("Adam", 0.02)


def test_the_optimizer_of_a_failed_cell_is_remembered(dist_session, shell):
    """A cell that fails (here its body; in use, often a dead engine) still says which optimizer the user wants."""
    from distnb.core.errors import RankError

    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_failopt"] = make_model()
    with pytest.raises(RankError):
        dist_session.train("assert ctx.step < 2\n" + BODY, model="ck_failopt", data="ck_data", epochs=1,
                           batch_size=8, seed=5, optimizer="adam", lr=0.005, progress="none", quiet=True)
    train(dist_session, "ck_failopt", 1, reset=True)  # a fresh optimizer: the one asked for, not SGD 0.01
    dist_session.run("_opt = (type(optimizer).__name__, optimizer.param_groups[0]['lr'])")
    assert dist_session.pull("_opt", rank=0) == ("Adam", 0.005)


def test_save_after_a_failed_cell(dist_session, shell, tmp_path):
    from distnb.core.errors import RankError

    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_fail"] = make_model()
    train(dist_session, "ck_fail", 1, optimizer="adam", lr=0.01)
    try:
        dist_session.train("assert ctx.step < 2\n" + BODY, model="ck_fail", data="ck_data", epochs=1, batch_size=8,
                           seed=5, progress="none", quiet=True)
    except RankError:
        pass
    meta = dist_session.save(str(tmp_path), model="ck_fail", quiet=True)
    assert meta["optimizer"] == "adam" and (tmp_path / os.path.basename(meta["path"]) / "distnb.json").exists()


def test_a_checkpoint_of_another_model_is_a_clear_error(dist_session, shell, tmp_path):
    from distnb.core.errors import RankError

    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_small"] = make_model()
    train(dist_session, "ck_small", 1, optimizer="adam", lr=0.01, checkpoint_dir=str(tmp_path))
    torch.manual_seed(0)
    ns["ck_big"] = nn.Sequential(nn.Linear(10, 40), nn.Tanh(), nn.Linear(40, 2))
    try:
        train(dist_session, "ck_big", 1, checkpoint_dir=str(tmp_path))
    except RankError as exc:
        assert "does not fit this model" in str(exc) and "--reset" in str(exc), str(exc)
    else:
        raise AssertionError("a mismatched checkpoint was loaded")
    train(dist_session, "ck_big", 1, checkpoint_dir=str(tmp_path), reset=True)  # the way out it names


def test_load_into_another_model_names_the_key_and_changes_nothing(dist_session, shell, tmp_path, capsys):
    from distnb.core.errors import RankError

    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_fsdp"] = make_model()
    train(dist_session, "ck_fsdp", 1, optimizer="adam", lr=0.01, strategy="fsdp")
    dist_session.save(str(tmp_path), model="ck_fsdp", quiet=True)
    torch.manual_seed(0)
    shell.run_cell("import torch.nn as nn\nclass Headed(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                   "        self.head = nn.Linear(10, 2)\n    def forward(self, x):\n        return self.head(x)\n"
                   "ck_other = Headed()").raise_error()  # keys the checkpoint lacks
    before = params(ns["ck_other"]).clone()
    with pytest.raises(RankError) as info:
        dist_session.load(str(tmp_path), model="ck_other", quiet=True)
    text = str(info.value)
    assert "does not fit this model" in text and "Missing key in checkpoint state_dict: model.head." in text, text
    assert "FrameSummary" not in text and ".." not in text  # it showed DCP's (exception, frames) pair
    assert torch.equal(params(ns["ck_other"]), before)
    capsys.readouterr()
    dist_session.train(BODY, model="ck_other", data="ck_data", epochs=1, batch_size=8, progress="none")
    assert "the last cell used fsdp" not in capsys.readouterr().out  # the failed load left no options behind


def _restarted(shell):
    shell.run_line_magic("dist", "restart")
    return session.current()


def test_steps_trained_without_a_checkpoint_are_never_rolled_back(dist_session, shell, tmp_path):
    """The step count goes on from the notebook's weights, so their checkpoint sorts after the older ones."""
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_later"] = make_model()
    ckdir = str(tmp_path)
    train(dist_session, "ck_later", 1, optimizer="sgd", lr=0.1, checkpoint_dir=ckdir)  # 6 steps: step_6
    train(dist_session, "ck_later", 1)  # steps 7-12, no checkpoint
    r = train(_restarted(shell), "ck_later", 1, checkpoint_dir=ckdir)  # from the notebook's newer weights
    assert r.rows[0]["resumed"] is None and r.rows[0]["global_steps"] == 18
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006", "step_00000018"]
    r = train(_restarted(shell), "ck_later", 1, checkpoint_dir=ckdir)
    assert r.rows[0]["resumed"] == os.path.join(ckdir, "step_00000018") and r.rows[0]["global_steps"] == 24


def test_a_cell_that_starts_again_numbers_its_checkpoints_after_the_folders_older_ones(dist_session, shell, tmp_path):
    """--reset into a folder of older checkpoints wrote step_6 below their step_12 (the next resume took the old
    one; pruning could remove the one just written): the count goes on from the folder's newest."""
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_again"] = make_model()
    ckdir = str(tmp_path)
    train(dist_session, "ck_again", 2, optimizer="sgd", lr=0.1, checkpoint_dir=ckdir)  # step_6, step_12
    ns["ck_again"] = make_model()  # start over: new weights
    r = train(dist_session, "ck_again", 1, optimizer="sgd", lr=0.1, checkpoint_dir=ckdir, reset=True)
    assert r.rows[0]["resumed"] is None and r.rows[0]["global_steps"] == 18
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000012", "step_00000018"]  # the newest 2 kept
    started_over = params(ns["ck_again"]).clone()
    r = train(_restarted(shell), "ck_again", 1, checkpoint_dir=ckdir)  # resumes the newest: the one written last
    assert r.rows[0]["resumed"] == os.path.join(ckdir, "step_00000018")
    assert not torch.equal(params(ns["ck_again"]), started_over)  # it trained on from there


def test_an_explicit_lr_applies_to_a_resumed_optimizer_and_schedule(dist_session, shell, tmp_path):
    """After a restart, --lr goes on top of the checkpoint's optimizer, as on the live one (here: past a
    cosine schedule that has run out, whose lr is 0)."""
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_lr"] = make_model()
    train(dist_session, "ck_lr", 1, optimizer="sgd", lr=0.1, lr_schedule="cosine", checkpoint_dir=str(tmp_path))
    before = params(ns["ck_lr"]).clone()
    r = train(_restarted(shell), "ck_lr", 1, lr=0.02, checkpoint_dir=str(tmp_path))
    assert r.rows[0]["resumed"] is not None
    assert [lr for _, lr in r.lr_history] == [0.02] * 6, r.lr_history
    assert not torch.allclose(params(ns["ck_lr"]), before)


def test_another_optimizer_on_resume_takes_the_weights_with_a_fresh_optimizer(dist_session, shell, tmp_path, capsys):
    """A checkpoint of SGD resumed with --optimizer adam: its weights and position, a fresh Adam, one line saying
    so; the same as naming Adam for the live model."""
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_ref"] = make_model()
    train(dist_session, "ck_ref", 1, optimizer="sgd", lr=0.1)
    train(dist_session, "ck_ref", 1, optimizer="adam", lr=0.02)
    ns["ck_switch"] = make_model()
    train(dist_session, "ck_switch", 1, optimizer="sgd", lr=0.1, checkpoint_dir=str(tmp_path))
    s = _restarted(shell)
    capsys.readouterr()
    r = s.train(BODY, model="ck_switch", data="ck_data", epochs=1, batch_size=8, seed=5, progress="none",
                optimizer="adam", lr=0.02, checkpoint_dir=str(tmp_path))
    out = capsys.readouterr().out
    assert "resumes from the newest checkpoint in --checkpoint-dir (step 6; the notebook's weights are at step 6) " \
           "with a fresh adam optimizer: the checkpoint's optimizer state is sgd's (--optimizer sgd resumes it too; " \
           "--reset starts from the notebook's weights)" in out, out
    assert r.rows[0]["resumed"] is not None and r.epochs == [1] and r.rows[0]["global_steps"] == 12
    s.run("_opt = (type(optimizer).__name__, optimizer.param_groups[0]['lr'])")
    assert s.pull("_opt", rank=0) == ("Adam", 0.02)
    torch.testing.assert_close(params(ns["ck_switch"]), params(ns["ck_ref"]), atol=1e-6, rtol=1e-6)


def test_a_notebook_schedule_resumes_after_a_restart_or_its_absence_is_named(dist_session, shell, tmp_path):
    """The ranks rebuild a checkpoint's schedule by name: a notebook function they never got after %dist restart
    ("--lr-schedule 'sched' is not a function on this rank"), and the next cell then trained without it, silently."""
    from distnb.core.errors import PlanError

    shell.run_cell("from torch.optim.lr_scheduler import CosineAnnealingLR\n"
                   "def ck_sched(optimizer, total_steps):\n    return CosineAnnealingLR(optimizer, T_max=3 * total_steps)")
    ns = shell.user_ns
    ns["ck_data"], ns["F"] = make_data(), F
    ns["ck_cos"], ns["ck_cos_ref"] = make_model(), make_model()
    ckdir = str(tmp_path)
    train(dist_session, "ck_cos", 1, optimizer="adam", lr=0.01, lr_schedule="ck_sched", checkpoint_dir=ckdir)
    train(dist_session, "ck_cos_ref", 1, optimizer="adam", lr=0.01, lr_schedule="ck_sched")
    going_on = train(dist_session, "ck_cos_ref", 1).lr_history  # the live schedule's next 6 steps
    sched = ns.pop("ck_sched")
    s = _restarted(shell)
    with pytest.raises(PlanError, match="goes on with --lr-schedule ck_sched, a notebook function, which the notebook "
                                        "does not define now: define it again"):
        train(s, "ck_cos", 1, checkpoint_dir=ckdir)
    ns["ck_sched"] = sched
    r = train(s, "ck_cos", 1, checkpoint_dir=ckdir)
    assert r.rows[0]["resumed"] is not None
    assert r.lr_history == going_on, (r.lr_history, going_on)
    torch.testing.assert_close(params(ns["ck_cos"]), params(ns["ck_cos_ref"]))
    s = _restarted(shell)
    del ns["ck_sched"]
    with pytest.raises(PlanError, match="goes on with --lr-schedule ck_sched"):  # %dist load: before anything is sent
        s.load(ckdir, model="ck_cos", quiet=True)
    ns["ck_sched"] = sched
    assert s.load(ckdir, model="ck_cos", quiet=True)["scheduler"]["name"] == "ck_sched"


def test_save_after_a_cell_given_the_model_object_itself(dist_session, shell, tmp_path):
    """train(code, model=<object>) binds no notebook name: save() of the last model trained said "--model
    '_distnb_model' is not defined in the notebook; define it in a cell first", a name the user never wrote."""
    from distnb.core.errors import PlanError

    shell.user_ns["ck_data"], shell.user_ns["F"] = make_data(), F
    trained = make_model()
    dist_session.train(BODY, model=trained, data="ck_data", epochs=1, batch_size=8, optimizer="adam", progress="none",
                       quiet=True)
    meta = dist_session.save(str(tmp_path), quiet=True)
    assert os.path.isdir(meta["path"])
    with pytest.raises(PlanError, match="directory must be"):
        dist_session.save(123)
    again = make_model()
    dist_session.load(str(tmp_path), model=again, quiet=True)
    torch.testing.assert_close(params(again), params(trained))
