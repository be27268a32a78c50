"""``%dist export DIR``: the last training cell as a torchrun job, run here with ``torchrun --standalone``.

The job must give the cell's per-epoch losses (to 1e-5), save checkpoints that ``%dist load``
reads back into a notebook model, and every bad input must leave the notebook's model as it was.
"""

import json
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from IPython.core.error import UsageError

import distnb
from distnb.export import export
from support.data import blobs

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(distnb.__file__)))
BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
CLASS = '''
import torch
import torch.nn as nn

class ExportNet(nn.Module):
    """A notebook class: it travels by value, and model.py shows its source."""

    def __init__(self, width=12):
        super().__init__()
        self.hidden = nn.Linear(10, width)
        self.out = nn.Linear(width, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))
'''
CELL = "--model ex_net --data ex_data --epochs 3 --batch-size 8 --optimizer adam --lr 0.01 --seed 4 --progress none"


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def run_job(directory, *args, timeout=300):
    """``torchrun --standalone --nproc-per-node 2 train.py ARGS`` in ``directory``: (returncode, output).

    Its own session, so that on a timeout the whole group (torchrun and its ranks) is killed.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=ROOT)
    proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node", "2", "train.py", *args], cwd=directory,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the exported job ran longer than {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.fixture(scope="module")
def exported(shell, tmp_path_factory):
    """A 3-epoch DDP cell on a notebook class, exported and run with torchrun on 2 ranks."""
    ns = shell.user_ns
    shell.run_cell(CLASS)
    ns["ex_data"], ns["F"] = blobs(90, seed=2, num_features=10, num_classes=2), F
    torch.manual_seed(7)
    ns["ex_net"] = ns["ExportNet"]()
    start = params(ns["ex_net"]).clone()
    result = shell.run_cell_magic("distrain", CELL + " -o ex_result", BODY)
    trained = params(ns["ex_net"]).clone()
    directory = tmp_path_factory.mktemp("export") / "job"
    shell.run_line_magic("dist", f"export {directory}")
    assert torch.equal(params(ns["ex_net"]), trained)  # export reads the notebook's model, never writes it
    code, out = run_job(directory)
    return dict(result=result, start=start, trained=trained, directory=directory, code=code, out=out)


def test_the_job_gives_the_cells_per_epoch_losses(exported):
    directory, out = exported["directory"], exported["out"]
    assert exported["code"] == 0, out[-4000:]
    cell = exported["result"].epoch_losses
    assert len(cell) == 3 and cell[0] > cell[-1]
    written = json.loads((directory / "losses.json").read_text())
    assert written["epochs"] == [0, 1, 2] and written["world_size"] == 2
    for job, mine in zip(written["epoch_losses"], cell, strict=True):
        assert abs(job - mine) <= 1e-5, (written["epoch_losses"], cell)
    printed = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "distnb job: epoch " in line]
    assert len(printed) == 3 and all(abs(a - b) <= 1e-5 for a, b in zip(printed, cell))


def test_the_folder_holds_a_readable_job(exported):
    directory = exported["directory"]
    assert {"train.py", "options.json", "model.pkl", "model.py", "data.pt", "names.pkl", "job.sbatch"} <= \
        {p.name for p in directory.iterdir()}
    train = (directory / "train.py").read_text()
    assert "STEP = \"\"\"\\\nx, y = batch\nloss = F.cross_entropy(model(x), y)\n\"\"\"" in train
    assert "# %%distrain --model ex_net --data ex_data --epochs 3 --batch-size 8 --optimizer adam" in train
    assert "torchrun --standalone --nproc-per-node 2 train.py" in train and "distnb and torch" in train
    model = (directory / "model.py").read_text()
    assert "class ExportNet(nn.Module):" in model and "import torch.nn as nn" in model
    assert "self.out = nn.Linear(width, 2)" in model
    options = json.loads((directory / "options.json").read_text())
    assert options["plan"]["optimizer"] == "adam" and options["plan"]["seed"] == 4
    assert options["start"]["exact"] and options["names"] == ["F"] and options["data"]["path"] == "tensors"
    assert options["cell"]["world_size"] == 2


def test_the_sbatch_script_runs_srun_torchrun_with_the_rendezvous_from_slurm(exported, shell, tmp_path):
    text = (exported["directory"] / "job.sbatch").read_text()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=1\n" in text and "#SBATCH --ntasks-per-node=1" in text
    assert 'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 "$TORCHRUN"' in text
    assert '--nnodes "$SLURM_NNODES" --nproc-per-node 2' in text
    assert '--rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT"' in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text and 'train.py "$@"' in text
    assert f"cd {exported['directory']}" in text and TORCHRUN in text
    assert subprocess.run(["bash", "-n", str(exported["directory"] / "job.sbatch")]).returncode == 0
    shell.run_line_magic("dist", f"export {tmp_path / 'two'} --nodes 2 --nproc-per-node 1")
    two = (tmp_path / "two" / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2\n" in two and "--nproc-per-node 1 " in two


def test_the_jobs_checkpoint_loads_back_with_dist_load(exported, shell):
    assert exported["code"] == 0, exported["out"][-4000:]
    ns = shell.user_ns
    torch.manual_seed(11)
    ns["ex_back"] = ns["ExportNet"]()
    assert not torch.allclose(params(ns["ex_back"]), exported["trained"])
    shell.run_line_magic("dist", f"load {exported['directory'] / 'checkpoints'} --model ex_back")
    torch.testing.assert_close(params(ns["ex_back"]), exported["trained"], atol=1e-5, rtol=1e-5)
    newest = sorted((exported["directory"] / "checkpoints").glob("step_*"))[-1]
    meta = json.loads((newest / "distnb.json").read_text())
    assert meta["epoch"] == 3 and meta["optimizer"] == "adam" and meta["world_size"] == 2
    code, out = run_job(exported["directory"])  # run again as it was (a requeued job): nothing is left to train
    assert code == 0 and "already trained" in out, out[-4000:]
    assert sorted((exported["directory"] / "checkpoints").glob("step_*"))[-1] == newest
    code, out = run_job(exported["directory"], "--epochs", "4")  # 4 in all: it resumes and trains the 4th
    assert code == 0, out[-4000:]
    again = json.loads((exported["directory"] / "losses.json").read_text())
    assert again["epochs"] == [3] and again["resumed"] == str(newest) and "resuming from" in out


DATASET = '''
class ExportSet(torch.utils.data.Dataset):
    """A notebook Dataset: sent by value, loaded on the ranks with __getitem__ (here and in the job)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] * 0.5, self.y[i]
