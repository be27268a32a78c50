"""``%dist export DIR``: the last training cell as a job that runs without a notebook.

Each training cell that returns a result leaves a :class:`Cell` here (:func:`capture` at its
start, :func:`remember` at its end): the plan as the ranks got it, the body, the model *as the
ranks received it at the cell's start* (packed by value with a copy of its weights, since the
cell's end writes the trained weights into the notebook's model in place), the data and the
notebook names the body and the options read (by reference, with the data's fingerprint),
and the cluster's shape. :func:`write` turns it into a folder:

- ``train.py``: the torchrun script (the body as text; it calls :func:`distnb.engine.job.main`);
- ``options.json``: the cell's options (TrainPlan), where it starts, the cluster it ran on;
- ``model.pkl`` (the class and starting weights by value) and ``model.py`` (the class source, to read);
- ``data.pt`` (tensors: the columns, cut into the same shards by the job) or ``data.pkl``
  (a Dataset or ``make`` by value), ``val.pt``; ``names.pkl`` (the names the body reads);
- ``job.sbatch``: the same job under Slurm, ``srun torchrun`` with the rendezvous on the first node.

Nothing here touches the ranks or the notebook's objects.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shlex
import shutil
import sys
import time
import types
import weakref
from dataclasses import dataclass, field
from importlib import metadata

from distnb.core import options
from distnb.core.errors import PlanError
from distnb.core.options import check_flags, check_path
from distnb.core.plan import TrainPlan
from distnb.core.saveformats import check_format
from distnb.core.tables import count
from distnb.train import jobfiles
from distnb.train.record import (
    _LAST,
    KEEP_START_BYTES,
    Cell,
    _capture,
    _names_read,
    capture,
    class_source,
    last,
    loaded,
    notebook_classes,
    remember,
)
from distnb.transfer import valsets
from distnb.transfer.transfer import free_names, pack_named

#: Files :func:`write` may put into the folder (``--force`` overwrites only these).
FILES = ("train.py", "options.json", "model.pkl", "model.py", "data.pt", "data.pkl", "val.pt", "names.pkl",
         "job.sbatch")


def model_source(cell: Cell) -> str:
    """``model.py``: the notebook's classes the model is made of, with the imports of the modules they use."""


    sources = []
    for cls in cell.classes:
        src = class_source(cls)
        sources.append(src.rstrip() + "\n" if src else f"# class {cls.__name__}: its source was not found in the "
                       "notebook's cells (it is in model.pkl by value)\n")
    used = set().union(set(), *(free_names(s) for s in sources if not s.startswith("#")))
    modules = {n: v for n, v in cell.ns.items() if n in used and isinstance(v, types.ModuleType)}
    lines = [f"import {v.__name__}" if n == v.__name__ else f"import {v.__name__} as {n}"
             for n, v in sorted(modules.items())]
    written = {c.__name__ for c in cell.classes}
    other = sorted(n for n in used if n in cell.ns and n not in modules and n not in written)
    shown = cell.model_repr.replace('"""', "'''").splitlines()
    shown = shown[:40] + (["..."] if len(shown) > 40 else [])
    head = (f'"""--model {cell.plan.model}: the classes the notebook defined it with, for reading.\n\n'
            "The job does not import this file: it loads model.pkl, which holds these classes by value\n"
            "and the weights the job starts from (options.json, \"start\"). The model:\n\n"
            + "\n".join("    " + line for line in shown) + '\n"""\n')
    note = f"# the classes also read these notebook names (in model.pkl by value): {', '.join(other)}\n" if other \
        else ""
    if not cell.classes:
        note += (f"# {cell.model_class.__module__}.{cell.model_class.__qualname__} is not a notebook class: "
                 "nothing to show but the model above\n")
    return head + "\n".join(lines) + ("\n" if lines else "") + note + "\n\n" + "\n\n".join(sources)


def cli_line(plan_dict: dict) -> str:
    """The ``%%distrain`` options of ``plan_dict`` that differ from their defaults, as flags."""


    parts = []
    for f, opt in options.declared(TrainPlan):
        value = plan_dict.get(f.name)
        if not opt.cli or (f.default is not dataclasses.MISSING and value == f.default):
            continue
        flag = options.flags_of(f, opt)[0]
        if opt.kind == "flag":
            parts.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            parts.append(f"{flag} {','.join(map(str, value)) if isinstance(value, (list, tuple)) else value}")
    return " ".join(parts)


def _body_literal(code: str) -> str:
    """``code`` as a readable Python literal: a triple-quoted block when it can be one, else its repr."""
    text = code.strip("\n") + "\n"
    if '"""' in text or "\\" in text or text.endswith('"'):
        return repr(text)
    return '"""\\\n' + text + '"""'  # the backslash: the body starts on the next line, as typed


