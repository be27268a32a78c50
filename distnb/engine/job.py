"""An exported training cell run as a job: torchrun starts the ranks, this module trains them.

``%dist export DIR`` (:mod:`distnb.export.export`) writes a cell's model, data, names and options to
DIR and a ``train.py`` that calls :func:`main` here. Each process torchrun starts becomes a rank
as an engine does (:func:`join`: rank, world size and local rank from torchrun's environment,
the device, the threads, the process group), receives the model, the data and the names the
way an engine receives them from the kernel (``install.install_model``, ``shards.install_shard`` with
the shard the kernel would deal it, ``datasets.install_dataset``), and runs ``loop.train``: the
same loop, seeds, sharding and strategies as a ``%%distrain`` cell. Rank 0 prints each epoch's
loss (the mean over all ranks) and writes them to ``losses.json``; the trained state is saved
as distnb checkpoints (torch.distributed.checkpoint, ``step_*`` folders) that ``%dist load``
reads in a notebook.

On a GPU node local rank ``i`` computes on GPU ``i`` (nccl) when the node has one for every local
rank, else every rank computes on CPU (gloo): the cluster's rule.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import socket
import sys
import time
import traceback

from distnb.core import options
from distnb.core.plan import ClusterSpec, TrainPlan
from distnb.core.saveformats import FORMATS, MAX_SHARD_SIZE, shard_bytes
from distnb.engine.process import runtime
from distnb.engine.transport import report

#: Files of an exported cell (written by distnb.export.export, read here).
OPTIONS, MODEL, NAMES, LOSSES = "options.json", "model.pkl", "names.pkl", "losses.json"
#: Where ``--format safetensors`` writes the trained model when ``--save-dir`` is not given (under the export folder).
SAVED = "model"
#: Where the job's checkpoints go when ``--checkpoint-dir`` is not given (under the export folder).
CHECKPOINTS = "checkpoints"
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class JobError(RuntimeError):
    """The job cannot run as asked (not under torchrun, files missing); the message names the fix."""


def _declared(parser, cls, name: str, default, note: str) -> None:
    """Add option ``name`` of the dataclass ``cls`` to ``parser`` as its declaration says (flag, type, choices, help).

    ``note`` ends the help with what the job does when it is not given (``default``). The checks of
    ``minimum`` are :func:`_arguments`'s (argparse's own message, as for any bad value).
    """
    field, opt = next((f, o) for f, o in options.declared(cls) if f.name == name)
    kinds = {"int": int, "float": float, "path": str, "text": str, "word": str, "choice": str}
    extra = {"choices": opt.choices} if opt.kind == "choice" else {}
    parser.add_argument(*options.flags_of(field, opt), dest=name, type=kinds[opt.kind], default=default,
                        help=f"{opt.help}; {note}".replace("%", "%%"), **extra)  # argparse %-formats help


def _arguments(argv, spec) -> argparse.Namespace:
    plan = spec["plan"]
    p = argparse.ArgumentParser(prog="train.py", description=f"distnb export of a %%distrain cell (--model "
                                f"{plan['model']} --data {plan['data']}); run it with torchrun --nproc-per-node "
                                f"{spec['cell']['world_size']} train.py")
    p.add_argument("--epochs", type=int, default=plan["epochs"],
                   help=f"epochs the job trains in all, from where the cell started (the cell's: {plan['epochs']}); "
                   "a run again (a requeued job) resumes from the newest checkpoint and trains only what is left")
    _declared(p, TrainPlan, "checkpoint_dir", None, f"the job's default: {CHECKPOINTS}/ beside train.py; %dist load "
              "DIR reads them in a notebook")
    every = plan["checkpoint_every"]
    _declared(p, TrainPlan, "checkpoint_every", every, f"the job's default: the cell's ({every})" if every is not None
              else "the job's default: the cell's (at the end of every epoch)")
    p.add_argument("--losses", default=None, help=f"JSON file rank 0 writes the epochs' losses to (default: "
                   f"{LOSSES} beside train.py)")
    _declared(p, ClusterSpec, "backend", None, "the job's default: nccl when each rank has a GPU of its own, "
              "else gloo")
    _save_arguments(p, spec)
    args = p.parse_args(argv)
    if args.epochs < 1 or (args.checkpoint_every is not None and args.checkpoint_every < 1):
        p.error("--epochs and --checkpoint-every must be at least 1")
    return args


def read_options(directory: str) -> dict:
    """``options.json`` of an exported cell in ``directory``; JobError naming the file when missing."""
    path = os.path.join(directory, OPTIONS)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise JobError(f"{path} is missing: train.py runs in the folder %dist export wrote (export the cell "
                       "again)") from None


def torchrun_env() -> dict:
    """Rank, world size, local rank, local world size and the rendezvous from torchrun's environment."""
    missing = [v for v in _TORCHRUN if v not in os.environ]
    if missing:
        raise JobError(f"{', '.join(missing)} not set: start the job with torchrun, e.g. `torchrun "
                       "--nproc-per-node 2 train.py` (or `sbatch job.sbatch` on Slurm), not with python alone")
    env = {v.lower(): os.environ[v] for v in _TORCHRUN}
    for v in ("rank", "world_size", "local_rank", "master_port"):
        env[v] = int(env[v])
    env["local_world_size"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"]))
    env["node_rank"] = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    return env


def _choose_device(backend, env) -> str:
    """``"cuda"`` when the node has a GPU for every local rank (rank ``i`` takes GPU ``i``), else ``"cpu"``.

    The cluster's rule: nccl on GPUs when every rank has one of its own, gloo on CPU otherwise.
    """
    if backend == "gloo":
        return "cpu"
    import torch

    count = torch.cuda.device_count()
    if count >= env["local_world_size"] and count:
        return "cuda"
    if backend == "nccl":
        raise JobError(f"--backend nccl needs a GPU for each of the node's {env['local_world_size']} ranks; it "
                       f"has {count}")
    return "cpu"


def join(env: dict, device_type: str, timeout: float) -> None:
    """Make this process rank ``env["rank"]`` as :func:`distnb.engine.process.runtime.setup` makes an engine one.

    The threads are ``OMP_NUM_THREADS`` (torchrun sets 1 unless given), else the cores shared
    among the node's ranks; the process group forms from torchrun's rendezvous (``env://``).
    """

    import torch
    import torch.distributed as dist


    st = runtime.STATE
    st.user_env = frozenset(v for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if v in os.environ)
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // env["local_world_size"]))
    torch.set_num_threads(threads)
    st.rank, st.world_size, st.local_rank, st.node_rank = env["rank"], env["world_size"], env["local_rank"], \
        env["node_rank"]
    st.backend, st.timeout, st.host = ("nccl" if device_type == "cuda" else "gloo"), float(timeout), \
        socket.gethostname()
    kwargs = {}
    if device_type == "cuda":
        st.device = torch.device("cuda", env["local_rank"])
        torch.cuda.set_device(st.device)
        kwargs["device_id"] = st.device
    else:
        st.device = torch.device("cpu")
    runtime._pin_interface(env["master_addr"])  # gloo on the interface that reaches the rendezvous
    dist.init_process_group(st.backend, init_method="env://", rank=st.rank, world_size=st.world_size,
                            timeout=datetime.timedelta(seconds=st.timeout), **kwargs)
    st.generation += 1
    st.broken = False


def _load_pickle(directory, name):
    with open(os.path.join(directory, name), "rb") as f:
        return pickle.load(f)


def _install_data(ns, directory, entry, plan, num_shards) -> None:
    """Give this rank ``entry``'s data (``options.json``'s ``data`` or ``val_data``) as the kernel would."""
    import torch

    from distnb.engine.train import datasets, shards  # loads numpy, torch: at first use, not at this module's import
    from distnb.engine.transport import shard as sharding  # loads numpy, torch at first use
    from distnb.engine.transport import wire  # loads numpy, torch: at first use, not when this module is imported

    rank, name = runtime.STATE.rank, entry["name"]
    if entry["path"] == "tensors":
        saved = torch.load(os.path.join(directory, entry["file"]), weights_only=True)
        columns = saved["columns"]
        n = len(columns[0])
        index = sharding.shard_index(rank, runtime.STATE.world_size, num_shards)
        idx = sharding.assign(n, num_shards, plan.seed)[index]  # the shard the kernel's scatter deals this rank
        cols = [c[idx] for c in columns]
        shards.install_shard(ns, name, n, num_shards, plan.seed, index, tuple(saved["structure"]),
                           [wire.describe(c) for c in cols], *[wire.to_buffer(c) for c in cols])
        return
    payload, descs, buffers = _load_pickle(directory, entry["file"])
    kind = {"factory": "part"}.get(entry["path"], entry["path"])
    datasets.install_dataset(ns, name, kind, num_shards, payload, descs, *buffers)


def _epoch_printer(rank):
    """The progress sink: rank 0 prints each epoch's all-ranks mean loss once, as it ends."""
    printed = set()

    def sink(payload):
        msg = payload.get("distnb")
        if rank != 0 or not msg:
            return
        for epoch, loss in msg.get("epoch_losses", ()):
            if epoch not in printed:
                printed.add(epoch)
                print(f"distnb job: epoch {epoch} loss {loss!r}", flush=True)
    return sink


def _save_arguments(p, spec) -> None:

    p.add_argument("--format", choices=FORMATS, default=spec.get("save", {}).get("format", "dcp"),
                   help="what the job also saves when it ends: dcp (its checkpoints only) or safetensors (the trained "
                   f"model as a Hugging Face folder, from_pretrained reads it; a peft model's adapters) in --save-dir "
                   f"(default: the export's: {spec.get('save', {}).get('format', 'dcp')})")
    p.add_argument("--save-dir", default=None, help=f"where --format safetensors writes (default: {SAVED}/ beside "
                   "train.py)")
    p.add_argument("--max-shard-size", default=MAX_SHARD_SIZE, help="largest safetensors file, e.g. 5GB or 500MB "
                   f"(default {MAX_SHARD_SIZE})")


def save_trained(run, args, directory: str) -> str | None:
    """``--format safetensors``: the trained model (a peft model: its adapters) into ``--save-dir``; every rank
    calls it. Returns what rank 0 says of it, or None with ``--format dcp``."""
    if args.format != "safetensors":
        return None
    from distnb.engine.train import hfsave  # loads numpy, torch: at first use, not when this module is imported

    folder = os.path.abspath(args.save_dir or os.path.join(directory, SAVED))
    if hasattr(run.module, "peft_config"):
        meta = hfsave.save_adapters(run, folder)
        return f"the {meta['adapter']!r} adapters in {folder} (peft.PeftModel.from_pretrained(base, DIR) reads them)"
    meta = hfsave.save_model(run, folder, shard_bytes(args.max_shard_size))
    return (f"the model in {folder} as {_count(len(meta['files']), 'safetensors file')}"
            + (" with config.json (from_pretrained reads it)" if meta["config"] else ""))


def _install(ns, directory, spec, plan) -> None:
    """Model (as the ranks received it at the cell's start), names and data on this rank."""
    from distnb.engine import strategies  # loads numpy, torch: at first use, not when this module is imported
    from distnb.engine.train import checkpoint, install, loop  # loads numpy, torch at first use
    from distnb.engine.transport import wire  # as every entry of the job: only its mode's

    payload, descs, buffers = _load_pickle(directory, MODEL)
    install.install_model(ns, plan.model, payload, descs, 0, *buffers)
    if os.path.exists(os.path.join(directory, NAMES)):
        ns.update(wire.loads(*_load_pickle(directory, NAMES)))
    num_shards = strategies.data_parallel_size(plan, runtime.STATE.world_size)
    _install_data(ns, directory, spec["data"], plan, num_shards)
    if spec.get("val_data"):
        _install_data(ns, directory, spec["val_data"], plan, num_shards)
    start = spec["start"]
    if not (plan.checkpoint_dir and checkpoint.latest(plan.checkpoint_dir)):  # else it resumes from there
        run = loop.RUNS[plan.model]
        run.epoch, run.epoch_samples, run.steps = start["epoch"], start["epoch_samples"], start["steps"]
        run.epoch_step = start["epoch_step"]


def epochs_left(spec, epochs: int, checkpoint_dir: str) -> int:
    """Epochs still to train for a job of ``epochs`` in all from the cell's start (0: it is complete).

    With a checkpoint in ``checkpoint_dir`` (an earlier run of the job, say one a batch system
    requeued), the epoch it holds counts as reached: an epoch it stopped in is trained to its end.
    """
    from distnb.engine.train import checkpoint  # loads numpy, torch: at first use, not when this module is imported

    end = spec["start"]["epoch"] + epochs
    if not checkpoint.latest(checkpoint_dir):
        return epochs
    return max(0, end - checkpoint.read_meta(checkpoint_dir)["epoch"])


def _plan(spec, args, directory):

    folder = os.path.abspath(args.checkpoint_dir or os.path.join(directory, CHECKPOINTS))
    given = dict(spec["plan"], epochs=max(1, epochs_left(spec, args.epochs, folder)),
                 checkpoint_every=args.checkpoint_every, reset=False, resume=True, report_interval=1.0,
                 checkpoint_dir=folder)
    for key in ("fsdp_units", "split"):
        if given.get(key) is not None:
            given[key] = tuple(given[key])
    return TrainPlan.from_dict(given)


def _count(n, what) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _data_change(plan, world_size: int, cell_world: int) -> str:
    """What another number of ranks changes in what the job trains on (the sentence's end)."""
    from distnb.engine import strategies  # loads numpy, torch: at first use, not when this module is imported

    try:
        same = strategies.data_parallel_size(plan, world_size) == strategies.data_parallel_size(plan, cell_world)
    except Exception:  # a --mesh that does not fit: the strategy says so when it builds
        same = False
    if same:
        return (f"the data is cut into as many shards as in the cell (--strategy {plan.strategy}), so the batches are "
                "the cell's, and the losses too but for rounding")
    return "the shards and batches differ, so the losses will not be the cell's"


def _say_start(spec, plan, world_size) -> None:
    from distnb.engine.train import checkpoint  # loads numpy, torch: at first use, not when this module is imported

    cell, newest = spec["cell"], checkpoint.latest(plan.checkpoint_dir)
    where = f"resuming from {newest}" if newest else f"from epoch {spec['start']['epoch']}"
    print(f"distnb job: {plan.model} on {_count(world_size, 'rank')} ({plan.strategy}), "
          f"{_count(plan.epochs, 'epoch')} {where}; the cell ran on {_count(cell['world_size'], 'rank')}", flush=True)
    if world_size != cell["world_size"]:
        print(f"distnb job: {_count(world_size, 'rank')} where the cell had {cell['world_size']}: "
              f"{_data_change(plan, world_size, cell['world_size'])}", flush=True)
    if not newest and not spec["start"]["exact"]:
        print(f"distnb job: {spec['start']['why']}", flush=True)


def main(directory: str, step: str, argv=None) -> int:
    """Train the exported cell in ``directory`` with the body ``step`` on this rank; 0 when done.

    Parameters
    ----------
    directory : str
        The folder ``%dist export`` wrote (``options.json``, ``model.pkl``, the data).
    step : str
        The cell's body (``train.py`` holds it).
    argv : list of str, optional
        Command-line options (default ``sys.argv[1:]``): ``--epochs``, ``--checkpoint-dir``,
        ``--checkpoint-every``, ``--losses``, ``--backend``, ``--format``, ``--save-dir``, ``--max-shard-size``.

    Returns
    -------
    int
        The exit status.

    Raises
    ------
    JobError
        Not started by torchrun, or the export's files are missing.
    """
    spec = read_options(directory)
    args = _arguments(sys.argv[1:] if argv is None else argv, spec)
    env = torchrun_env()
    device_type = _choose_device(args.backend, env)
    join(env, device_type, spec["cell"]["timeout"])
    from distnb.engine.train import checkpoint, loop  # loads numpy, torch at first use

    ns = dict(rank=env["rank"], world_size=env["world_size"], local_rank=env["local_rank"],
              node_rank=env["node_rank"], device=runtime.STATE.device)
    report.SINK = _epoch_printer(env["rank"])
    try:
        plan = _plan(spec, args, directory)
        if not epochs_left(spec, args.epochs, plan.checkpoint_dir):
            if env["rank"] == 0:
                print(f"distnb job: already trained: {checkpoint.latest(plan.checkpoint_dir)} is at the end of its "
                      f"{_count(args.epochs, 'epoch')} (give a larger --epochs to train on)", flush=True)
            return 0
        if env["rank"] == 0:
            _say_start(spec, plan, env["world_size"])
        _install(ns, directory, spec, plan)
        t0 = time.perf_counter()
        row = loop.train(ns, plan.to_dict(), step)
        seconds = time.perf_counter() - t0
        row.pop("state", None)
        saved = save_trained(loop.RUNS[plan.model], args, directory)
        if env["rank"] == 0:
            out = dict(epochs=list(range(row["first_epoch"], row["next_epoch"])), epoch_losses=row["epoch_losses"],
                       steps=row["steps"], global_steps=row["global_steps"], world_size=env["world_size"],
                       seconds=seconds, resumed=row["resumed"], val_history=row["val_history"],
                       checkpoint=checkpoint.latest(plan.checkpoint_dir))
            path = args.losses or os.path.join(directory, LOSSES)
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
            print(f"distnb job: done in {seconds:.1f} s; losses in {path}; checkpoint {out['checkpoint']} "
                  f"(%dist load {plan.checkpoint_dir} --model {plan.model} in a notebook)", flush=True)
            if saved:
                print(f"distnb job: saved {saved}", flush=True)
    finally:
        report.SINK = None
        runtime.leave()
    return 0


def run(directory: str, step: str, argv=None) -> None:
    """:func:`main`, then leave the process at once with its status (what ``train.py`` calls).

    ``os._exit`` after the group is destroyed, as an engine leaves: a process that trained DDP
    over gloo can abort in the interpreter's normal exit. A JobError is printed as one line.
    """

    try:
        status = main(directory, step, argv)
    except SystemExit as exc:  # --help, or a bad option (argparse)
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except JobError as exc:
        print(f"distnb job: {exc}", file=sys.stderr)
        status = 2
    except BaseException:  # noqa: BLE001 - the traceback is printed; torchrun sees the status
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