'''


def test_a_dataset_by_value_with_validation_gives_the_cells_losses(exported, shell, tmp_path):
    ns = shell.user_ns
    shell.run_cell(DATASET)
    train, val = blobs(60, seed=8, num_features=10, num_classes=2), blobs(30, seed=9, num_features=10, num_classes=2)
    ns["ex_set"], ns["ex_val"] = ns["ExportSet"](*train.tensors), val
    torch.manual_seed(3)
    ns["ex_d"] = ns["ExportNet"](width=6)
    result = shell.run_cell_magic("distrain", "--model ex_d --data ex_set --val-data ex_val --epochs 2 --batch-size 8 "
                                  "--optimizer sgd --lr 0.1 --drop-last --progress none", BODY)
    shell.run_line_magic("dist", f"export {tmp_path / 'job'}")
    assert {"data.pkl", "val.pt"} <= {p.name for p in (tmp_path / "job").iterdir()}
    code, out = run_job(tmp_path / "job")
    assert code == 0, out[-4000:]
    written = json.loads((tmp_path / "job" / "losses.json").read_text())
    assert max(abs(a - b) for a, b in zip(written["epoch_losses"], result.epoch_losses, strict=True)) <= 1e-5
    cell_val = [v["loss"] for v in result.val_history]
    assert len(cell_val) == 2 and max(abs(v["loss"] - c) for v, c in zip(written["val_history"], cell_val,
                                                                          strict=True)) <= 1e-5


MAKE = '''
def ex_make(rank, world_size):
    """Each rank's own part, made on the rank (here by the job too): make(rank, world_size) -> Dataset."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(24, 10, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
'''


def test_a_make_function_gives_the_cells_losses(exported, shell, tmp_path):
    ns = shell.user_ns
    shell.run_cell(MAKE)
    torch.manual_seed(4)
    ns["ex_f"] = ns["ExportNet"]()
    result = shell.run_cell_magic("distrain", "--model ex_f --data ex_make --epochs 2 --batch-size 8 --optimizer adam "
                                  "--lr 0.01 --progress none", BODY)
    shell.run_line_magic("dist", f"export {tmp_path / 'job'}")
    options = json.loads((tmp_path / "job" / "options.json").read_text())
    assert options["data"] == dict(name="ex_make", path="factory", file="data.pkl")
    code, out = run_job(tmp_path / "job")
    assert code == 0, out[-4000:]
    written = json.loads((tmp_path / "job" / "losses.json").read_text())
    assert max(abs(a - b) for a, b in zip(written["epoch_losses"], result.epoch_losses, strict=True)) <= 1e-5


def test_a_folder_that_is_not_empty_needs_force(exported, shell, tmp_path):
    ns = shell.user_ns
    kept = params(ns["ex_net"]).clone()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"is not empty \(notes.txt\).*--force"):
        shell.run_line_magic("dist", f"export {tmp_path}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    shell.run_line_magic("dist", f"export {tmp_path} --force")
    assert (tmp_path / "train.py").exists() and (tmp_path / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        shell.run_line_magic("dist", f"export {tmp_path / 'file'}")
    with pytest.raises(UsageError, match="cannot create"):
        shell.run_line_magic("dist", f"export {tmp_path / 'file' / 'below'}")
    with pytest.raises(UsageError, match="--nodes must be a whole number of at least 1"):
        shell.run_line_magic("dist", f"export {tmp_path / 'new'} --nodes 0")
    assert not (tmp_path / "new").exists()
    assert torch.equal(params(ns["ex_net"]), kept)


def test_data_changed_since_the_cell_is_refused(exported, shell, tmp_path):
    ns = shell.user_ns
    ns["ex_moved"] = blobs(40, seed=3, num_features=10, num_classes=2)
    torch.manual_seed(5)
    ns["ex_m"] = ns["ExportNet"]()
    shell.run_cell_magic("distrain", "--model ex_m --data ex_moved --epochs 1 --batch-size 8 --progress none", BODY)
    ns["ex_moved"].tensors[0].mul_(2)
    with pytest.raises(UsageError, match="--data ex_moved changed in the notebook since the training cell ran"):
        shell.run_line_magic("dist", f"export {tmp_path / 'job'}")
    assert not (tmp_path / "job").exists()


def test_names_and_a_validation_dataset_changed_since_the_cell_are_refused(exported, shell, tmp_path):
    """names.pkl and val.pt were written from the notebook as it is at export: a global the --lr-schedule function
    reads, a dict the body reads, or a --val-data Dataset's attribute changed after the cell gave a job that trained
    (or validated) otherwise, while export said it gives the cell's losses."""
    shell.run_cell("EX_STEP = 3\ndef ex_sched(optimizer, total_steps, gamma=0.5):\n"
                   "    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=EX_STEP, gamma=gamma)\n"
                   "ex_cfg = {'scale': 1.0}\n"
                   "class ExShifted(torch.utils.data.Dataset):\n    def __init__(self, x, y):\n"
                   "        self.x, self.y, self.shift = x, y, 0.0\n    def __len__(self):\n        return len(self.x)\n"
                   "    def __getitem__(self, i):\n        return self.x[i] + self.shift, self.y[i]")
    ns = shell.user_ns
    ns["ex_n_data"] = blobs(40, seed=3, num_features=10, num_classes=2)
    vx, vy = blobs(16, seed=4, num_features=10, num_classes=2).tensors
    ns["ex_val"] = ns["ExShifted"](vx, vy)
    body = "x, y = batch\nloss = F.cross_entropy(model(x), y) * ex_cfg['scale']"
    cases = (("EX_STEP = 100", "the notebook function ex_sched changed"),
             ("ex_sched.__defaults__ = (0.9,)", "the notebook function ex_sched changed"),  # in place: same object
             ("ex_cfg['scale'] = 3.0", "the notebook name ex_cfg changed"),
             ("ex_val.shift = 5.0", "--val-data ex_val changed"))
    for change, says in cases:
        shell.run_cell("EX_STEP = 3\nex_cfg['scale'] = 1.0\nex_val.shift = 0.0\nex_sched.__defaults__ = (0.5,)")
        ns["ex_n"] = ns["ExportNet"]()
        shell.run_cell_magic("distrain", "--model ex_n --data ex_n_data --val-data ex_val --epochs 1 --batch-size 8 "
                                         "--lr-schedule ex_sched --progress none", body)
        shell.run_cell(change)
        with pytest.raises(UsageError, match=f"{says} in the notebook since the training cell ran"):
            shell.run_line_magic("dist", f"export {tmp_path / 'job'}")
        assert not (tmp_path / "job").exists()
    shell.run_cell("EX_STEP = 3\nex_cfg['scale'] = 1.0\nex_val.shift = 0.0\nex_sched.__defaults__ = (0.5,)")  # as read
    shell.run_line_magic("dist", f"export {tmp_path / 'job'}")
    assert (tmp_path / "job" / "names.pkl").exists()


