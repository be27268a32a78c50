"""IPython magics: parse options (IPython's magic_arguments), then make exactly one session call."""

from __future__ import annotations

import argparse
import dataclasses

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import options
from .errors import ClusterError, PlanError
from .plan import ClusterSpec, RunOptions, TrainPlan


_PARSE = {"int": int, "float": float}


def declared_arguments(*classes):
    """IPython ``@argument`` decorators for the magic options declared in ``classes``, in their order.

    Each option's flags, type, default (what is passed when it is not given), help and
    whether it is required come from its field (:mod:`distnb.options`); values are checked
    by the dataclass itself, so the magic and the Python API give the same error.
    """
    def apply(fn):
        for cls in reversed(classes):
            for f, opt in reversed(options.declared(cls)):
                if not opt.cli:
                    continue
                kw = dict(dest=opt.keyword or f.name, help=opt.help)
                if f.default is dataclasses.MISSING and opt.given is options.FIELD_DEFAULT:
                    kw["required"] = True
                else:
                    kw["default"] = options.given_of(f, opt)
                if opt.kind == "flag":
                    kw["action"] = "store_true" if kw["default"] is False else argparse.BooleanOptionalAction
                else:
                    kw["type"] = _PARSE.get(opt.kind, str)
                    if opt.choices:
                        kw["metavar"] = "{" + ",".join(opt.choices) + "}"
                fn = argument(*options.flags_of(f, opt), **kw)(fn)
        return fn
    return apply


def _session():
    from . import session

    try:
        return session.current()
    except ClusterError as exc:
        raise UsageError(str(exc)) from None


@magic_arguments(name="dist start")
@declared_arguments(ClusterSpec)
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
@declared_arguments(TrainPlan, RunOptions)
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

A Dataset (not a tensor container) is sent by value and loaded on the ranks every epoch;
``--data make`` runs ``make(rank, world_size) -> Dataset`` on each rank (README "Data")::

    %%distrain --model net --data images --epochs 5 --workers 2 --collate pad_batch
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
                session.start(ns=ns, **{k: getattr(args, k) for k in options.keywords(ClusterSpec)})
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
        given = {k: getattr(args, k) for k in (*options.keywords(TrainPlan), *options.keywords(RunOptions))
                 if hasattr(args, k)}
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o/--output must be a notebook name, got {args.output!r}")
        try:
            result = _session().train(cell, **given)
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
