"""Bad input against the live shared 2-rank cluster (issue 4, behaviour 7).

Each case: a clear error (a UsageError for options and names, before anything runs; a
RankError naming the rank for what fails on the ranks), within seconds, the cluster usable
afterwards and nothing lost (the model trained before keeps its weights, on the ranks and
in the kernel). The same magics are fuzzed with hypothesis, without a cluster, in
tests/unit/test_option_fuzz.py; tests/magics/test_magics.py has the first bad-option cases.
"""

import re
import time

import pytest
import torch
from IPython.core.error import UsageError

from distnb import session as session_mod
from distnb.core.errors import PlanError, RankError

SETUP = """
import threading
import torch, torch.nn as nn, torch.nn.functional as F
g = torch.Generator().manual_seed(0)
X = torch.randn(256, 8, generator=g)
Y = (X[:, 0] - X[:, 1] > 0).long()
bad_ds = torch.utils.data.TensorDataset(X, Y)
empty_ds = torch.utils.data.TensorDataset(torch.empty(0, 8), torch.empty(0, dtype=torch.long))
one_ds = torch.utils.data.TensorDataset(X[:1], Y[:1])
empty_t = torch.empty(0)
bad_xs = torch.arange(10.0)
a_word = "hello"
a_lock = threading.Lock()
a_generator = (i for i in range(3))
class BadNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.extra = nn.Linear(3, 3)  # never used in forward: DDP gets no gradient for it
    def forward(self, x):
        return self.fc(x)
torch.manual_seed(0)
keep_net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
lazy_net = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))  # its first forward has not run
"""
BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


def run(shell, code):
    return shell.run_cell(code, silent=False)


@pytest.fixture(scope="module")
def trained(shell):
    """A model trained before the bad input, and its weights: nothing may change them."""
    assert run(shell, SETUP).error_in_exec is None
    res = run(shell, f"%%distrain --model keep_net --data bad_ds --epochs 2 --batch-size 32 --progress none\n{BODY}")
    assert res.error_in_exec is None, res.error_in_exec
    return [p.detach().clone() for p in shell.user_ns["keep_net"].parameters()]


def _ranks_weights(name):
    s = session_mod.current()
    s.run(f"import torch\n_w = torch.cat([p.detach().flatten() for p in {name}.parameters()])")
    return s.pull("_w")


DIST_LINES = [
    ("%dist start -n 0", "must be at least 1"),
    ("%dist start -n -2", "must be at least 1"),
    ("%dist start -n 100000", "use at most -n"),
    ("%dist start -n two", "-n/--engines: invalid int value"),
    ("%dist start --timeout -1", "--timeout must be positive"),
    ("%dist start --timeout 0.001", "--timeout must be between 1 and"),
    ("%dist start --timeout nan", "--timeout must be a finite number"),
    ("%dist start --master-port -1", "--master-port must be at least 0"),
    ("%dist start --master-port 70000", "--master-port must be a TCP port"),
    ("%dist start --master-port http", "--master-port: invalid int value"),
    ("%dist start --backend nccl", "needs GPU engines"),
    ("%dist start --auto-restart yes", "unrecognized arguments: yes"),
    ("%dist stop now", "unrecognized arguments: now"),
    ("%dist restart --engines-per-rank 3", "unrecognized arguments"),
    ("%dist restart -n 0", "(-n) must be at least 1"),  # checked before anything stops
    ("%dist status --all", "unrecognized arguments: --all"),
    ("%dist scatter", "required: name"),
    ("%dist scatter no_such_data", "'no_such_data' is not defined in the notebook"),
    ("%dist scatter bad_xs --seed -1", "--seed must be a non-negative integer"),
    ("%dist scatter bad_xs --seed 1.5", "--seed: invalid int value"),
    ("%dist scatter empty_t", "empty_t is empty (0 samples)"),
    ("%dist scatter empty_ds", "empty_ds is empty (0 samples)"),
    ("%dist scatter one_ds", "has 1 samples, fewer than world_size=2"),
    ("%dist scatter a_word", "a_word is a str; --data takes"),
    ("%dist scatter a_lock", "--data takes a torch Dataset"),
    ("%dist gather", "required: name"),
    ("%dist pull bad_xs --rank 2", "--rank must be between 0 and 1"),
    ("%dist pull bad_xs --rank -1", "--rank must be between 0 and 1"),
    ("%dist pull bad_xs --rank one", "--rank: invalid int value"),
    ("%dist push a_lock", "cannot send 'a_lock' (lock)"),
    ("%dist push a_generator", "cannot send 'a_generator' (generator)"),
    ("%%dist --bogus\n1", "unrecognized arguments: --bogus"),
    ("%%dist\nx = (", "the cell is not valid Python"),
    # a folder that cannot be made: every rank asked before any writes (their group and model stay)
    ("%dist save /proc/distnb-nope --model keep_net", "%dist save /proc/distnb-nope: not every rank can write it (ranks "
                                                      "0-1 on "),
]