def test_a_cell_that_went_on_is_exported_from_the_notebooks_weights_after_it(exported, shell, tmp_path, capsys):
    ns = shell.user_ns
    ns["ex_c"] = ns["ExportNet"]()
    ns["ex_c_data"] = blobs(40, seed=3, num_features=10, num_classes=2)
    line = "--model ex_c --data ex_c_data --epochs 1 --batch-size 8 --optimizer adam --progress none"
    shell.run_cell_magic("distrain", line, BODY)
    shell.run_cell_magic("distrain", line.replace("--optimizer adam ", ""), BODY)  # goes on: Adam's live state
    after = params(ns["ex_c"]).clone()
    capsys.readouterr()
    info = distnb.session.current().export(str(tmp_path / "job"))
    assert not info["exact"] and "--reset" in info["why"] and "fresh optimizer" in info["why"]
    assert "went on with the ranks' live model" in capsys.readouterr().out
    options = json.loads((tmp_path / "job" / "options.json").read_text())
    assert options["start"] == dict(epoch=2, epoch_samples=0, steps=6, epoch_step=0, exact=False,
                                    why=info["why"])  # 2 cells of 40 / 2 ranks / 8 = 3 steps
    from distnb.engine.transport import wire

    payload, descs, buffers = pickle.loads((tmp_path / "job" / "model.pkl").read_bytes())
    torch.testing.assert_close(params(wire.loads(payload, descs, buffers)), after, rtol=0, atol=0)
    with torch.no_grad():
        ns["ex_c"].out.bias.add_(1.0)  # changed after the cell: the job would not go on from the cell's end
    with pytest.raises(UsageError, match="--model ex_c changed in the notebook since the training cell ran"):
        shell.run_line_magic("dist", f"export {tmp_path / 'again'}")


