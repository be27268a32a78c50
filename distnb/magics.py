"""IPython magics: parse options (IPython's magic_arguments), then make exactly one session call."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import signal
import sys
import threading

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from distnb import attachverb, magic_values
from distnb.core import options
from distnb.core.errors import ClusterError, Interrupted, PlanError, stop_interrupted
from distnb.core.plan import ClusterSpec, RunOptions, TrainPlan
from distnb.export.export import session_export
from distnb.train import hfsaving, pretrained
from distnb.train.background import check_idle

_PARSE = {"int": int, "float": float}


def declared_arguments(*classes, only_given=False):
    """IPython ``@argument`` decorators for the magic options declared in ``classes``, in their order.

    Each option's flags, type, default (what is passed when it is not given), help and
    whether it is required come from its field (:mod:`distnb.core.options`); values are checked
    by the dataclass itself, so the magic and the Python API give the same error. With
    ``only_given``, an option left out is absent from the parsed arguments (the Python
    keyword's default applies, and the caller can tell what was given).
    """
    def apply(fn):
        for cls in reversed(classes):
            for f, opt in reversed(options.declared(cls)):
                if not opt.cli:
                    continue
                kw = dict(dest=opt.keyword or f.name, help=opt.help.replace("%", "%%"))  # argparse's % format
                if f.default is dataclasses.MISSING and opt.given is options.FIELD_DEFAULT:
                    kw["required"] = True
                else:
                    kw["default"] = options.given_of(f, opt)
                if opt.kind == "flag":
                    # a flag that carries over between cells can also be turned off (--no-...)
                    plain = kw["default"] is False and not options.carries(opt)
                    kw["action"] = "store_true" if plain else argparse.BooleanOptionalAction
                else:
                    kw["type"] = _PARSE.get(opt.kind, str)
                    if opt.choices:
                        kw["metavar"] = "{" + ",".join(opt.choices) + "}"
                if only_given:
                    kw["default"] = argparse.SUPPRESS
                fn = argument(*options.flags_of(f, opt), **kw)(fn)
        return fn
    return apply


def _load_modules() -> None:
    """Import what the magics run (``distnb.session`` and below: ipyparallel, jupyter_client, ...) the first time,
    with Ctrl-C held until the imports are done: an interrupt in the middle of one left a module half made
    (``module 'jupyter_client' has no attribute 'session'`` at every later ``%dist start``, until a kernel restart).

    Raises
    ------
    Interrupted
        The interrupt came during the imports (they are finished; nothing was started).
    """

    if "distnb.session" in sys.modules or threading.current_thread() is not threading.main_thread():
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        from distnb import session  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:

        raise Interrupted("interrupted while distnb loaded its modules (they are loaded now; nothing was started)")


def _session():
    from distnb import session  # loads ipyparallel: at first use, not when this module is imported

    try:
        return session.current()
    except ClusterError as exc:
        raise UsageError(str(exc)) from None


@magic_arguments(name="dist start")
@declared_arguments(ClusterSpec, only_given=True)
def _start(line):
    """Start the cluster and its process group (keeps a running one).

    Local CPU engines are forked from the engine template that ``%load_ext distnb`` started
    (imports done once; ``DISTNB_ZYGOTE=0`` turns it off; docs/guides/starting.md).

    Several hosts (ipyparallel's launchers; docs/guides/multihost.md)::

        %dist start --launcher ssh --hosts node1,node2 --engines-per-node 2
        %dist start --launcher mpi -n 4
        %dist start --launcher slurm --nodes 2 --engines-per-node 4 --partition gpu --time 01:00:00
        %dist start --profile mycluster      # launcher settings from an ipyparallel profile
    """


@magic_arguments(name="dist stop")
def _stop(line):
    """Stop every engine and the controller this kernel started; a background training run is stopped first, as
    %dist stop-training does (every rank after the same step; the model keeps those weights)."""


@magic_arguments(name="dist restart")
@declared_arguments(ClusterSpec, only_given=True)
def _restart(line):
    """Stop and start again: a fresh process group, empty ranks; options given replace the running cluster's.

    Options not given keep the running cluster's values (the defaults named below are %dist start's).

    Example: %dist restart -n 4
    """


@magic_arguments(name="dist scale")
@argument("n", type=int, help="the new world size (ranks), at least 1, e.g. %%dist scale 3")
@argument("--keep-global-batch", action="store_true", dest="keep_global_batch",
          help="keep the global batch: the next cells' --batch-size (or --accumulate) is scaled for the new world, "
               "e.g. %%dist scale 4 --keep-global-batch after 2 ranks x 64 trains 4 x 32")
def _scale(line):
    """Grow or shrink the running world to N ranks, keeping what the ranks hold: added engines start
    (forked from the engine template), the highest ranks stop when shrinking, the process group is
    formed again, and rank 0 broadcasts each ddp model with its optimizer, lr schedule, epoch and
    sampler position, the pushed names and the names %%dist cells defined there, to the added ranks
    (fsdp, tensor and fsdp+tensor models go through a DCP checkpoint resharded for the new world;
    fsdp+tensor keeps the tensor-parallel size of its --mesh DPxTP, so N must be a multiple of TP). Scattered data is dealt again into N shards. The next %%distrain continues training. The cell says how the global batch changed.

    Example: %dist scale 3      then      %dist scale 2 --keep-global-batch
    """


@magic_arguments(name="dist status")
def _status(line):
    """Table of rank, engine id, host, node_rank, local_rank, pid, device, backend, threads, cores and liveness
    (a dead rank: how it died, and the fix; the title: the --on-failure policy); during a background training
    run, what the kernel knows without asking the busy ranks (and which rank died)."""


@magic_arguments(name="dist push")
@argument("names", nargs="+", help="notebook names to send by value (classes, functions, tensors, ...)")
def _push(line):
    """Send notebook objects to every rank."""


@magic_arguments(name="dist pull")
@argument("name", help="name on the ranks, or MODEL.path.to.param: that tensor whole, any strategy (net.0.weight, net.model.layers.0.mlp.up_proj.weight)")
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
@hfsaving.save_arguments(argument)
def _save(line):
    """Checkpoint the ranks' model, optimizer and position (DCP), or write safetensors (--format, --adapters).

    Examples: %dist save checkpoints/digits    %dist save out/llama --format safetensors    %dist save --adapters out/lora
    """


@magic_arguments(name="dist load")
@pretrained.load_arguments(argument)
def _load(line):
    """Restore a checkpoint into the ranks and the notebook's model; the next %%distrain continues from it.
    Example: %dist load checkpoints/digits --model net    or, pretrained weights: %dist load ./llama-tiny --model net
    """


@magic_arguments(name="dist export")
@argument("directory", help="a new or empty folder for the job (created)")
@argument("--force", action="store_true", help="write into a folder that is not empty (replacing an export's files)")
@hfsaving.export_format_argument(argument)
@argument("--nodes", type=int, default=None, help="nodes in job.sbatch (default: the cell's hosts; with only "
          "--nproc-per-node given, as many as keep the cell's world size)")
@argument("--nproc-per-node", type=int, default=None, dest="nproc_per_node",
          help="ranks per node in job.sbatch and the torchrun command (default: the cell's)")
def _export(line):
    """Write the last training cell as a job that runs without a notebook: train.py (torchrun), the
    model (by value, with the weights the cell started from), the data, the options and job.sbatch
    (Slurm: srun torchrun). The job runs distnb's own loop and saves checkpoints that %dist load reads.

    Example: %dist export jobs/digits    then, in a shell: cd jobs/digits && torchrun --standalone --nproc-per-node 2 train.py
    """


@magic_arguments(name="dist wait")
def _wait(line):
    """Wait for the background training run and return its result; the trained weights are then in
    the notebook's model. Interrupting the wait stops the run.

    Example: %%distrain --background ... then, later, result = %dist wait
    """


@magic_arguments(name="dist where")
def _where(line):
    """Where every rank is: idle between cells; during a background run (%%distrain --background),
    each rank's state, seconds there, the collective it waits in and its cell line.

    Example: %dist where
    """


@magic_arguments(name="dist stop-training")
def _stop_training(line):
    """Stop the background training run as the interrupt button would: every rank stops after the
    same step and the notebook's model gets the weights.

    Example: %dist stop-training
    """


@magic_arguments(name="dist debug")
@argument("--rank", type=int, default=None,
          help="the rank to debug (default: the root cause of the last RankError); any rank whose cell raised")
@argument("-c", "--command", dest="commands", action="append", default=None, metavar="CMD",
          help="a pdb command to run instead of asking for one (repeat it; the session ends after the last): "
               "for scripts and front ends without input boxes")
def _debug(line):
    """Post-mortem pdb on a failed rank: its traceback's frames, kept until the next cell.

    Commands typed into the input box run on the rank (p, pp, l, up, down, where, !expr); the
    innermost frame of your code comes first. q (or c) ends the session and releases the frames.

    Example::

        %dist debug                  # after a RankError: pdb on the rank that raised
        (Pdb) p x.shape
        (Pdb) up
        (Pdb) q
        %dist debug --rank 0 -c "pp locals()" -c "where"
    """


@magic_arguments(name="%dist")
@argument("--all-output", action="store_true",
          help="show every rank's output (default rank 0 only): printed lines in the order they arrive, "
               "the cell's last value in rank order")
@argument("--targets", "--ranks", dest="targets", default=None,
          help="run on these ranks only, e.g. 0,2 (a collective in such a cell is an error: every rank of the "
               "group must call it)")
@argument("--unchecked", action="store_true",
          help="collectives the cell calls itself (dist.all_reduce(...)) skip the cross-rank check of their "
               "tensors, a fingerprint exchanged before each call: as fast as torchrun's, but tensors of different "
               "shapes abort gloo's engines instead of an error naming each rank's tensor, e.g. %%%%dist --unchecked "
               "for a loop that all-reduces gradients itself")
def _cell(line):
    """Run the cell on every rank (or --targets), with rank, world_size, device defined.

    Example: %%dist --targets 0
    """


VERBS = {"start": _start, "stop": _stop, "restart": _restart, "scale": _scale, "status": _status, "push": _push,
         "pull": _pull, "scatter": _scatter, "gather": _gather, "wait": _wait, "stop-training": _stop_training,
         "where": _where, "save": _save, "load": _load, "export": _export, "debug": _debug, "attach": attachverb.parser}

DIST_DOC = """Run code and manage the distributed cluster from a notebook.

Line magic ``%dist VERB [options]``; cell magic ``%%dist [--all-output] [--targets 0,2] [--unchecked]``.

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
@declared_arguments(TrainPlan, only_given=True)  # an option left out is absent: the carry-over rule sees it
@declared_arguments(RunOptions)
@argument("-o", "--output", default=None, help="also store the TrainResult under this notebook name")
def _distrain(line):
    """Train a notebook model on every rank with --strategy (ddp, fsdp, pipeline, tensor, ps, fsdp+tensor); the body
    is one step."""


DISTRAIN_DOC = """Train a notebook model on every rank; the cell body is one training step.

The body runs once per batch of each rank's shard with ``batch``, ``model`` (wrapped
by the strategy: DistributedDataParallel by default), ``optimizer`` and ``ctx`` defined,
and must assign a scalar tensor to ``loss``. distnb does backward, the gradient all-reduce, the optimizer
step, epochs and progress. The kernel's model is sent before training (class and
state, so every rank starts identical) and receives the trained weights afterwards;
the ranks keep model and optimizer, so the next cell continues unless ``--reset``.
State carries, settings do not: a cell that leaves out ``--strategy``, that strategy's options,
``--precision``, ``--compile``, ``--sync-bn``, ``--find-unused-parameters`` or ``--optimizer``
keeps the model's last values (and says so for the distribution); every other option applies
to its own cell (docs/guides/training_cells.md, "What carries over between cells").

Example::

    %%distrain --model net --data train --epochs 10 --batch-size 64 --optimizer adam --lr 1e-3
    x, y = batch
    loss = F.cross_entropy(model(x), y)

Model parallelism, the same body::

    %%distrain --model net --data train --epochs 3 --strategy pipeline --microbatches 4 --schedule 1f1b
    x, y = batch
    loss = F.cross_entropy(model(x), y)

2-D parallelism on 4 ranks: tensor parallel within ranks 0-1 and 2-3, FSDP2 across the two pairs::

    %%distrain --model net --data train --epochs 3 --strategy fsdp+tensor --mesh 2x2
    x, y = batch
    loss = F.cross_entropy(model(x), y)

A Dataset (not a tensor container) is sent by value and loaded on the ranks every epoch;
``--data make`` runs ``make(rank, world_size) -> Dataset`` on each rank (docs/guides/data.md)::

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

A real training job: bf16 autocast, 2 micro-steps per optimizer step, a cosine schedule after 100
warm-up steps, the gradients' total norm clipped to 1, validation after every epoch until its loss
stops improving for 3 epochs (then the best weights come back)::

    %%distrain --model net --data train --val-data val --epochs 50 --precision bf16 --accumulate 2 --lr-schedule cosine --warmup-steps 100 --clip-grad-norm 1.0 --patience 3 --restore-best -o result
    x, y = batch
    loss = F.cross_entropy(model(x), y)

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


def _asks_help(text: str) -> bool:
    return any(word in ("-h", "--help") for word in text.split())


def _ranks(text):
    """``--targets 0,2`` as a tuple of ints (None: every rank)."""
    if text is None:
        return None
    try:
        return tuple(int(r) for r in text.split(","))
    except ValueError:
        raise UsageError(f"--targets must be rank numbers separated by commas (e.g. 0,2), got {text!r}") from None


def _start_options(args) -> dict:
    """The ``%dist start``/``restart`` options the line gave (the others are absent)."""
    return {k: getattr(args, k) for k in options.keywords(ClusterSpec) if hasattr(args, k)}


def _current():
    from distnb import session  # loads ipyparallel: at first use, not when this module is imported

    return session._CURRENT


#: Verbs that run while a background training run goes on (the others raise BusyError then).
ANY_TIME = ("wait", "stop-training", "where")
#: Verbs that need a cluster and see to a background run themselves (stop stops it first; status does not ask
#: the busy ranks).
RUN_AWARE = ("stop", "status")
#: Verbs that only print "no cluster is running" without one (the others raise it as an error).
NEED_CLUSTER = ("stop",)
#: What each ``%dist`` verb calls: ``(parsed args, the notebook namespace) -> value shown``.
_VERB_CALLS = {
    "start": lambda args, ns: _start_session(ns, _start_options(args)),
    "stop": lambda args, ns: _quiet(stop_interrupted("%dist stop", _current().stop)),
    "restart": lambda args, ns: _quiet(stop_interrupted("%dist restart",
                                                        lambda: _session().restart(**_start_options(args)))),
    "scale": lambda args, ns: _quiet(_session().scale(args.n, keep_global_batch=args.keep_global_batch)),
    "status": lambda args, ns: _session().status(),
    "push": lambda args, ns: _quiet(_session().push(*args.names)),
    "pull": lambda args, ns: _bind(ns, args.output, _session().pull(args.name, rank=args.rank)),
    "scatter": lambda args, ns: _quiet(_session().scatter(args.name, seed=args.seed)),
    "gather": lambda args, ns: _bind(ns, args.output, _session().gather(args.name)),
    "save": lambda args, ns: _quiet(_session().save(**hfsaving.save_keywords(args))),
    "load": lambda args, ns: _quiet(_session().load(args.directory, model=args.model, strategy=args.strategy)),
    "export": lambda args, ns: _quiet(_export_cell(args)),
    "wait": lambda args, ns: _current().wait(),
    "stop-training": lambda args, ns: _current().stop_training(),
    "where": lambda args, ns: _current().where(), "attach": attachverb.call,
    "debug": lambda args, ns: _quiet(_session().debug(rank=args.rank, commands=_unquoted(args.commands))),
}


def _unquoted(words):
    """``-c "p x"`` as ``p x``: IPython's magic arguments keep the quotes (None stays None)."""
    if words is None:
        return None
    return [w[1:-1] if len(w) >= 2 and w[0] == w[-1] and w[0] in "'\"" else w for w in words]


def _quiet(_value) -> None:
    """A verb that only acts (and says what it did): nothing for the notebook to show as ``Out[...]``."""
    return None


def _export_cell(args):
    """``%dist export``: the kernel's last training cell, with or without a running cluster."""

    return session_export(_current(), args.directory, force=args.force, nodes=args.nodes,
                          nproc_per_node=args.nproc_per_node, format=args.format)


def _start_session(ns, given):
    from distnb import session  # loads ipyparallel: at first use, not when this module is imported

    session.start(ns=ns, **given)


def _parse(magic, line: str):
    """``parse_argstring(magic, line)``; an unknown option's UsageError names the options it may have meant."""

    magic_values.refuse_expressions(line)
    try:
        args = parse_argstring(magic, line)
    except UsageError as exc:
        text = str(exc)
        if not text.startswith("unrecognized arguments:"):
            raise
        known = [o for a in magic.parser._actions for o in a.option_strings]
        hints = []
        for word in (w.partition("=")[0] for w in text.partition(":")[2].split() if w.startswith("--")):
            # the option it begins (--epoch: --epochs), the short option typed long (--n: -n), else a near spelling
            begun = [o for o in known if len(word) > 4 and o.startswith(word)]
            close = ([word[1:]] if word[1:] in known else []) + begun
            close = close[:3] or difflib.get_close_matches(word, known, n=2, cutoff=0.75)
            hints += [f"{word}: did you mean {' or '.join(close)}?"] if close else []
        if not hints:
            raise
        raise UsageError(f"{text} ({'; '.join(hints)})") from None
    _refuse_repeats(magic, line)
    return args


def _refuse_repeats(magic, line: str) -> None:
    """UsageError for an option given twice (``--epochs 1 --epochs 2``), which argparse settles silently
    by keeping the last; options meant to repeat (``action="append"``) may."""
    from IPython.utils.process import arg_split  # how parse_argstring splits the line

    by_flag = {o: a for a in magic.parser._actions for o in a.option_strings
               if not isinstance(a, (argparse._AppendAction, argparse._HelpAction))}
    seen = {}
    for word in arg_split(line):
        action = by_flag.get(word.partition("=")[0] if word.startswith("--") else word)
        if action is None:
            continue
        flag = word.partition("=")[0]
        if action.dest in seen:
            both = flag if flag == seen[action.dest] else f"{seen[action.dest]} (the same as {flag})"
            raise UsageError(f"{both} is given twice; give it once (otherwise only the last would count)")
        seen[action.dest] = flag


@magics_class
class DistMagics(Magics):
    """``%dist``, ``%%dist`` and ``%%distrain``."""

    @line_cell_magic
    def dist(self, line, cell=None):
        _load_modules()
        line = options.uncommented(line)
        from distnb import session  # loads ipyparallel: at first use, not when this module is imported

        try:
            if cell is not None:
                if _asks_help(line):
                    return print(_cell.parser.format_help())
                args = _parse(_cell, line)
                _session().run(cell, all_output=args.all_output, targets=_ranks(args.targets),
                               unchecked=args.unchecked)
                return None
            verb, _, rest = line.strip().partition(" ")
            if verb in ("", "help", "-h", "--help") and rest.strip() in ("", *VERBS):
                return print(VERBS[rest.strip()].parser.format_help() if rest.strip() in VERBS else _dist_doc())
            if verb in ("help", "-h", "--help"):  # %dist help bogus
                verb = rest.strip()
            if verb not in VERBS:
                train = "; training is the cell magic %%distrain (%distrain --help)" if "train" in verb else ""
                raise UsageError(f"unknown %dist verb {verb!r}; use one of: {', '.join(VERBS)} (see %dist help){train}")
            if _asks_help(rest):
                return print(VERBS[verb].parser.format_help())
            args = _parse(VERBS[verb], rest)
            if verb not in ANY_TIME:
                if session._CURRENT is None and verb in NEED_CLUSTER:
                    return print("distnb: no cluster is running")
                if session._CURRENT is not None and verb not in RUN_AWARE:  # a background run blocks the rest

                    check_idle(session._CURRENT)
            elif session._CURRENT is None:
                return print("distnb: no cluster is running")
            return _VERB_CALLS[verb](args, self.shell.user_ns)
        except PlanError as exc:
            raise UsageError(str(exc)) from None

    @line_cell_magic
    def distrain(self, line, cell=None):
        _load_modules()
        line = options.uncommented(line)
        if _asks_help(line) or (cell is None and not line.strip()):  # also `%distrain`: IPython points an empty
            return print(DistMagics.distrain.__doc__)  # `%%distrain --help` cell here
        if cell is None:
            raise UsageError("%%distrain is a cell magic: its options on the first line, the training step on the "
                             "lines below it (%distrain --help lists the options)")
        args = _parse(_distrain, line)
        given = {k: getattr(args, k) for k in (*options.keywords(TrainPlan), *options.keywords(RunOptions))
                 if hasattr(args, k)}
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o/--output must be a notebook name, got {args.output!r}")
        try:
            result = _session().train(cell, **given)
        except PlanError as exc:
            raise UsageError(str(exc)) from None
        except Interrupted as exc:  # the interrupt button: -o gets what was trained, and Run All stops here
            if args.output and exc.result is not None:
                self.shell.user_ns[args.output] = exc.result
            raise
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
for _fn in (*VERBS.values(), _cell, _distrain):
    _fn.parser.allow_abbrev = False  # `--epoch 3` is an error naming --epochs's absence, not a guess at it
