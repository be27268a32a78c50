"""Small things a notebook user meets: cells on some ranks, a second %dist start, %unload_ext (real cluster)."""

import math
import re

import pytest
import torch
from IPython.core.error import UsageError

from distnb import session as session_mod
from distnb.core.errors import PlanError, RankError


def run(shell, code):
    return shell.run_cell(code, silent=False)


def test_a_cell_on_some_ranks_runs_there_only_and_a_collective_in_it_is_an_error_not_a_hang(shell, capsys):
    res = run(shell, "%%dist --targets 1\nwho = rank\nprint('here', rank)")
    assert res.error_in_exec is None
    out = capsys.readouterr().out
    assert "[rank 1] here 1" in out and "rank 0" not in out
    assert run(shell, "%dist pull who --rank 1").result == 1
    err = run(shell, "%%dist --ranks 0\nimport torch, torch.distributed as dist\ndist.all_reduce(torch.ones(2))"
              ).error_in_exec
    assert isinstance(err, RankError) and err.ranks == [0]
    assert "dist.all_reduce in a cell run on rank 0 only: rank 1 of its group never calls it" in str(err)
    assert isinstance(run(shell, "%%dist --targets 5\npass").error_in_exec, UsageError)
    s = session_mod.current()
    assert s.run("rank", targets=1) == [None, "1"] and s.run("rank", targets="0,1") == ["0", "1"]
    for bad, says in (((), "targets= names no rank"), ("0,x", "got '0,x'"), ([0, 5], "has 5"),
                      (1.0, "got 1.0"), ([True], "has True")):
        with pytest.raises(PlanError, match=re.escape(says)):
            s.run("rank", targets=bad)
    res = run(shell, "%%dist\nimport torch, torch.distributed as dist\n_t = torch.ones(1)\ndist.all_reduce(_t)")
    assert res.error_in_exec is None  # the group is fine afterwards


def test_a_second_start_with_other_options_says_which_differ_and_how_to_apply_them(shell, capsys):
    before = session_mod.current()
    assert run(shell, "%dist start -n 3 --timeout 30").error_in_exec is None
    out = capsys.readouterr().out
    assert "already running; keeping it and not these options, which differ from it: -n 3 (running: 2)" in out
    assert "apply them with %dist restart -n 3" in out and "--timeout" not in out
    assert session_mod.current() is before and before.world_size == 2
    run(shell, "%dist start")
    assert "(%dist restart starts a fresh one)" in capsys.readouterr().out


def test_unload_ext_unregisters_the_magics_and_load_ext_brings_them_back(shell):
    assert run(shell, "%unload_ext distnb").error_in_exec is None
    assert session_mod._CURRENT is None
    assert "dist" not in shell.magics_manager.magics["line"]
    assert "distrain" not in shell.magics_manager.magics["cell"] and "distrain" not in shell.magics_manager.magics["line"]
    assert run(shell, "%dist status").error_in_exec is not None  # an unknown magic now
    assert run(shell, "%load_ext distnb").error_in_exec is None
    assert run(shell, "%dist start -n 2 --timeout 30").error_in_exec is None
    assert session_mod.current().world_size == 2