def train_script(cell: Cell, options_line: str, launch: str) -> str:
    """``train.py``: a torchrun script that runs the cell's body with distnb's own rank-side loop."""


    try:
        version = metadata.version("distnb")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        version = "(not installed)"

    c = cell.cluster
    start = ("from the weights the cell started from, a fresh optimizer, epoch 0: it gives the cell's per-epoch "
             "losses" if cell.start["exact"] else "otherwise than the cell did: " + cell.start["why"])
    return f'''"""The %%distrain cell of {cell.when} as a job that runs without a notebook (distnb {version} export).

Run (this folder; distnb and torch must be installed where it runs, the versions the notebook had
are safest):

    {launch}
    sbatch job.sbatch                      # Slurm: srun starts torchrun on every node

The cell ran on {count(c["world_size"], "rank")} ({c["backend"]}, {c["device"]}, {count(c["threads"], "thread")} each). Each
process torchrun starts becomes a rank as a notebook engine does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT from torchrun), gets the model, the data and the names below as the kernel sends them, and
runs distnb's training loop (distnb.engine.train.loop.train) on the same plan, seed and shards. The job starts
{start}.

Rank 0 prints each epoch's loss (the mean over all ranks) and writes them to losses.json; the model,
optimizer and position are saved as distnb checkpoints in checkpoints/ (at each epoch's end unless
--checkpoint-every), which `%dist load DIR/checkpoints --model {cell.plan.model}` loads into a notebook. Run
again with checkpoints/ there and the job resumes from the newest one (delete it to start over).

Options: python train.py --help (--epochs, --checkpoint-dir, --checkpoint-every, --losses, --backend, --format).
Files: options.json (the cell's options: edit them there), model.pkl (the model by value, as the ranks
received it) and model.py (its classes, to read), {_data_files(cell)}{", names.pkl (" + ", ".join(cell.names) + ")" if cell.names else ""}.
"""

import os

from distnb.engine import job

# %%distrain {options_line}{_checkpoint_note(cell)}
STEP = {_body_literal(cell.code)}

if __name__ == "__main__":
    job.run(os.path.dirname(os.path.abspath(__file__)), STEP)  # distnb.engine.job: the ranks, the loop
'''


def _on_path() -> str:
    """Where this environment's ``torchrun`` is, when the shell's PATH would not find it (a venv not activated)."""

    mine = os.path.join(os.path.dirname(sys.executable), "torchrun")
    found = shutil.which("torchrun")
    if not os.path.exists(mine) or (found and os.path.realpath(found) == os.path.realpath(mine)):
        return ""
    other = "" if found is None else ", which finds another"
    return f" (torchrun is {mine}: this environment's bin is not on PATH{other})"


def _checkpoint_note(cell) -> str:
    """A comment line under the cell's options when it had --checkpoint-dir: the job writes to checkpoints/ instead."""
    if not cell.plan.checkpoint_dir:
        return ""
    return "\n# (the job saves its checkpoints in checkpoints/ of this folder, not in the cell's --checkpoint-dir)"


def _data_files(cell) -> str:
    data = {"tensors": "data.pt (the tensors of --data; the job deals each rank its shard as the kernel did)",
            "factory": f"data.pkl ({cell.plan.data}, the function make(rank, world_size) by value)"}.get(
        cell.data_path, f"data.pkl (the {type(cell.data_obj).__name__} {cell.plan.data} by value)")
    return data + (", val.pt (--val-data)" if cell.plan.val_data else "")