TRAIN_LINES = [
    ("--model keep_net --data bad_ds --batch-size 0", BODY, "--batch-size must be at least 1"),
    ("--model keep_net --data bad_ds --batch-size -5", BODY, "--batch-size must be at least 1"),
    ("--model keep_net --data bad_ds --batch-size 2.5", BODY, "--batch-size: invalid int value"),
    ("--model keep_net --data bad_ds --epochs -1", BODY, "--epochs must be at least 1"),
    ("--model keep_net --data bad_ds --lr -0.1", BODY, "--lr must be at least 0"),
    ("--model keep_net --data bad_ds --lr nan", BODY, "--lr must be a finite number"),
    ("--model keep_net --data bad_ds --lr fast", BODY, "--lr: invalid float value"),
    ("--model keep_net --data bad_ds --seed -1", BODY, "--seed must be at least 0"),
    ("--model keep_net --data bad_ds --target-loss inf", BODY, "--target-loss must be a finite number"),
    ("--model keep_net --data bad_ds --strategy DDP", BODY, "--strategy must be one of ddp, fsdp"),
    ("--model keep_net --data bad_ds --strategy ''", BODY, "--strategy must be one of"),
    ("--model keep_net --data bad_ds --strategy pipeline --microbatches 0", BODY, "--microbatches must be at least 1"),
    ("--model keep_net --data bad_ds --strategy ps --servers 0", BODY, "--servers must be at least 1"),
    ("--model keep_net --data bad_ds --strategy ps --staleness -1", BODY, "--staleness must be at least 0"),
    ("--model keep_net --data bad_ds --fsdp-units fc", BODY, "--fsdp-units is a --strategy fsdp or fsdp+tensor option"),
    ("--model keep_net --data bad_ds --schedule 1f1b", BODY, "--schedule is a --strategy pipeline option"),
    ("--model keep_net --data bad_ds --nan maybe", BODY, "--nan must be one of stop, skip"),
    ("--model keep_net --data bad_ds --progress fancy", BODY, "--progress must be one of auto, widgets"),
    ("--model keep_net --data bad_ds --optimizer 3", BODY, "--optimizer must be sgd, adam, adamw"),
    ("--model keep_net --data bad_ds --optimizer a_word", BODY, "--optimizer a_word must be callable"),
    ("--model keep_net --data bad_ds -o 1bad", BODY, "-o/--output must be a notebook name"),
    ("--model keep_net --data empty_ds", BODY, "empty_ds is empty (0 samples)"),
    ("--model keep_net --data one_ds", BODY, "fewer than world_size=2"),
    ("--model keep_net --data a_word", BODY, "a_word is a str; --data takes"),
    ("--model a_word --data bad_ds", BODY, "--model a_word is a str, not a torch.nn.Module"),
    # torch's ValueError from distnb's fingerprint, as a traceback through distnb's internals
    ("--model lazy_net --data bad_ds", BODY, "--model lazy_net has uninitialized parameters (0.weight, 0.bias: "
                                              "LazyLinear not yet run): run one forward pass in the notebook first"),
    ("--model keep_net", BODY, "required: --data"),
    # it failed only at the first save, after an epoch's training, with the ranks' FileNotFoundError
    ("--model keep_net --data bad_ds --checkpoint-dir /proc/distnb-nope", BODY,
     "--checkpoint-dir /proc/distnb-nope: not every rank can write it (ranks 0-1 on "),
    ("--model keep_net --data bad_ds", "", "cell body is empty"),
    ("--model keep_net --data bad_ds", "x, y = batch\nloss = (", "not valid Python"),
]


@pytest.mark.parametrize("line,needle", DIST_LINES)
def test_bad_dist_input_is_a_usage_error(shell, trained, line, needle):
    t0 = time.monotonic()
    res = run(shell, line)
    assert isinstance(res.error_in_exec, UsageError), (line, res.error_in_exec)
    assert needle in str(res.error_in_exec), (line, str(res.error_in_exec))
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("line,body,needle", TRAIN_LINES)
def test_bad_training_input_is_a_usage_error(shell, trained, line, body, needle):
    t0 = time.monotonic()
    res = run(shell, f"%%distrain {line} --progress none\n{body}" if "--progress" not in line
              else f"%%distrain {line}\n{body}")
    assert isinstance(res.error_in_exec, UsageError), (line, res.error_in_exec)
    assert needle in str(res.error_in_exec), (line, str(res.error_in_exec))
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--log-dir"])
def test_a_folder_one_rank_cannot_write_is_refused_by_every_rank_before_any_step(shell, trained, tmp_path,
                                                                                  monkeypatch, flag):
    """--checkpoint-dir was checked in the kernel only: a folder rank 1 could not write failed on rank 1 at its
    first save, after an epoch's training. Every rank is asked first, as %dist save asks: one error naming the
    rank, its host and the fix, nothing trained. Rank 1 sees another folder than the kernel and rank 0 here as a
    rank on another host, in a container or under another user does: /proc/self/cwd is each process's own working
    folder, and rank 1's holds a file where the folder should be."""
    for where in ("kernel", "rank0", "rank1"):
        (tmp_path / where).mkdir()
    (tmp_path / "rank1" / "blocked").write_text("a file where the folder should be")
    monkeypatch.chdir(tmp_path / "kernel")
    assert run(shell, f"%%dist\nimport os\n_cwd = os.getcwd()\nos.chdir(os.path.join({str(tmp_path)!r}, "
                      "f'rank{rank}'))").error_in_exec is None
    try:
        res = run(shell, f"%%distrain --model keep_net --data bad_ds --epochs 1 --progress none {flag} "
                         f"/proc/self/cwd/blocked\n{BODY}")
    finally:
        assert run(shell, "%%dist\nos.chdir(_cwd)").error_in_exec is None
    assert isinstance(res.error_in_exec, UsageError), res.error_in_exec
    host = session_mod.current().cluster.ranks[1]["host"]
    assert str(res.error_in_exec) == (
        f"{flag} /proc/self/cwd/blocked: not every rank can write it (rank 1 on {host}: /proc/self/cwd/blocked is a "
        "file, not a folder); give a folder every rank can create and write. Nothing was sent or trained")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["blocked", "kernel", "rank0", "rank1"]  # nothing written
    # nothing trained: the weights are the trained fixture's, on the ranks and in the kernel
    kernel = torch.cat([p.detach().flatten() for p in shell.user_ns["keep_net"].parameters()])
    assert torch.equal(kernel, torch.cat([p.flatten() for p in trained]))
    assert all(torch.equal(w, kernel) for w in _ranks_weights("keep_net"))