def test_export_after_dist_load_goes_on_from_the_loaded_weights_not_a_changed_claim(shell, tmp_path, capsys):
    """%dist load after a cell that went on: export said "--model changed in the notebook" (the load's weights)."""
    ns = shell.user_ns
    shell.run_cell(CLASS)
    ns["ex_l"], ns["F"] = ns["ExportNet"](), F
    ns["ex_l_data"] = blobs(40, seed=5, num_features=10, num_classes=2)
    line = "--model ex_l --data ex_l_data --epochs 1 --batch-size 8 --progress none"
    shell.run_cell_magic("distrain", line, BODY)
    shell.run_line_magic("dist", f"save {tmp_path / 'ck'}")
    shell.run_cell_magic("distrain", line, BODY)  # goes on with the ranks' live model
    shell.run_line_magic("dist", f"load {tmp_path / 'ck'}")
    loaded = params(ns["ex_l"]).clone()
    capsys.readouterr()
    info = distnb.session.current().export(str(tmp_path / "job"))
    assert not info["exact"] and "%dist load put the checkpoint" in info["why"] and "from epoch 1" in info["why"]
    options = json.loads((tmp_path / "job" / "options.json").read_text())
    assert options["start"] == dict(epoch=1, epoch_samples=0, steps=3, epoch_step=0, exact=False, why=info["why"])
    from distnb.engine.transport import wire

    payload, descs, buffers = pickle.loads((tmp_path / "job" / "model.pkl").read_bytes())
    torch.testing.assert_close(params(wire.loads(payload, descs, buffers)), loaded, rtol=0, atol=0)
    with torch.no_grad():
        ns["ex_l"].out.bias.add_(1.0)  # a change after the load is one, and the error says since when
    with pytest.raises(UsageError, match="--model ex_l changed in the notebook since %dist load .*ck"):
        shell.run_line_magic("dist", f"export {tmp_path / 'again'}")