def sbatch_script(cell: Cell, directory: str, nodes: int, per_node: int) -> str:
    """``job.sbatch``: the same job under Slurm (one torchrun per node, rendezvous on the first node)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    gpus = f"#SBATCH --gpus-per-node={per_node}\n" if cell.cluster["device"] == "cuda" else ""
    threads = cell.cluster["threads"]
    return f'''#!/bin/bash
# The %%distrain cell of {cell.when} as a Slurm job (distnb export): srun starts one torchrun on
# each of {nodes} node(s), each torchrun {per_node} rank(s): {nodes * per_node} in all (the cell ran on {cell.cluster["world_size"]}).
# Submit from anywhere: sbatch {os.path.join(directory, "job.sbatch")} [train.py options, e.g. --epochs 20]
#SBATCH --job-name=distnb-{cell.plan.model}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={max(1, per_node * threads)}
{gpus}#SBATCH --output={os.path.join(directory, "slurm-%j.out")}
set -euo pipefail
cd {_quote(directory)}
TORCHRUN=${{TORCHRUN:-{_quote(torchrun) if os.path.exists(torchrun) else "torchrun"}}}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{threads}}}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${{DISTNB_RDZV_PORT:-29500}}
srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 "$TORCHRUN" \\
    --nnodes "$SLURM_NNODES" --nproc-per-node {per_node} \\
    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" \\
    train.py "$@"
'''


def _quote(path: str) -> str:

    return shlex.quote(path)


def _placement(cell, nodes, per_node) -> tuple:
    world = cell.cluster["world_size"]
    for flag, value in (("--nodes", nodes), ("--nproc-per-node", per_node)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanError(f"{flag} must be a whole number of at least 1, got {value!r}")
    nodes = nodes or (cell.cluster["num_nodes"] if per_node is None else max(1, world // per_node))
    return nodes, per_node or max(1, -(-world // nodes))


def contents(cell: Cell, directory: str, nodes=None, per_node=None, save_format: str = "dcp") -> dict:
    """Every file of the export, name -> bytes, built before anything is written (PlanError if one cannot be)."""

    nodes, per_node = _placement(cell, nodes, per_node)
    plan = cell.plan.to_dict()
    if nodes == 1:
        launch = f"torchrun --standalone --nproc-per-node {per_node} train.py"
    else:
        launch = (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d --rdzv-endpoint "
                  "FIRST_NODE:29500 train.py   # on every node")
    if cell.plan.load:  # the ranks read those weights; the job would start from the notebook's instead
        raise PlanError(f"the last training cell read --load {cell.plan.load} on the ranks, and its job would start "
                        "from the notebook's weights instead: run one more %%distrain cell without --load (it goes on "
                        "from the loaded weights), then %dist export")
    files = {}
    data_name, files_data = jobfiles.data_file(cell)
    files[data_name] = files_data
    data = dict(name=cell.plan.data, path=cell.data_path, file=data_name)
    val = None
    if cell.plan.val_data:
        if valsets.is_made_on_ranks(cell.val_obj):
            raise PlanError(f"--val-data {cell.plan.val_data} is a function the ranks call (make(rank, world_size)): "
                            "export writes a validation set of tensors or a Dataset; give the cell one, then export")
        val_obj = valsets.kernel_form(cell.plan.val_data, cell.val_obj)  # an IterableDataset as the ranks got it
        files["val.pt"] = jobfiles.tensor_file(cell.plan.val_data, val_obj, cell.val_fp, "--val-data")
        val = dict(name=cell.plan.val_data, path="tensors", file="val.pt")
    jobfiles.names_unchanged(cell)
    if cell.names:
        files["names.pkl"] = pickle.dumps(pack_named("the names the training body reads", cell.names), protocol=5)
    files["model.pkl"] = pickle.dumps(jobfiles.model_packed(cell), protocol=5)
    files["model.py"] = model_source(cell).encode()
    options = dict(exported=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), cell_ran=cell.when,
                   plan=dict(plan, checkpoint_dir=None, report_interval=1.0), data=data, val_data=val,
                   names=sorted(cell.names), start=cell.start, cell=dict(cell.cluster, epoch_losses=cell.epoch_losses),
                   keep_global_batch=cell.batch_rewrite, save=dict(format=save_format),
                   launch=dict(nodes=nodes, nproc_per_node=per_node, command=launch))
    files["options.json"] = (json.dumps(options, indent=1) + "\n").encode()
    files["train.py"] = train_script(cell, cli_line(plan), launch).encode()
    files["job.sbatch"] = sbatch_script(cell, directory, nodes, per_node).encode()
    return files


def _ready(directory: str, force: bool) -> list:
    """Make ``directory`` ready to write (PlanError naming the fix); returns what was in it."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise PlanError(f"{directory} is a file, not a folder: give %dist export a folder (new, or empty)")
    present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    if present and not force:
        shown = ", ".join(present[:6]) + (", ..." if len(present) > 6 else "")
        raise PlanError(f"{directory} is not empty ({shown}): give %dist export a new folder, or pass --force to "
                        "overwrite the files an export writes there")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise PlanError(f"cannot create {directory}: {exc.strerror or exc}; give %dist export a folder you can "
                        "write") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PlanError(f"{directory} is not writable: give %dist export a folder you can write")
    return present