@pytest.mark.parametrize("data,needle", [
    ("keep_net", "--data keep_net is a Sequential; --data takes"),  # a Module as data
    ("nested_data", "nested_data[1] is a tuple; --data takes tensors or numpy arrays (a tensor, a tuple of them, a "
                    "dict of them, or a torch Dataset) (a nested container: flatten it"),  # the model was sent first
    ("dict_data", "dict_data['x'] is a list; --data takes tensors"),
])
def test_a_data_set_that_cannot_be_sent_fails_before_the_model_is_sent(shell, trained, capsys, data, needle):
    run(shell, "never_sent = nn.Linear(8, 2)\nnested_data = (X, (Y, Y))\ndict_data = {'x': X.tolist(), 'y': Y}")
    capsys.readouterr()
    res = run(shell, f"%%distrain --model never_sent --data {data} --progress none\n{BODY}")
    assert isinstance(res.error_in_exec, UsageError) and needle in str(res.error_in_exec), res.error_in_exec
    assert "sent never_sent" not in capsys.readouterr().out
    run(shell, "%%dist\nfrom distnb.engine.train import loop\n_held = 'never_sent' in loop.RUNS")
    assert run(shell, "%dist pull _held").result == [False, False]


def test_a_validation_set_that_cannot_be_tensors_fails_before_anything_is_sent(shell, trained, capsys):
    """A --val-data Dataset is collated into tensors in the kernel; an item field of strings failed after the
    model and the training set were sent, as "vds['name'] is a list; --data takes tensors ... or a torch Dataset"
    (vds being one)."""
    run(shell, "class NamedItems(torch.utils.data.Dataset):\n"
               "    def __len__(self): return 16\n"
               "    def __getitem__(self, i): return {'x': X[i], 'y': Y[i], 'name': f'item{i}'}\n"
               "named_val = NamedItems()\nnever_sent_v = nn.Linear(8, 2)")
    capsys.readouterr()
    res = run(shell, "%%distrain --model never_sent_v --data bad_ds --val-data named_val --progress none\n"
                     "x, y = (batch['x'], batch['y']) if isinstance(batch, dict) else batch\n"
                     "loss = F.cross_entropy(model(x), y)")
    err = res.error_in_exec
    assert isinstance(err, UsageError), err
    assert str(err).startswith("--val-data named_val: named_val's items collate with torch's default_collate to what "
                               "is not all tensors: named_val['name'] is a list;"), str(err)
    assert "leave the other fields out of its items" in str(err)
    assert "sent never_sent_v" not in capsys.readouterr().out
    run(shell, "%%dist\nfrom distnb.engine.train import loop\n_held = 'never_sent_v' in loop.RUNS")
    assert run(shell, "%dist pull _held").result == [False, False]


@pytest.mark.parametrize("data, fix", [("(X.double().numpy(), Y.numpy())", "X.astype(np.float32)"),
                                       ("(X.double(), Y)", "X.float()"),
                                       ("torch.utils.data.TensorDataset(X.double(), Y)", "X.float()")])
def test_float64_data_for_a_float32_model_names_the_fix(shell, trained, data, fix):
    run(shell, f"torch.manual_seed(0)\ndt_net = nn.Sequential(nn.Linear(8, 2))\ndt_data = {data}")
    res = run(shell, f"%%distrain --model dt_net --data dt_data --progress none\n{BODY}")
    err = res.error_in_exec
    assert isinstance(err, RankError) and "same dtype" in str(err), err  # torch's own words stay
    assert "--data dt_data holds float64" in str(err) and "dt_net's parameters are float32" in str(err)
    assert fix in str(err) and "x = x.float()" in str(err)
    run(shell, "dt_data = (X, Y)")  # the fix works on the same model
    assert run(shell, f"%%distrain --model dt_net --data dt_data --progress none\n{BODY}").error_in_exec is None


MODULE = """
import torch.nn as nn
class ModNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)
    def forward(self, x):
        return self.fc(x)
"""


def test_a_model_from_a_folder_only_the_kernel_has_on_its_path_names_the_fix(shell, trained, tmp_path):
    """A model class from a module the kernel imports through its own sys.path entry travels by reference.

    The ranks cannot import it; the error said only ``No module named 'distnb_user_models'``.
    """
    import sys

    (tmp_path / "distnb_user_models.py").write_text(MODULE)
    folder = str(tmp_path)
    run(shell, f"import sys\nsys.path.insert(0, {folder!r})\nfrom distnb_user_models import ModNet\nmod_net = ModNet()")
    try:
        res = run(shell, f"%%distrain --model mod_net --data bad_ds --progress none\n{BODY}")
        err = res.error_in_exec
        assert isinstance(err, RankError) and "No module named 'distnb_user_models'" in str(err), err
        fix = f"import sys; sys.path.insert(0, {folder!r})"
        assert f"its folder {folder} is on the kernel's sys.path and not on theirs" in str(err)
        assert fix in str(err)
        run(shell, f"%%dist\n{fix}")  # the fix it names works
        assert run(shell, f"%%distrain --model mod_net --data bad_ds --progress none\n{BODY}").error_in_exec is None
    finally:
        sys.path.remove(folder)
        sys.modules.pop("distnb_user_models", None)
        run(shell, f"%%dist\nimport sys\nsys.path.remove({folder!r})")


def test_a_dataset_of_float64_arrays_for_a_float32_model_names_the_fix(shell, trained):
    """The hint named tensor containers only: a Dataset whose __getitem__ returns numpy's float64 got torch's
    'mat1 and mat2 must have the same dtype' alone."""
    run(shell, "import numpy as np\n"
               "class Float64Items(torch.utils.data.Dataset):\n"
               "    def __len__(self): return 32\n"
               "    def __getitem__(self, i): return X[i].double().numpy(), int(Y[i])\n"
               "f64_items = Float64Items()\ntorch.manual_seed(0)\nf64_net = nn.Sequential(nn.Linear(8, 2))")
    res = run(shell, f"%%distrain --model f64_net --data f64_items --progress none\n{BODY}")
    err = res.error_in_exec
    assert isinstance(err, RankError) and "same dtype" in str(err), err
    assert "--data f64_items's samples are (float64[8], int), float64 (numpy's default for floats), and f64_net's " \
           "parameters are float32: return float32 from __getitem__ (x.astype(np.float32)" in str(err), str(err)
    assert "x = x.float()" in str(err)
    assert run(shell, f"%%distrain --model f64_net --data f64_items --progress none\n"  # the fix it names works
                      "x, y = batch\nloss = F.cross_entropy(model(x.float()), y)").error_in_exec is None