@pytest.mark.parametrize("start", ["load", "first cell"])
def test_a_meta_model_is_refused_naming_where_its_weights_are(shell, tmp_path, capsys, start):
    """A model built on meta: export said the job goes on "from the notebook's weights" (it has none) and wrote a
    model.pkl of meta tensors, a job that crashed on the CPU (and would start from a fresh initialisation on a GPU)."""
    from safetensors.torch import save_file

    ns = shell.user_ns
    name = f"ex_meta_{start.replace(' ', '_')}"
    torch.manual_seed(3)
    source = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    with torch.device("meta"):
        ns[name] = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    ns["ex_meta_data"], ns["F"] = blobs(40, seed=5, num_features=10, num_classes=2), F
    if start == "load":
        (tmp_path / "weights").mkdir()
        save_file(source.state_dict(), str(tmp_path / "weights" / "model.safetensors"))
        shell.run_line_magic("dist", f"load {tmp_path / 'weights'} --model {name}")
    shell.run_cell_magic("distrain", f"--model {name} --data ex_meta_data --epochs 1 --batch-size 8 --progress none",
                         BODY)
    capsys.readouterr()
    with pytest.raises(UsageError) as caught:
        shell.run_line_magic("dist", f"export {tmp_path / 'job'}")
    message = str(caught.value)
    assert f"--model {name} is on the meta device in the notebook (4 of its 4 tensors have no data): the kernel " \
        "holds none of their weights (they exist on the ranks only)" in message
    assert f"build {name} with its weights in the notebook" in message and "%dist save DIR" in message
    assert "notebook's weights" not in message + capsys.readouterr().out
    assert not (tmp_path / "job").exists() and all(p.is_meta for p in ns[name].parameters())


def test_a_model_too_large_to_keep_a_copy_of_is_exported_from_its_weights_after_the_cell(exported, shell, tmp_path,
                                                                                        monkeypatch):
    from distnb.train import record

    ns = shell.user_ns
    ns["ex_big"] = ns["ExportNet"]()
    ns["ex_big_data"] = blobs(40, seed=4, num_features=10, num_classes=2)
    monkeypatch.setattr(record, "KEEP_START_BYTES", 100)  # this model's weights are larger than that
    shell.run_cell_magic("distrain", "--model ex_big --data ex_big_data --epochs 1 --batch-size 8 --progress none",
                         BODY)
    assert export.last().model_packed is None  # no copy of its starting weights in the kernel
    info = distnb.session.current().export(str(tmp_path / "job"), quiet=True)
    assert not info["exact"] and "is larger than the 0 MiB of starting weights the kernel keeps" in info["why"]
    assert "--reset" not in info["why"]  # a --reset would not help: the size is the reason


def test_data_made_on_the_ranks_cannot_be_exported(exported, shell, tmp_path):
    ns = shell.user_ns
    shell.run_cell_magic("dist", "", "import torch\n_g = torch.Generator().manual_seed(0)\nex_ranks = "
                         "torch.utils.data.TensorDataset(torch.randn(32, 10, generator=_g), "
                         "torch.randint(0, 2, (32,), generator=_g))")
    ns["ex_r"] = ns["ExportNet"]()
    shell.run_cell_magic("distrain", "--model ex_r --data ex_ranks --data-on-ranks --epochs 1 --batch-size 8 "
                         "--progress none", BODY)
    trained = params(ns["ex_r"]).clone()
    with pytest.raises(UsageError, match="--data ex_ranks was made on the ranks by a %%dist cell "
                                         r"\(--data-on-ranks\).*make\(rank, world_size\)"):
        shell.run_line_magic("dist", f"export {tmp_path / 'job'}")
    assert not (tmp_path / "job").exists() and torch.equal(params(ns["ex_r"]), trained)


def test_export_before_any_training_cell_names_the_fix(tmp_path):
    """A fresh kernel (no cluster either): a UsageError that says to run a %%distrain cell first."""
    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "from IPython.core.error import UsageError\n"
            "sh = InteractiveShell.instance()\n"
            "sh.run_line_magic('load_ext', 'distnb')\n"
            "try:\n"
            f"    sh.run_line_magic('dist', 'export {tmp_path / 'job'}')\n"
            "except UsageError as exc:\n"
            "    print('UsageError:', exc)\n")
    env = dict(os.environ, DISTNB_ZYGOTE="0", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "UsageError: no training cell has run in this kernel yet: run a %%distrain cell" in out.stdout, \
        out.stdout + out.stderr
    assert not (tmp_path / "job").exists()
