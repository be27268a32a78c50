"""IPython magics: parse options (IPython's magic_arguments), then make exactly one session call."""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .errors import ClusterError, PlanError
from .plan import BATCH_LAUNCHERS, LAUNCHERS


def _hosts(text: str) -> tuple:
    hosts = tuple(h.strip() for h in text.split(","))
    if not all(hosts):
        raise argparse.ArgumentTypeError(f"hosts must be names separated by commas, got {text!r}")
    return hosts


def _session():
    from . import session

    try:
        return session.current()
    except ClusterError as exc:
        raise UsageError(str(exc)) from None


@magic_arguments(name="dist start")
@argument("-n", "--engines", dest="n", type=int, default=None,
          help="number of engines (ranks); default one per GPU, or one per CPU core without GPUs")
@argument("--backend", choices=["gloo", "nccl"], default=None,
          help="torch.distributed backend (default nccl on GPUs, gloo on CPU)")
@argument("--timeout", type=float, default=60.0, help="collective/rendezvous timeout in seconds (default 60)")
@argument("--master-port", type=int, default=None,
          help="TCP port of the torch.distributed store (default: a free port); a taken port is an error naming it")
@argument("--auto-restart", action=argparse.BooleanOptionalAction, default=None,
          help="when an engine dies during a cell, start a fresh world of the same size at once (default off; "
               "on a running cluster this only switches the setting)")
@argument("--launcher", choices=list(LAUNCHERS), default=None,
          help="ipyparallel engine launcher: local (default; with --profile, the profile's), mpi (mpiexec), ssh, "
               f"or a batch system ({', '.join(BATCH_LAUNCHERS)})")
@argument("--hosts", type=_hosts, default=None,
          help="ssh/mpi: hosts to start engines on, comma-separated without spaces or quotes "
               "([user@]host[:sshport]); rank 0 runs on the first")
@argument("--engines-per-node", type=int, default=None,
          help="engines on each host or node (default: -n spread evenly; one per GPU on GPU hosts is usual)")
@argument("--nodes", type=int, default=None, help="slurm: nodes to ask the scheduler for")
@argument("--queue", "--partition", dest="queue", default=None, help="batch queue (slurm partition)")
@argument("--time", dest="time_limit", default=None, help="slurm: wall-clock limit (e.g. 01:00:00)")
@argument("--account", default=None, help="slurm: account to charge")
@argument("--profile", default=None,
          help="ipyparallel profile (name or directory) whose ipcluster_config.py configures the launcher; "
               "options given here override it")
@argument("--interface", default=None,
          help="network interface the ranks rendezvous and communicate over (e.g. eth0, ib0), by its name on the "
               "hosts; the controller listens on it too when this machine has it; default: the one that reaches "
               "rank 0 (loopback on one host)")
@argument("--master-addr", default=None,
          help="rendezvous address for the torch.distributed store: an address of rank 0's host (the first of "
               "--hosts); default: rank 0's address that the other ranks reach (127.0.0.1 on one host)")
def _start(line):
    """Start the cluster and its process group (keeps a running one).

    Local CPU engines are forked from the engine template that ``%load_ext distnb`` started
    (imports done once; ``DISTNB_ZYGOTE=0`` turns it off; README "Start-up").

    Several hosts (ipyparallel's launchers; README "Beyond one machine")::

        %dist start --launcher ssh --hosts node1,node2 --engines-per-node 2
        %dist start --launcher mpi -n 4
        %dist start --launcher slurm --nodes 2 --engines-per-node 4 --partition gpu --time 01:00:00
        %dist start --profile mycluster      # launcher settings from an ipyparallel profile
    """


@magic_arguments(name="dist stop")
def _stop(line):
    """Stop every engine and the controller this kernel started."""


@magic_arguments(name="dist restart")
def _restart(line):
    """Stop and start again with the same options: a fresh process group, empty ranks."""


@magic_arguments(name="dist status")
def _status(line):
    """Table of rank, engine id, host, node_rank, local_rank, pid, device, backend, threads and liveness."""


@magic_arguments(name="dist push")
@argument("names", nargs="+", help="notebook names to send by value (classes, functions, tensors, ...)")
def _push(line):
    """Send notebook objects to every rank."""