def test_a_model_cast_to_bf16_with_float32_data_names_precision(shell, trained):
    """net.to(torch.bfloat16) to train in bf16 got torch's 'mat1 and mat2 must have the same dtype' alone."""
    run(shell, "torch.manual_seed(0)\nbf_net = nn.Sequential(nn.Linear(8, 2)).to(torch.bfloat16)")
    err = run(shell, f"%%distrain --model bf_net --data bad_ds --progress none\n{BODY}").error_in_exec
    assert isinstance(err, RankError) and "same dtype" in str(err), err
    assert "bf_net's parameters are bfloat16 and --data bad_ds holds float32: to train in bfloat16, keep the model " \
           "float32 and pass --precision bf16" in str(err), str(err)


@pytest.mark.parametrize("data", ["(X[:3], Y[:3])", "list(zip(X[:3], Y[:3]))"])
def test_drop_last_with_no_full_batch_says_only_the_error(shell, trained, capsys, data):
    """It printed the cut first ('drop: each rank uses 0 of its 1-2 samples ...; 0 steps/epoch of 1 per rank'),
    then the UsageError."""
    run(shell, f"tiny_dl = {data}")
    capsys.readouterr()
    res = run(shell, f"%%distrain --model keep_net --data tiny_dl --batch-size 4 --drop-last --progress none\n{BODY}")
    err = res.error_in_exec
    assert isinstance(err, UsageError) and "no full batch (lower --batch-size or drop --drop-last)" in str(err), err
    assert "steps/epoch" not in capsys.readouterr().out


def test_nothing_was_lost_and_the_cluster_works(shell, trained):
    # runs after the bad input above: the model on the ranks and in the kernel is untouched
    ranks = _ranks_weights("keep_net")
    kernel = torch.cat([p.detach().flatten() for p in shell.user_ns["keep_net"].parameters()])
    assert torch.equal(kernel, torch.cat([p.flatten() for p in trained]))
    assert torch.equal(ranks[0], kernel) and torch.equal(ranks[1], kernel)
    assert session_mod.current().world_size == 2
    res = run(shell, f"%%distrain --model keep_net --data bad_ds --progress none -o after_bad\n{BODY}")
    assert res.error_in_exec is None, res.error_in_exec
    assert shell.user_ns["after_bad"].epochs == [2]  # it continued where it was


@pytest.mark.parametrize("body,needle", [
    ("x, y = batch\nloss = F.cross_entropy(model(x), y).detach()", "`loss` does not require grad"),
    ("x, y = batch\nloss = model(x)", "`loss` must be a scalar tensor, got (32, 2)"),
    ("x, y = batch\nloss = None", "left no `loss`"),
    # a body that runs backward itself: torch's 'backward through the graph a second time' said nothing of distnb,
    # and with retain_graph=True the cell trained on doubled gradients without a word
    ("x, y = batch\nloss = F.cross_entropy(model(x), y)\nloss.backward()", "the %%distrain body ran backward itself"),
    ("x, y = batch\nloss = F.cross_entropy(model(x), y)\nloss.backward(retain_graph=True)",
     "the %%distrain body ran backward itself"),
])
def test_bad_loss_names_rank_and_step(shell, trained, body, needle):
    res = run(shell, f"%%distrain --model keep_net --data bad_ds --progress none\n{body}")
    err = res.error_in_exec
    assert isinstance(err, RankError) and needle in str(err), err
    assert "epoch" in str(err) and "step 0" in str(err)


def test_a_graph_carried_from_an_earlier_step_is_named_not_blamed_on_the_body(shell, trained):
    # an RNN's hidden state carried over without .detach(): torch's 'backward through the graph a second time',
    # which is not the body running backward itself
    res = run(shell, "%%distrain --model keep_net --data bad_ds --progress none\nx, y = batch\n"
                     "carried = model(x).mean() + (carried if ctx.step else 0)\n"
                     "loss = F.cross_entropy(model(x), y) + carried")
    err = res.error_in_exec
    assert isinstance(err, RankError) and "a tensor kept from an earlier step" in str(err), err
    assert "`.detach()` it" in str(err) and "ran backward itself" not in str(err) and "step 1" in str(err)


def test_a_dict_batch_unpacked_as_a_tuple_names_its_keys(shell, trained):
    # x, y = batch on a dict gives its keys: torch said only "argument 'input' must be Tensor, not str"
    run(shell, "torch.manual_seed(0)\ndict_net = nn.Sequential(nn.Linear(8, 2))\nby_key = {'x': X, 'y': Y}")
    res = run(shell, f"%%distrain --model dict_net --data by_key --progress none\n{BODY}")
    err = res.error_in_exec
    assert isinstance(err, RankError) and "the batch is a dict (keys 'x', 'y')" in str(err), err
    assert "x, y = batch['x'], batch['y']" in str(err)
    ok = run(shell, "%%distrain --model dict_net --data by_key --progress none\n"
                    "x, y = batch['x'], batch['y']\nloss = F.cross_entropy(model(x), y)")
    assert ok.error_in_exec is None, ok.error_in_exec