def test_a_model_that_cannot_be_sent_names_the_attribute_and_the_fix_before_anything_is_sent(shell):
    run(shell, "import torch, torch.nn as nn, torch.nn.functional as F\n"
               "class Holder:\n    def __init__(self):\n        self.gen = (i for i in range(3))\n"
               "class HolderNet(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
               "        self.fc = nn.Linear(4, 2)\n        self.holder = Holder()\n"
               "    def forward(self, x):\n        return self.fc(x)\n"
               "unsend_net = HolderNet()\n"
               "unsend_data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))")
    err = run(shell, "%%distrain --model unsend_net --data unsend_data\nx, y = batch\n"
                     "loss = F.cross_entropy(model(x), y)").error_in_exec
    assert isinstance(err, UsageError)
    text = str(err)
    assert "cannot send 'unsend_net' (HolderNet) to the ranks as --model: unsend_net.holder.gen is a generator" in text
    assert "give Holder a __getstate__ that leaves it out" in text and "cloudpickle" not in text
    run(shell, "%%dist\nfrom distnb.engine.train import loop\n_held = 'unsend_net' in loop.RUNS")
    assert run(shell, "%dist pull _held").result == [False, False]
    run(shell, "del unsend_net.holder")
    res = run(shell, "%%distrain --model unsend_net --data unsend_data --progress none\nx, y = batch\n"
                     "loss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None


def small_net(shell, name: str, middle: str = "nn.ReLU()") -> str:
    """Define ``{name}_net`` (4 -> 8 -> 2, seeded) and ``{name}_data`` (64 samples) in the notebook; the code
    that makes the model again (a new object under the name)."""
    make = f"torch.manual_seed(0)\n{name}_net = nn.Sequential(nn.Linear(4, 8), {middle}, nn.Linear(8, 2))"
    run(shell, "import torch, torch.nn as nn, torch.nn.functional as F\n" + make + "\n"
               f"{name}_data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))")
    return make


def test_a_model_changed_in_the_notebook_or_a_strategy_switch_says_what_happens(shell, capsys):
    small_net(shell, "bn", "nn.BatchNorm1d(8)")
    cell = "%%distrain --model bn_net --data bn_data --batch-size 16 --optimizer adam{}\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    assert run(shell, cell.format("")).error_in_exec is None
    capsys.readouterr()
    run(shell, "bn_net.train()\n_ = bn_net(torch.randn(8, 4))")  # the kernel's copy moves on
    assert run(shell, cell.format("")).error_in_exec is None
    out = capsys.readouterr().out
    assert "bn_net changed in the notebook since the last cell (1 running statistics (BatchNorm run in train " \
           "mode) changed): the ranks get it again; its optimizer state and epoch count start afresh" in out
    assert run(shell, cell.format(" --strategy fsdp")).error_in_exec is None
    out = capsys.readouterr().out
    assert "--strategy fsdp (the last cell used ddp): bn_net is sent again from the notebook's weights and " \
           "distributed anew; its optimizer state and epoch count start afresh" in out  # it said "is rebuilt"
    assert "fresh adam optimizer, epoch 0" in out  # as the next line says: nothing of the old state is kept
    assert run(shell, cell.format(" --strategy fsdp")).error_in_exec is None
    assert "sent again" not in capsys.readouterr().out  # nothing changed: the ranks keep model and optimizer


def test_a_notebook_global_the_model_reads_changed_is_sent_to_the_ranks(shell, capsys):
    # the ranks got TEMP (and helper) by value with the class: they kept computing with the old ones
    run(shell, "import math, torch, torch.nn as nn, torch.nn.functional as F\nTEMP = 1.0\n"
               "def scaled(z):\n    return z / TEMP\n"
               "class Tempered(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
               "        self.fc = nn.Linear(4, 2)\n    def forward(self, x):\n        return scaled(self.fc(x))\n"
               "torch.manual_seed(0)\ntemp_net = Tempered()\n"
               "temp_data = torch.utils.data.TensorDataset(torch.randn(64, 4) * 20, torch.randint(0, 2, (64,)))")
    cell = "%%distrain --model temp_net --data temp_data --batch-size 64 --lr 1e-9 --progress none\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    first = run(shell, cell).result.final_loss
    assert abs(first - math.log(2)) > 0.05
    for change in ("TEMP = 1e6", "def scaled(z):\n    return z * 1e-6"):  # a value, then a function defined again
        run(shell, "TEMP = 1.0\n" if change.startswith("def") else "")
        run(shell, change)
        capsys.readouterr()
        result = run(shell, cell).result
        assert abs(result.final_loss - math.log(2)) < 1e-4, (change, result.final_loss)  # logits near 0: ln 2
        assert "temp_net changed in the notebook since the last cell (a notebook global, function or class attribute " \
               "its code reads " \
               "changed): the ranks get it again" in capsys.readouterr().out
        run(shell, "def scaled(z):\n    return z / TEMP\nTEMP = 1.0")
        run(shell, cell)


def test_a_method_replaced_on_the_class_is_sent_to_the_ranks_and_a_rerun_cell_is_not(shell, capsys):
    # forward replaced with code that reads the same globals: the ranks kept the old forward and said nothing
    defining = ("import math, torch, torch.nn as nn, torch.nn.functional as F\n"
                "def head(z):\n    return z\n"
                "class Swapped(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                "        self.fc = nn.Linear(4, 2)\n    def forward(self, x):\n        return head(self.fc(x))\n")
    run(shell, defining + "torch.manual_seed(0)\nswap_net = Swapped()\n"
               "swap_data = torch.utils.data.TensorDataset(torch.randn(64, 4) * 20, torch.randint(0, 2, (64,)))")
    cell = "%%distrain --model swap_net --data swap_data --batch-size 64 --lr 1e-9 --progress none\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    first = run(shell, cell).result.final_loss
    assert abs(first - math.log(2)) > 0.05
    for change in ("Swapped.forward = lambda self, x: head(self.fc(x)) * 1e-6",
                   "def forward(self, x, k=1e-6):\n    return head(self.fc(x)) * k\nSwapped.forward = forward"):
        run(shell, "Swapped.forward = lambda self, x: head(self.fc(x))")
        run(shell, cell)
        run(shell, change)
        capsys.readouterr()
        result = run(shell, cell).result
        assert abs(result.final_loss - math.log(2)) < 1e-4, (change, result.final_loss)  # logits near 0: ln 2
        assert "swap_net changed in the notebook since the last cell (the code of Swapped.forward changed" \
            in capsys.readouterr().out
    run(shell, "forward.__defaults__ = (1.0,)")  # a default of the method the class holds
    capsys.readouterr()
    assert abs(run(shell, cell).result.final_loss - first) < 1e-3
    assert "the code of Swapped.forward changed" in capsys.readouterr().out
    run(shell, defining)  # the cell run again from the same source: a new head() of the same code, which the
    capsys.readouterr()   # model's forward reads: the ranks keep model and optimizer
    assert abs(run(shell, cell).result.final_loss - first) < 1e-3
    assert "sent again" not in capsys.readouterr().out
    try:  # a library class's method replaced: it cannot reach the ranks (by reference), and the cell says so
        run(shell, "_linear_forward = nn.Linear.forward\nnn.Linear.forward = lambda self, x: x @ self.weight.T")
        run(shell, cell)
        assert "distnb: warning: torch.nn.Linear.forward was replaced in the notebook, but swap_net's library " \
               "classes reach the ranks by reference" in capsys.readouterr().out
    finally:
        run(shell, "nn.Linear.forward = _linear_forward")


def test_an_attribute_or_hook_changed_in_the_notebook_is_sent_to_the_ranks(shell, capsys):
    # the ranks kept the model as first sent: an activation held as an attribute, a config dict, a forward hook
    run(shell, "import torch, torch.nn as nn, torch.nn.functional as F\n"
               "class Held(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
               "        self.fc = nn.Linear(4, 3)\n        self.act = torch.relu\n        self.cfg = {'scale': 1.0}\n"
               "    def forward(self, x):\n        return self.act(self.fc(x)) * self.cfg['scale']\n"
               "torch.manual_seed(0)\nheld_net = Held()\nheld_x, held_y = torch.randn(64, 4), torch.randint(0, 3, (64,))\n"
               "held_data = torch.utils.data.TensorDataset(held_x, held_y)")
    cell = "%%distrain --model held_net --data held_data --batch-size 32 --lr 1e-9 --progress none\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    run(shell, cell)
    changes = (("held_net.act = torch.tanh", "the model's attribute act changed"),
               ("held_net.cfg['scale'] = 3.0", "the model's attribute cfg changed"),
               ("_h = held_net.fc.register_forward_hook(lambda m, i, o: o * 2)", "a forward hook on fc was added"),
               ("_h.remove()", "a forward hook on fc was added, removed or replaced"))
    for change, says in changes:
        run(shell, change)
        expected = run(shell, "float(F.cross_entropy(held_net(held_x), held_y).detach())").result
        capsys.readouterr()
        result = run(shell, cell).result
        assert abs(result.final_loss - expected) < 1e-5, (change, result.final_loss, expected)  # the new model's loss
        assert f"held_net changed in the notebook since the last cell ({says}" in capsys.readouterr().out, change
    run(shell, "_ = held_net(held_x)")  # an evaluation in the notebook is no change
    run(shell, cell)
    assert "changed in the notebook" not in capsys.readouterr().out


def test_a_body_helper_reads_the_notebook_global_as_it_is_now(shell):
    """A notebook function the body calls was pushed by identity: a global it reads changed in the notebook (K = 0)
    left the ranks computing with the old value."""
    run(shell, "import torch, torch.nn as nn, torch.nn.functional as F\nHELP_K = 1.0\n"
               "def helped(z):\n    return z * HELP_K\ntorch.manual_seed(0)\nhelp_net = nn.Linear(4, 2)\n"
               "help_data = torch.utils.data.TensorDataset(torch.randn(64, 4) * 20, torch.randint(0, 2, (64,)))")
    cell = "%%distrain --model help_net --data help_data --batch-size 32 --lr 1e-9 --progress none\nx, y = batch\n" \
           "loss = F.cross_entropy(helped(model(x)), y)"
    assert abs(run(shell, cell).result.final_loss - math.log(2)) > 0.05
    run(shell, "HELP_K = 0.0")
    assert abs(run(shell, cell).result.final_loss - math.log(2)) < 1e-6  # logits 0: ln 2


def test_a_new_object_under_a_trained_name_starts_from_the_defaults(shell, capsys):
    make = small_net(shell, "new")
    cell = "%%distrain --model new_net --data new_data --progress none{} -o new_res\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    assert run(shell, cell.format(" --strategy fsdp --optimizer adam")).error_in_exec is None
    run(shell, "new_net.load_state_dict(new_net.state_dict())")  # the same object, new weights: settings carry
    assert run(shell, cell.format("")).error_in_exec is None
    assert (shell.user_ns["new_res"].plan.strategy, shell.user_ns["new_res"].plan.optimizer) == ("fsdp", "adam")
    capsys.readouterr()
    run(shell, make)  # the model cell run again: another object under the name
    assert run(shell, cell.format("")).error_in_exec is None
    out = capsys.readouterr().out
    assert "new_net is a new object: the options its old object's cells carried (--optimizer adam, --strategy " \
           "fsdp) start from their defaults" in out
    plan = shell.user_ns["new_res"].plan
    assert (plan.strategy, plan.optimizer) == ("ddp", None)  # None: the default optimizer
    assert run(shell, cell.format("")).error_in_exec is None  # from now on its own cells carry
    assert "new object" not in capsys.readouterr().out


def test_carried_settings_are_said_in_the_dashboard_header_and_under_dist_status(shell, capsys):
    """--precision bf16 stuck to a model unannounced, and a re-run model cell fell back from adam to sgd with one
    line among many: the dashboard's header and %dist status now say what a model's next cell carries."""
    make = small_net(shell, "said")
    cell = "%%distrain --model said_net --data said_data --progress none{} -o said_res\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    assert run(shell, cell.format(" --optimizer adam --precision bf16")).error_in_exec is None
    capsys.readouterr()
    assert run(shell, cell.format("")).error_in_exec is None
    assert "distnb: --optimizer adam, --precision bf16, as in said_net's last cell" in capsys.readouterr().out
    held = session_mod.current().holdings
    assert held.settings["said_net"] == "carried from said_net's last cell: --optimizer adam, --precision bf16"
    notes = "\n".join(run(shell, "%dist status").result.notes)
    assert "said_net's next cell carries --optimizer adam, --precision bf16" in notes
    run(shell, make)  # the model cell run again: a new object, back to the defaults (sgd, fp32)
    assert run(shell, cell.format("")).error_in_exec is None
    assert held.settings["said_net"] == "said_net is a new object: --optimizer adam, --precision bf16 not carried " \
        "(defaults used)"
    assert "said_net's next cell" not in "\n".join(run(shell, "%dist status").result.notes)


def test_state_carries_over_between_cells_and_settings_do_not(shell, capsys):
    small_net(shell, "carry")
    cell = "%%distrain --model carry_net --data carry_data --progress none{} -o carry_res\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    assert run(shell, cell.format(" --strategy fsdp --fsdp-units 0,2 --optimizer adam --batch-size 8")
               ).error_in_exec is None
    capsys.readouterr()
    assert run(shell, cell.format("")).error_in_exec is None  # the state is kept; --batch-size is back to 32
    out = capsys.readouterr().out
    plan = shell.user_ns["carry_res"].plan
    assert (plan.strategy, plan.fsdp_units, plan.optimizer, plan.batch_size) == ("fsdp", ("0", "2"), "adam", 32)
    assert "distnb: --optimizer adam, --strategy fsdp, --fsdp-units 0,2, as in carry_net's last cell" in out
    assert "sent again" not in out  # the ranks keep the sharded model and its optimizer state
    err = run(shell, cell.format(" --split 1")).error_in_exec  # a pipeline option, the strategy carried: fsdp
    assert isinstance(err, UsageError) and "--split is a --strategy pipeline option (this cell uses --strategy " \
        "fsdp); --strategy fsdp carried over from carry_net's last cell" in str(err)
    err = run(shell, cell.format(" --epochs 0")).error_in_exec  # nothing carried is involved: not named
    assert isinstance(err, UsageError) and "carried" not in str(err) and "--epochs" in str(err)
    assert run(shell, cell.format(" --strategy ddp --find-unused-parameters")).error_in_exec is None
    out = capsys.readouterr().out
    assert "--strategy ddp (the last cell used fsdp)" in out and "optimizer state and epoch count start afresh" in out
    plan = shell.user_ns["carry_res"].plan
    assert (plan.fsdp_units, plan.optimizer, plan.find_unused_parameters) == (None, "adam", True)
    assert run(shell, cell.format("")).error_in_exec is None
    assert shell.user_ns["carry_res"].plan.find_unused_parameters is True
    assert run(shell, cell.format(" --no-find-unused-parameters")).error_in_exec is None
    assert shell.user_ns["carry_res"].plan.find_unused_parameters is False
    assert run(shell, cell.format("")).error_in_exec is None
    assert shell.user_ns["carry_res"].plan.find_unused_parameters is False


def test_a_carried_option_the_cells_new_strategy_cannot_take_is_dropped_with_a_note(shell, capsys):
    small_net(shell, "drop")
    cell = "%%distrain --model drop_net --data drop_data --progress none{} -o drop_res\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    assert run(shell, cell.format(" --precision bf16")).error_in_exec is None
    capsys.readouterr()
    assert run(shell, cell.format(" --strategy pipeline --split 1")).error_in_exec is None
    assert "distnb: --strategy pipeline cannot take --precision bf16 from drop_net's last cell: this cell uses " \
           "--precision fp32" in capsys.readouterr().out
    assert shell.user_ns["drop_res"].plan.precision == "fp32"
    err = run(shell, cell.format(" --strategy pipeline --split 1 --precision bf16")).error_in_exec  # given: refused
    assert isinstance(err, UsageError) and "--precision bf16 with --strategy pipeline is not supported" in str(err)
    assert run(shell, cell.format(" --strategy ddp")).error_in_exec is None  # the last cell's state: fp32
    assert shell.user_ns["drop_res"].plan.precision == "fp32"


def test_a_none_for_a_carried_option_is_the_option_left_out(shell, dist_session):
    """The signature's strategy=None (and precision=None, ...): ddp at first, then the model's last cell's."""
    small_net(shell, "nn")
    body = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
    first = dist_session.train(body, model="nn_net", data="nn_data", strategy=None, precision=None, compile=None,
                               progress="none", quiet=True)
    assert (first.plan.strategy, first.plan.precision, first.plan.compile) == ("ddp", "fp32", False)
    dist_session.train(body, model="nn_net", data="nn_data", strategy="fsdp", progress="none", quiet=True)
    kept = dist_session.train(body, model="nn_net", data="nn_data", strategy=None, progress="none", quiet=True)
    assert kept.plan.strategy == "fsdp" and kept.rows[0]["steps"] > 0


def test_the_notes_on_a_cells_start_print_before_its_epoch_lines_once(shell, capsys):
    """"new sgd optimizer (was adam)" printed after the cell's epoch lines in the text progress view."""
    small_net(shell, "sn")
    cell = "%%distrain --model sn_net --data sn_data --batch-size 16 --epochs 2 --progress text{}\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    assert run(shell, cell.format(" --optimizer adam")).error_in_exec is None
    capsys.readouterr()
    assert run(shell, cell.format(" --optimizer sgd")).error_in_exec is None
    lines = capsys.readouterr().out.splitlines()
    note = [i for i, line in enumerate(lines) if "new sgd optimizer (was adam)" in line]
    epochs = [i for i, line in enumerate(lines) if line.startswith("epoch ")]
    assert len(note) == 1 and len(epochs) == 2 and note[0] < epochs[0], lines


def test_carried_options_survive_a_stop_and_a_start_in_the_same_kernel(shell, capsys):
    small_net(shell, "ss")
    cell = "%%distrain --model ss_net --data ss_data --progress none{} -o ss_res\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    assert run(shell, cell.format(" --optimizer adam --lr 0.01")).error_in_exec is None
    assert run(shell, "%dist stop").error_in_exec is None
    assert run(shell, "%dist start -n 2 --timeout 30").error_in_exec is None
    capsys.readouterr()
    assert run(shell, cell.format("")).error_in_exec is None
    assert shell.user_ns["ss_res"].plan.optimizer == "adam"
    assert "fresh adam optimizer" in capsys.readouterr().out  # the new ranks build the optimizer chosen before


def test_lr_zero_is_taken_and_leaves_the_weights_as_they_were(shell):
    """--lr 0 (torch takes it: a pass that only measures, or a frozen model) trains no change into the weights."""
    small_net(shell, "lz")
    before = [p.detach().clone() for p in shell.user_ns["lz_net"].parameters()]
    res = run(shell, "%%distrain --model lz_net --data lz_data --batch-size 16 --optimizer sgd --lr 0 --progress none "
                     "-o lz_res\nx, y = batch\nloss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None
    assert shell.user_ns["lz_res"].rows[0]["steps"] > 0 and shell.user_ns["lz_res"].plan.lr == 0
    assert all(torch.equal(a, b) for a, b in zip(before, shell.user_ns["lz_net"].parameters()))


def test_ipyparallels_own_magics_are_not_left_in_the_notebook(shell):
    """ipyparallel's Client registered %px, %autopx and %pxresult (%result): with automagic a bare undefined `result`
    (the README's -o result) ran %pxresult instead of raising NameError, and `autopx` sent later cells to the ranks."""
    lines = shell.magics_manager.magics["line"]
    assert not {"px", "autopx", "pxresult", "result", "pxconfig"} & set(lines), sorted(lines)
    assert "px" not in shell.magics_manager.magics["cell"]
    assert isinstance(run(shell, "never_bound_result_name").error_in_exec, NameError)