@magic_arguments(name="dist pull")
@argument("name", help="name on the ranks")
@argument("--rank", type=int, default=None, help="one rank's value (default: a list over all ranks)")
@argument("-o", "--output", default=None, help="also bind the value to this notebook name")
def _pull(line):
    """Fetch a value from the ranks (``x = %dist pull x --rank 0`` binds it)."""


@magic_arguments(name="dist scatter")
@argument("name", help="notebook data set: Dataset, TensorDataset, tensor/array or tuple of them")
@argument("--seed", type=int, default=0, help="seed of the shard assignment (default 0)")
def _scatter(line):
    """Give each rank a disjoint shard of a notebook data set (bound to the same name there)."""


@magic_arguments(name="dist gather")
@argument("name", help="name on the ranks")
@argument("-o", "--output", default=None, help="also bind the value to this notebook name")
def _gather(line):
    """Collect a value from every rank (scattered data back in its original order)."""


@magic_arguments(name="dist save")
@argument("directory", help="folder for checkpoints (written to DIRECTORY/step_<global step>)")
@argument("--model", default=None, help="notebook name of the model (default: the last one trained)")
def _save(line):
    """Checkpoint the ranks' model, optimizer, epoch and sampler position (torch.distributed.checkpoint).

    Example: %dist save checkpoints/digits
    """


@magic_arguments(name="dist load")
@argument("directory", help="a step_* checkpoint folder or its parent (the newest complete one)")
@argument("--model", default=None, help="notebook name of the model (default: the last one trained)")
def _load(line):
    """Restore a checkpoint into the ranks and the notebook's model; the next %%distrain continues from it.

    Example: %dist load checkpoints/digits --model net
    """


@magic_arguments(name="dist wait")
def _wait(line):
    """Wait for the background training run and return its result; the trained weights are then in
    the notebook's model. Interrupting the wait stops the run.

    Example: %%distrain --background ... then, later, result = %dist wait
    """


@magic_arguments(name="dist stop-training")
def _stop_training(line):
    """Stop the background training run as the interrupt button would: every rank stops after the
    same step and the notebook's model gets the weights.

    Example: %dist stop-training
    """


@magic_arguments(name="%dist")
@argument("--all-output", action="store_true", help="show every rank's output (default rank 0 only)")
def _cell(line):
    """Run the cell on every rank, with rank, world_size, device defined."""


VERBS = {"start": _start, "stop": _stop, "restart": _restart, "status": _status, "push": _push,
         "pull": _pull, "scatter": _scatter, "gather": _gather, "wait": _wait, "stop-training": _stop_training, "save": _save, "load": _load}

DIST_DOC = """Run code and manage the distributed cluster from a notebook.

Line magic ``%dist VERB [options]``; cell magic ``%%dist [--all-output]``.

Example::

    %load_ext distnb
    %dist start -n 2            # 2 ranks: gloo on CPU, nccl with one GPU per rank
    %dist status
    %%dist
    print(f"rank {rank} of {world_size} on {device}")

Verbs:
"""


def _dist_doc():
    parts = [DIST_DOC]
    for fn in (*VERBS.values(), _cell):
        parts.append(fn.parser.format_help().replace("usage: ", "").rstrip() + "\n")
    return "\n".join(parts)


@magic_arguments(name="%distrain")
@argument("--model", required=True, help="notebook name of the torch.nn.Module to train")
@argument("--data", required=True, help="notebook name of the data set (scattered as shards)")
@argument("--epochs", type=int, default=1, help="epochs to run (default 1)")
@argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
@argument("--optimizer", default=None,
          help="sgd, adam, adamw, or a notebook name f(params)->Optimizer; default: keep the optimizer live on "
               "the ranks (with its state), sgd for a new model")
@argument("--lr", type=float, default=None,
          help="learning rate; default: keep the live one (a new optimizer: 0.01 sgd, 1e-3 adam/adamw)")
@argument("--seed", type=int, default=0, help="seed of shards and per-epoch shuffles (default 0)")
@argument("--strategy", default="ddp",
          help="ddp (DistributedDataParallel, default), fsdp (FSDP2 fully_shard), pipeline "
               "(torch.distributed.pipelining), tensor (DTensor tensor parallel) or ps (parameter server)")