def test_nan_loss_on_one_rank_names_the_rank_and_step(shell, trained):
    run(shell, SETUP.split("torch.manual_seed(0)")[0] + "torch.manual_seed(1)\n"
               "nan_net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))")
    res = run(shell, "%%distrain --model nan_net --data bad_ds --batch-size 32 --progress none\nx, y = batch\n"
                     "loss = F.cross_entropy(model(x), y)\nif rank == 1 and ctx.step == 2:\n"
                     "    loss = loss * float('nan')")
    err = res.error_in_exec
    assert isinstance(err, RankError) and err.rank == 1, err
    assert "the loss is nan at rank 1, epoch 0, step 2" in str(err) and "--nan skip" in str(err)
    assert all(torch.isfinite(p).all() for p in shell.user_ns["nan_net"].parameters())  # steps 0-1 kept


def test_nan_ignore_goes_on(shell, trained):
    run(shell, "torch.manual_seed(1)\nnan_net2 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))")
    res = run(shell, "%%distrain --model nan_net2 --data bad_ds --batch-size 32 --epochs 2 --nan skip "
                     "--progress none -o nan_ignored\nx, y = batch\nloss = F.cross_entropy(model(x), y)\n"
                     "if rank == 1 and ctx.step == 2:\n    loss = loss * float('nan')")
    assert res.error_in_exec is None, res.error_in_exec
    assert [r["steps"] for r in shell.user_ns["nan_ignored"].rows] == [8, 8]  # every step ran


def test_nan_ignore_skips_the_step(shell, trained):
    run(shell, "torch.manual_seed(1)\nnan_net3 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))")
    run(shell, "%%distrain --model nan_net3 --data bad_ds --batch-size 32 --nan skip --progress none\n"
               "x, y = batch\nloss = F.cross_entropy(model(x), y)\nif rank == 1 and ctx.step == 2:\n"
               "    loss = loss * float('nan')")
    assert all(torch.isfinite(p).all() for p in shell.user_ns["nan_net3"].parameters())


def test_unused_parameters_are_named_with_the_option(shell, trained):
    run(shell, "torch.manual_seed(0)\nunused_net = BadNet()")
    res = run(shell, f"%%distrain --model unused_net --data bad_ds --progress none\n{BODY}")
    err = res.error_in_exec
    assert isinstance(err, RankError), err
    assert "extra.bias, extra.weight" in str(err) and "--find-unused-parameters" in str(err)
    run(shell, "torch.manual_seed(0)\nunused_net2 = BadNet()")
    ok = run(shell, f"%%distrain --model unused_net2 --data bad_ds --find-unused-parameters --progress none\n{BODY}")
    assert ok.error_in_exec is None, ok.error_in_exec


def test_the_advised_retry_works_on_the_same_model(shell, trained):
    run(shell, "torch.manual_seed(0)\nunused_net3 = BadNet()")
    before = {k: v.clone() for k, v in shell.user_ns["unused_net3"].state_dict().items()}
    res = run(shell, f"%%distrain --model unused_net3 --data bad_ds --epochs 1 --batch-size 64 --progress none\n{BODY}")
    assert isinstance(res.error_in_exec, RankError) and "no optimizer step was taken" in str(res.error_in_exec)
    after = shell.user_ns["unused_net3"].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no step with one rank's gradients
    ok = run(shell, f"%%distrain --model unused_net3 --data bad_ds --find-unused-parameters --progress none\n{BODY}")
    assert ok.error_in_exec is None, ok.error_in_exec


BRANCHY = """
class Branchy(nn.Module):  # a branch taken on some batches only: its parameters get no gradient on the others
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 2), nn.Linear(8, 2)
    def forward(self, x):
        return self.a(x) + (self.b(x) if x[0, 0] > 0 else 0)
torch.manual_seed(0)
branchy_x = torch.randn(40, 8)
branchy_x[:, 0] = 1.0
branchy_x[torch.arange(40) % 7 == 3, 0] = -1.0  # the branch is off on one rank's batch at some step
branchy_ds = torch.utils.data.TensorDataset(branchy_x, torch.randint(0, 2, (40,)))
branchy = Branchy()
"""


def test_the_retry_after_a_mid_epoch_unused_parameter_error_works(shell, trained):
    """DDP without --find-unused-parameters fails a step after one rank skipped the branch: that rank had
    taken the step before (with its own gradients), its peer had not. The ranks' positions differed by a
    step, and the advised retry ran other numbers of steps on them: gloo aborted rank 0 (SIGABRT)."""
    run(shell, BRANCHY)
    res = run(shell, f"%%distrain --model branchy --data branchy_ds --epochs 2 --batch-size 2 --progress none\n{BODY}")
    assert isinstance(res.error_in_exec, RankError) and "--find-unused-parameters" in str(res.error_in_exec)
    assert "step 0" not in str(res.error_in_exec)  # it fails mid-epoch, not at the first step's check
    ok = run(shell, "%%distrain --model branchy --data branchy_ds --epochs 2 --batch-size 2 --find-unused-parameters "
                    f"--progress none -o branchy_res\n{BODY}")
    assert ok.error_in_exec is None, ok.error_in_exec
    rows = shell.user_ns["branchy_res"].rows
    assert rows[0]["steps"] == rows[1]["steps"]  # one position for both ranks: rank 0's, as its weights
    run(shell, "%%dist\nfrom distnb.engine.train import loop\n_pos = (loop.RUNS['branchy'].epoch, loop.RUNS['branchy'].steps)")
    first, second = run(shell, "%dist pull _pos").result
    assert first == second