def write(directory: str, force: bool = False, nodes=None, nproc_per_node=None, quiet: bool = False,
          save_format: str = "dcp") -> dict:
    """Write the last training cell into ``directory`` as a torchrun job (see :meth:`distnb.session.Session.export`)."""

    cell = last()
    directory = os.path.abspath(os.path.expanduser(str(directory)))
    files = contents(cell, directory, nodes, nproc_per_node, save_format)
    present = _ready(directory, force)
    for stale in set(present) & set(FILES) - set(files):  # an earlier export's data.pkl, say
        os.remove(os.path.join(directory, stale))
    for name, data in files.items():
        tmp = os.path.join(directory, f".{name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(directory, name))
    os.chmod(os.path.join(directory, "job.sbatch"), 0o755)
    launch = json.loads(files["options.json"])["launch"]["command"]
    if not quiet:
        plan = cell.plan
        print(f"distnb: exported the %%distrain cell of {cell.when} (--model {plan.model} --data {plan.data}, "
              f"{plan.strategy} on {count(cell.cluster['world_size'], 'rank')}, {count(plan.epochs, 'epoch')}) to "
              f"{directory}: {', '.join(sorted(files))}. Run it there: {launch}, or sbatch job.sbatch{_on_path()}")
        if cell.batch_rewrite:
            b = cell.batch_rewrite
            print(f"distnb: the job trains --batch-size {b['trained'][0]} --accumulate {b['trained'][1]} per rank on "
                  f"{count(b['world'], 'rank')}, as the cell did, not the cell's own --batch-size {b['written'][0]} "
                  f"--accumulate {b['written'][1]}: those were written for {count(b['written_for'], 'rank')}, and "
                  f"%dist scale --keep-global-batch kept their global batch {b['global_batch']} (options.json: "
                  "keep_global_batch)")
        print("distnb: " + ("it starts from the weights the cell started from with a fresh optimizer, as the cell "
                            "did, so it gives the cell's per-epoch losses" if cell.start["exact"] else
                            cell.start["why"]))
        from distnb.engine.train import checkpoint  # loads numpy, torch: at first use, not when this module is imported

        if checkpoint.latest(os.path.join(directory, "checkpoints")):
            print(f"distnb: {directory}/checkpoints holds checkpoints of an earlier run: the job resumes from the "
                  "newest one (delete the folder to start from the cell's start)")
    return dict(directory=directory, files=sorted(files), command=launch, exact=cell.start["exact"],
                why=cell.start["why"])


def session_export(session, directory: str, force: bool = False, nodes=None, nproc_per_node=None,
                   quiet: bool = False, format: str = "dcp") -> dict:  # noqa: A002 - the magic's --format
    """Write the last training cell into ``directory`` as a job that runs without a notebook (``%dist export``).

    ``Session.export``. The folder gets ``train.py`` (run it with ``torchrun --standalone
    --nproc-per-node N train.py``), ``options.json``, ``model.pkl`` and ``model.py``, the data (``data.pt`` or
    ``data.pkl``, ``val.pt``), ``names.pkl`` and ``job.sbatch`` (Slurm: ``srun torchrun``). The
    job runs distnb's own training loop. A cell whose model was sent fresh to the ranks (its first
    cell, ``--reset``, a changed model, after ``%dist restart``) is exported from the weights it
    started from, and the job gives the cell's per-epoch losses; a cell that went on with the
    ranks' live model and optimizer is exported from the notebook's weights after it, with a fresh
    optimizer (the kernel never holds the ranks' optimizer state). The job saves distnb checkpoints
    that ``%dist load`` reads. Works with the cluster stopped too: nothing is sent to the ranks and
    the notebook's objects are not touched.

    Parameters
    ----------
    session : Session
        The session (unused: the kernel's last training cell is exported, whichever session ran it).
    directory : str
        A new or empty folder (created).
    force : bool
        Write into a folder that is not empty, replacing the files an export writes.
    nodes, nproc_per_node : int, optional
        The job's shape in ``job.sbatch`` and the printed command (default: the cell's hosts and
        ranks per host). Given one, the other defaults to what keeps the cell's world size (so the
        job's shards, and its losses, are the cell's): ``nproc_per_node=1`` for a 2-rank cell is 2 nodes.
    quiet : bool
        Print nothing.
    format : {"dcp", "safetensors"}
        What the job saves when it ends besides its DCP checkpoints: ``"safetensors"`` writes the trained
        model as a Hugging Face folder in ``model/`` (a peft model: its adapters), as ``%dist save DIR
        --format safetensors`` does; ``train.py --format`` and ``--save-dir`` change it.

    Returns
    -------
    dict
        directory, files, command (how to run it), exact (whether it gives the cell's losses), why (if not).

    Raises
    ------
    PlanError
        No training cell has ended yet; the folder is a file, not empty (without ``force``) or not
        writable; ``--data`` was made on the ranks (``--data-on-ranks``) or changed since the cell;
        something the cell read cannot be pickled; a bad ``nodes``/``nproc_per_node``.
    """

    check_flags(force=force, quiet=quiet)
    fmt = check_format(format, False)
    return write(check_path("directory", directory), force=force, nodes=nodes, nproc_per_node=nproc_per_node,
                 quiet=quiet, save_format=fmt)