@argument("--fsdp-units", default=None,
          help="fsdp: comma-separated submodules that become FSDP units (default: each child with parameters)")
@argument("--split", default=None,
          help="pipeline: comma-separated submodules that begin a new stage (default: balanced by parameters)")
@argument("--microbatches", type=int, default=None,
          help="pipeline: microbatches per batch, must divide --batch-size (default: world_size)")
@argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe", help="pipeline: schedule (default gpipe)")
@argument("--loss", default=None,
          help="pipeline: notebook function loss(output, target); default: the body's `loss`")
@argument("--tp-plan", default=None,
          help="tensor: notebook dict {submodule: ParallelStyle}; default: Linear pairs column- then row-wise")
@argument("--checkpoint-dir", default=None,
          help="save model, optimizer and position there (torch.distributed.checkpoint); a model sent "
               "fresh to the ranks (e.g. after %%dist restart) resumes from the newest checkpoint there")
@argument("--checkpoint-every", type=int, default=None,
          help="save every N steps (default: at the end of every epoch)")
@argument("--servers", type=int, default=1, help="ps: ranks holding the parameters and optimizer (default 1)")
@argument("--staleness", type=int, default=0,
          help="ps: steps a worker may run ahead of the last update it received (default 0: synchronous)")
@argument("--reset", action="store_true",
          help="re-send the kernel's model as it is now (its trained weights; build a new model for fresh "
               "ones) with a fresh optimizer and epoch count")
@argument("--target-loss", type=float, default=None, help="stop after an epoch whose mean loss is <= this")
@argument("--loop", action="store_true", help="the body is the whole per-rank loop, driven through ctx")
@argument("--drop-last", action="store_true", help="drop the uneven tail instead of padding")
@argument("--find-unused-parameters", action="store_true",
          help="let DDP train models with parameters that get no gradient in a step")
@argument("--nan", choices=["stop", "skip"], default="stop",
          help="a non-finite loss stops training naming the rank and step (default); skip: drop that step on every rank")
@argument("--progress", choices=["auto", "widgets", "text", "none"], default="auto",
          help="dashboard (auto: widgets in Jupyter, text elsewhere)")
@argument("--all-output", action="store_true", help="show every rank's printed output")
@argument("--background", action="store_true",
          help="return at once and keep the kernel free while the dashboard updates; %%dist wait returns the "
               "result (and the weights), %%dist stop-training stops the run")
@argument("-o", "--output", default=None, help="also store the TrainResult under this notebook name")
def _distrain(line):
    """Train a notebook model on every rank with --strategy (ddp, fsdp, pipeline, tensor, ps); the body is one step."""


DISTRAIN_DOC = """Train a notebook model on every rank; the cell body is one training step.

The body runs once per batch of each rank's shard with ``batch``, ``model`` (wrapped
by the strategy: DistributedDataParallel by default), ``optimizer`` and ``ctx`` defined,
and must assign a scalar tensor to ``loss``. distnb does backward, the gradient all-reduce, the optimizer
step, epochs and progress. The kernel's model is sent before training (class and
state, so every rank starts identical) and receives the trained weights afterwards;
the ranks keep model and optimizer, so the next cell continues unless ``--reset``.

Example::

    %%distrain --model net --data train --epochs 10 --batch-size 64 --optimizer adam --lr 1e-3
    x, y = batch
    loss = F.cross_entropy(model(x), y)

Model parallelism, the same body::

    %%distrain --model net --data train --epochs 3 --strategy pipeline --microbatches 4 --schedule 1f1b
    x, y = batch
    loss = F.cross_entropy(model(x), y)

With ``--loop`` the body is the whole loop::

    %%distrain --model net --data train --epochs 3 --loop
    for epoch in ctx.epochs():
        for x, y in ctx.loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            ctx.report(loss)

In the background, the kernel stays free while the dashboard updates::

    %%distrain --model net --data train --epochs 50 --background -o result
    x, y = batch
    loss = F.cross_entropy(model(x), y)

    %dist wait              # later: blocks until the run ends, returns the TrainResult
    %dist stop-training     # or: stop it (every rank after the same step)

Returns a TrainResult (per-rank steps, samples, seconds, samples/s, final loss).

"""