MISMATCHES = [
    ("t = torch.ones(3 if rank == 0 else 5)\ndist.all_reduce(t)", "rank 0: all_reduce of float32 [3]; "
                                                                   "rank 1: all_reduce of float32 [5]"),
    ("t = torch.ones((2, 3) if rank == 0 else (3, 2))\ndist.all_reduce(t)",  # same bytes: gloo would mix them up
     "rank 0: all_reduce of float32 [2, 3]; rank 1: all_reduce of float32 [3, 2]"),
    ("t = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)\ndist.all_reduce(t)",
     "rank 0: all_reduce of float32 [4]; rank 1: all_reduce of float64 [4]"),
    ("t = torch.ones(2 + rank)\ndist.broadcast(t, src=0)", "dist.broadcast got different tensors on different "
                                                           "ranks (rank 0: broadcast of float32 [2]"),
    ("t = torch.ones(3)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, src=0)",
     "the ranks called different collectives (rank 0: all_reduce of float32 [3]; rank 1: broadcast of float32 [3])"),
    ("out = [torch.zeros(2), torch.zeros(2)]\ndist.all_gather(out, torch.ones(2 + rank))",
     "dist.all_gather got different tensors"),
    ("t = torch.ones(3)\ndist.broadcast(t, src=rank)",  # each rank its own root: gloo's send and recv time out
     "dist.broadcast got different arguments on different ranks (rank 0: broadcast of float32 [3] from rank 0; "
     "rank 1: broadcast of float32 [3] from rank 1)"),
    ("t = torch.ones(3)\ndist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)",
     "dist.all_reduce got different arguments on different ranks (rank 0: all_reduce of float32 [3] (SUM); "
     "rank 1: all_reduce of float32 [3] (MAX))"),  # silently wrong before: [3, 3, 2]
    ("t = torch.ones(3)\nif rank == 0:\n    dist.barrier()\nelse:\n    dist.all_reduce(t)",
     "the ranks called different collectives (rank 0: barrier; rank 1: all_reduce of float32 [3])"),
]


@pytest.mark.parametrize("code,needle", MISMATCHES)
def test_mismatched_user_collective_is_an_error_on_every_rank(shell, trained, capsys, code, needle):
    t0 = time.monotonic()
    res = run(shell, "%%dist\nimport torch, torch.distributed as dist\n" + code)
    err = res.error_in_exec
    assert isinstance(err, RankError), err
    assert err.ename == "CollectiveMismatchError" and needle in str(err), str(err)
    assert sorted(err.ranks) == [0, 1] and "failed on ranks 0-1" in str(err)  # one error, both ranks; no engine died
    assert time.monotonic() - t0 < 10
    capsys.readouterr()
    ok = run(shell, "%%dist --all-output\nimport torch, torch.distributed as dist\nt = torch.ones(3) * (rank + 1)\n"
                    "dist.all_reduce(t)\nprint('sum', t.tolist())")
    assert ok.error_in_exec is None
    assert capsys.readouterr().out.count("[ranks 0-1] sum [3.0, 3.0, 3.0]") == 1  # both ranks printed it: once


def test_mismatched_collective_in_a_training_body_is_an_error_not_a_hang(shell, trained):
    import time

    run(shell, "torch.manual_seed(0)\ncoll_net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))")
    t0 = time.monotonic()
    res = run(shell, "%%distrain --model coll_net --data bad_ds --progress none\nimport torch.distributed as dist\n"
                     "t = torch.ones(3 if ctx.rank == 0 else 5)\ndist.all_reduce(t)\n" + BODY)
    assert isinstance(res.error_in_exec, RankError), res.error_in_exec
    assert "rank 0: all_reduce of float32 [3]; rank 1: all_reduce of float32 [5]" in str(res.error_in_exec)
    assert time.monotonic() - t0 < 15  # the collective timeout of the test cluster is 30 s
    ok = run(shell, f"%%distrain --model coll_net --data bad_ds --progress none\n{BODY}")
    assert ok.error_in_exec is None, ok.error_in_exec


def test_unchecked_cells_call_torchs_collectives_themselves(shell, trained, capsys):
    # --unchecked: no fingerprint exchange before the cell's own collectives (each one a collective of its own);
    # tensors of the same bytes and different shapes pass unchecked, as under torchrun
    code = ("import torch, torch.distributed as dist\nt = torch.ones((2, 3) if rank == 0 else (3, 2)) * (rank + 1)\n"
            "dist.all_reduce(t)\nt.sum().item()")
    s = session_mod.current()
    with pytest.raises(RankError, match="rank 0: all_reduce of float32 \\[2, 3\\]; rank 1"):
        s.run(code)  # checked by default
    assert s.run(code, unchecked=True) == ["18.0"] * 2
    capsys.readouterr()
    assert run(shell, "%%dist --unchecked --all-output\n" + code).error_in_exec is None
    assert capsys.readouterr().out.count("18.0") == 2  # each rank's last value
    assert "unchecked : bool" in session_mod.Session.train.__doc__
    with pytest.raises(PlanError, match="unchecked must be True or False"):
        s.run(code, unchecked="no")
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of its group never calls it"):  # --targets still refuses at once
        s.run("import torch, torch.distributed as dist\ndist.all_reduce(torch.ones(1))", targets=[0], unchecked=True)
    assert time.monotonic() - t0 < 5
    with pytest.raises(RankError, match="dist.barrier in a cell run on rank 1 only: rank 0 of its group never"):
        s.run("import torch.distributed as dist\ndist.barrier()", targets=1)  # was a HangError after --hang-after
    assert time.monotonic() - t0 < 10
    run(shell, "torch.manual_seed(0)\nfree_net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))")
    body = "import torch.distributed as dist\n" + code.split("\n", 1)[1].replace("rank", "ctx.rank") + "\n" + BODY
    res = run(shell, f"%%distrain --model free_net --data bad_ds --progress none\n{body}")
    assert isinstance(res.error_in_exec, RankError) and "all_reduce of float32 [2, 3]" in str(res.error_in_exec)
    res = run(shell, f"%%distrain --model free_net --data bad_ds --progress none --unchecked\n{body}")
    assert res.error_in_exec is None, res.error_in_exec