def _bind(ns, name, value):
    if name is not None:
        if not name.isidentifier():
            raise UsageError(f"-o/--output must be a notebook name, got {name!r}")
        ns[name] = value
    return value


@magics_class
class DistMagics(Magics):
    """``%dist``, ``%%dist`` and ``%%distrain``."""

    @line_cell_magic
    def dist(self, line, cell=None):
        from . import session

        try:
            if cell is not None:
                args = parse_argstring(_cell, line)
                _session().run(cell, all_output=args.all_output)
                return None
            verb, _, rest = line.strip().partition(" ")
            if not verb:
                print(_dist_doc())
                return None
            if verb not in VERBS:
                raise UsageError(f"unknown %dist verb {verb!r}; use one of: {', '.join(VERBS)} (see %dist?)")
            args = parse_argstring(VERBS[verb], rest)
            ns = self.shell.user_ns
            if verb in ("wait", "stop-training"):
                if session._CURRENT is None:
                    print("distnb: no cluster is running")
                    return None
                return session._CURRENT.wait() if verb == "wait" else session._CURRENT.stop_training()
            if session._CURRENT is not None:  # one run at a time: a background run blocks every other verb
                from .background import check_idle

                check_idle(session._CURRENT)
            if verb == "start":
                session.start(n=args.n, backend=args.backend, timeout=args.timeout, ns=ns,
                              master_port=args.master_port, auto_restart=args.auto_restart,
                              **{k: getattr(args, k) for k in session.PLACEMENT_OPTIONS})
            elif verb == "stop":
                if session._CURRENT is None:
                    print("distnb: no cluster is running")
                else:
                    session._CURRENT.stop()
            elif verb == "restart":
                _session().restart()
            elif verb == "status":
                return _session().status()
            elif verb == "push":
                _session().push(*args.names)
            elif verb == "pull":
                return _bind(ns, args.output, _session().pull(args.name, rank=args.rank))
            elif verb == "scatter":
                _session().scatter(args.name, seed=args.seed)
            elif verb == "gather":
                return _bind(ns, args.output, _session().gather(args.name))
            elif verb == "save":
                _session().save(args.directory, model=args.model)
            elif verb == "load":
                _session().load(args.directory, model=args.model)
        except PlanError as exc:
            raise UsageError(str(exc)) from None
        return None

    @cell_magic
    def distrain(self, line, cell):
        args = parse_argstring(_distrain, line)
        options = dict(epochs=args.epochs, batch_size=args.batch_size, optimizer=args.optimizer, lr=args.lr,
                       seed=args.seed, strategy=args.strategy, reset=args.reset, target_loss=args.target_loss,
                       loop=args.loop, drop_last=args.drop_last,
                       find_unused_parameters=args.find_unused_parameters, nan=args.nan,
                       fsdp_units=args.fsdp_units, split=args.split, microbatches=args.microbatches,
                       schedule=args.schedule, loss=args.loss, tp_plan=args.tp_plan, servers=args.servers,
                       staleness=args.staleness, checkpoint_dir=args.checkpoint_dir,
                       checkpoint_every=args.checkpoint_every)
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o/--output must be a notebook name, got {args.output!r}")
        try:
            result = _session().train(cell, model=args.model, data=args.data, progress=args.progress,
                                      all_output=args.all_output, background=args.background, **options)
        except PlanError as exc:
            raise UsageError(str(exc)) from None
        if args.background:
            if args.output:
                result.on_result.append(lambda r, ns=self.shell.user_ns, name=args.output: ns.__setitem__(name, r))
            print("distnb: training in the background; the kernel is free. %dist wait returns the result "
                  f"(and puts the weights into {args.model}), %dist stop-training stops it")
            return None
        if args.output:
            self.shell.user_ns[args.output] = result
        return result


DistMagics.dist.__doc__ = _dist_doc()
DistMagics.distrain.__doc__ = DISTRAIN_DOC + _distrain.parser.format_help().replace("usage: ", "")