def test_a_name_bound_to_a_collective_is_checked_in_checked_cells_only(shell, trained):
    s = session_mod.current()
    s.run("import torch, torch.distributed as dist\nar_unchecked = dist.all_reduce", unchecked=True)
    s.run("from torch.distributed import all_reduce as ar_checked")
    mismatch = "t = torch.ones(2 + rank)\n{}(t)"
    for name in ("ar_unchecked", "ar_checked"):  # ar_unchecked was torch's own: a HangError after --hang-after
        with pytest.raises(RankError, match=re.escape("rank 0: all_reduce of float32 [2]; rank 1: all_reduce")):
            s.run(mismatch.format(name))
    # called in an --unchecked cell, the checked one passes the call on (it raised KeyError: 'all_reduce')
    assert s.run("t = torch.ones(2)\nar_checked(t)\nt.tolist()", unchecked=True) == ["[2.0, 2.0]"] * 2
    assert s.run("def f():\n    t = torch.ones(1)\n    ar_checked(t)\n    return t.item()\nf()") == ["2.0"] * 2


def test_pull_of_a_bad_name_is_a_usage_error(shell, trained):
    from IPython.core.error import UsageError

    for line in ("pull 0", "gather 1bad"):
        res = run(shell, f"%dist {line}")
        assert isinstance(res.error_in_exec, UsageError), (line, res.error_in_exec)


def test_a_pull_of_a_name_the_ranks_lack_suggests_only_what_exists(shell, dist_session, capsys):
    """pull("nosuch") said "push it with %dist push nosuch" though the notebook had no nosuch either."""
    assert run(shell, "%%dist\npl_losses = [rank]\nif rank == 0:\n    pl_only0 = 5").error_in_exec is None
    shell.user_ns["pl_lossez"] = 1
    capsys.readouterr()
    with pytest.raises(PlanError) as err:
        dist_session.pull("pl_losss")
    message = str(err.value)
    assert message.startswith("pull pl_losss: 'pl_losss' is not defined on ranks 0-1 (nearest there: "), message
    assert "pl_losses" in message.split("nor in the notebook")[0]
    assert "nor in the notebook (nearest there: pl_lossez" in message and "%%dist cell" in message
    assert "push" not in message
    res = run(shell, "%dist pull pl_lossez --rank 1")  # the notebook has it: push is the fix
    assert isinstance(res.error_in_exec, UsageError)
    assert "'pl_lossez' is not defined on rank 1" in str(res.error_in_exec)
    assert "the notebook has it: send it to the ranks with %dist push pl_lossez" in str(res.error_in_exec)
    res = run(shell, "%dist pull pl_only0")  # defined on rank 0 alone
    assert "'pl_only0' is not defined on rank 1" in str(res.error_in_exec)
    assert "rank 0 has it: %dist pull pl_only0 --rank 0" in str(res.error_in_exec)
    assert "push" not in str(res.error_in_exec) + capsys.readouterr().out
    assert run(shell, "%dist pull pl_losses").result == [[0], [1]]  # the cluster is usable


def test_a_pull_that_fails_on_the_rank_asked_names_that_rank(shell, capsys):
    """`%dist pull NAME --rank 1` of a value that cannot be pickled said it failed on rank 0."""
    assert run(shell, "%%dist\nimport threading\n_pl_lock = threading.Lock()").error_in_exec is None
    capsys.readouterr()
    res = run(shell, "%dist pull _pl_lock --rank 1")
    assert isinstance(res.error_in_exec, RankError)
    assert str(res.error_in_exec).startswith("pull _pl_lock failed on rank 1 on "), res.error_in_exec
    assert "rank 0" not in str(res.error_in_exec) + capsys.readouterr().out
    assert run(shell, "%dist pull rank --rank 1").result == 1  # the cluster is usable


@pytest.mark.parametrize("call, needle", [
    (lambda s: s.export(None), "directory must be a folder path (a str or pathlib.Path), got None"),
    (lambda s: s.export(123), "directory must be a folder path"),
    (lambda s: s.export("unused-export-dir", force="y"), "force must be True or False, got 'y'"),
    (lambda s: s.run("1", all_output="yes"), "all_output must be True or False, got 'yes'"),
    (lambda s: s.save(123), "directory must be a folder path"),
    (lambda s: s.load(123), "directory must be a folder path"),
    (lambda s: s.train(123, model="keep_net", data="bad_ds"), "code must be a string of Python source"),
    (lambda s: s.pull("keep_net", rank="0"), "--rank must be an integer rank between 0 and 1, got '0'"),
])
def test_python_api_arguments_of_the_wrong_type_are_named(shell, trained, tmp_path, monkeypatch, call, needle):
    """A wrong type is a PlanError naming the argument (before: a folder named 'None', a raw TypeError, 'the cell
    body is empty', a range error for a string)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PlanError) as err:
        call(session_mod.current())
    assert needle in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_cell_that_assigns_rank_has_it_set_back_and_is_told(shell, trained, capsys):
    """`rank = 0` or `for world_size in ...` in a %%dist cell rebound distnb's names on every rank for good: every
    later cell, training bodies too (`if rank == 1: ...`), read the user's value without a word."""
    capsys.readouterr()
    res = run(shell, "%%dist\nrank = 0\nfor world_size in range(1):\n    pass\ndef f():\n    local_rank = 5")
    assert res.error_in_exec is None, res.error_in_exec
    out = capsys.readouterr()
    said = "this cell assigned `rank`, `world_size`, which distnb sets on each rank (this rank's own); set back"
    assert (out.out + out.err).count(said) == 1, out  # the same line on each rank: shown once; f's local not named
    s = session_mod.current()
    assert s.run("(rank, world_size, local_rank)") == ["(0, 2, 0)", "(1, 2, 1)"]
    res = run(shell, "%%distrain --model keep_net --data bad_ds --epochs 1 --progress none\nx, y = batch\nrank = 7\n"
                     "loss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None, res.error_in_exec
    assert s.run("rank") == ["0", "1"]


def test_a_dist_cell_reading_a_name_only_the_notebook_defines_says_how_to_get_it_there(shell, trained):
    """A %%dist cell runs on the ranks as written (training bodies get their names pushed; it does not), and
    Python's NameError for `os`, imported in the notebook, did not say why."""
    run(shell, "import json as nb_only_json\nnb_only_value = 3")
    err = run(shell, "%%dist\nnb_only_json.dumps(1)").error_in_exec
    assert isinstance(err, RankError) and "NameError" in str(err), err
    assert ("nb_only_json is defined in the notebook, not on the ranks: a %%dist cell runs there as written; "
            "import json as nb_only_json in the cell") in str(err)
    err = run(shell, "%%dist\nnb_only_value + 1").error_in_exec
    assert "send the notebook's with %dist push nb_only_value" in str(err), err
    err = run(shell, "%%dist\nnowhere_at_all + 1").error_in_exec
    assert isinstance(err, RankError) and "defined in the notebook" not in str(err), err


def test_a_shape_error_on_an_epochs_short_last_batch_says_the_batch_was_short(shell, trained):
    """Code written for a full batch fails only on each epoch's short last batch (128 samples a rank in batches of 48:
    48, 48, 32), after the full ones trained, and torch's words alone did not say that batch was the short one."""
    run(shell, "torch.manual_seed(0)\nshort_net = nn.Sequential(nn.Linear(8, 2))")
    body = "x, y = batch\nx = x.view(48, 8)\nloss = F.cross_entropy(model(x), y)"
    err = run(shell, f"%%distrain --model short_net --data bad_ds --batch-size 48 --progress none\n{body}").error_in_exec
    assert isinstance(err, RankError) and "step 2" in str(err), err
    assert "[distnb] this step's batch held 32 samples, fewer than --batch-size 48" in str(err), err
    assert "--drop-last" in str(err) and "(the same error on each)" in str(err)
    ok = run(shell, f"%%distrain --model short_net --data bad_ds --batch-size 48 --drop-last --progress none\n{body}")
    assert ok.error_in_exec is None, ok.error_in_exec
    full = run(shell, "%%distrain --model short_net --data bad_ds --batch-size 48 --progress none\n"
                      "x, y = batch\nx = x.view(7, 8)\nloss = F.cross_entropy(model(x), y)").error_in_exec
    assert isinstance(full, RankError) and "[distnb]" not in str(full), full  # a full batch: torch's words alone


def test_a_batch_that_fails_to_load_is_not_called_short_after_a_short_one(shell, trained):
    """The short-batch note read the rank's `batch`, which still held the last batch of the previous cell (here
    short: 20 samples a rank in batches of 8) when the next batch failed to load: a false note sent the user to
    --drop-last."""
    run(shell, "class Ragged(torch.utils.data.Dataset):\n    def __init__(self, ragged):\n        self.ragged = ragged\n"
               "    def __len__(self):\n        return 40\n    def __getitem__(self, i):\n"
               "        return torch.randn(8 if (i % 3 or not self.ragged) else 7), i % 2\n"
               "good_rag, bad_rag = Ragged(False), Ragged(True)\nrag_net = nn.Linear(8, 2)")
    cell = "%%distrain --model rag_net --data {} --batch-size 8 --progress none\nx, y = batch\n" \
           "loss = F.cross_entropy(model(x), y)"
    assert run(shell, cell.format("good_rag")).error_in_exec is None
    err = run(shell, cell.format("bad_rag")).error_in_exec
    assert isinstance(err, RankError) and "cannot be batched" in str(err), err
    assert "fewer than --batch-size" not in str(err), err


def test_a_failing_cell_is_named_when_a_rank_holds_a_dead_weak_proxy(shell, trained):
    """The failure path walks every object on the rank: a weakref.proxy whose object is gone (torch.compile leaves
    such behind) raised ReferenceError there, so every failing cell after a --compile'd model said only
    "weakly-referenced object no longer exists" instead of its own error."""
    run(shell, "%%dist\nimport weakref\nclass _Gone:\n    pass\n_gone = _Gone()\n_dead_proxy = weakref.proxy(_gone)\n"
               "del _gone")
    err = run(shell, "%%distrain --model keep_net --data bad_ds --batch-size 32 --progress none\nx, y = batch\n"
                     "loss = F.cross_entropy(model(x), y).item()").error_in_exec
    assert isinstance(err, RankError) and "`loss` is a Python float, not a scalar tensor" in str(err), err
    run(shell, "%%dist\ndel _dead_proxy")


def test_an_exception_whose_str_raises_is_named_with_its_rank_and_step(shell, trained):
    """The failure path formats the error many times; a notebook exception class whose __str__ raises made the first
    of those raise, which skipped the rest of it: the failing step was reported as step 0 (and the group's teardown
    on that rank was skipped)."""
    run(shell, "class BadStr(Exception):\n    def __str__(self):\n        raise RuntimeError('no str')")
    said = "the cell raised BadStr, whose str() raised RuntimeError: no str"
    err = run(shell, "%%distrain --model keep_net --data bad_ds --batch-size 32 --progress none\nx, y = batch\n"
                     "if ctx.rank == 1 and ctx.step == 2:\n    raise BadStr()\n"
                     "loss = F.cross_entropy(model(x), y)").error_in_exec
    assert isinstance(err, RankError) and err.rank == 1 and said in str(err), err
    assert "at epoch" in str(err) and "step 2" in str(err), err
    err = run(shell, "%%dist\nclass BadStr2(BadStr):\n    pass\nif rank == 1:\n    raise BadStr2()").error_in_exec
    assert isinstance(err, RankError) and err.rank == 1 and "the cell raised BadStr2, whose str() raised" in str(err)
    assert session_mod.current().run("rank") == ["0", "1"]
