"""The Python API behind every magic: start/stop, run, push/pull/scatter/gather, train.

A thin facade: each concern lives in a module named for it, and :class:`Session` only
checks its arguments and calls them.

- :mod:`distnb.cluster.cluster`: the engines, the controller and the process group;
- :mod:`distnb.execute.execute`: running a rank function on every rank, watching it, the one
  failure and interrupt path;
- :mod:`distnb.train.training`: what a training cell sends first (plan, names, model, shards) and
  what the ranks already hold;
- :mod:`distnb.transfer.data`: scattering and gathering data sets;
- :mod:`distnb.train.results`: the status table and the TrainResult;
- :mod:`distnb.train.background`: a training cell run in the background.

Typical use outside IPython magics::

    import distnb
    s = distnb.start(n=2)                       # 2 ranks, gloo on CPU
    s.run("print(rank, world_size)", all_output=True)
    result = s.train("x, y = batch\\nloss = F.cross_entropy(model(x), y)",
                     model="net", data="train", epochs=5, batch_size=64, optimizer="adam")
    s.stop()
"""

from __future__ import annotations

import atexit
import contextlib
import inspect

from distnb.cluster import lease, worlds
from distnb.cluster.cluster import Cluster
from distnb.cluster.defaults import default_spec, user_ns
from distnb.cluster.startup import START_OPTIONS, failure_policy, say_policy
from distnb.cluster.startup import differences as _differences
from distnb.cluster.startup import say_ready as _say_ready
from distnb.core import calls, options
from distnb.core.errors import ClusterError, PlanError
from distnb.core.plan import BOUND_PREFIX, ClusterSpec, RunOptions, TrainPlan
from distnb.core.tables import count
from distnb.elastic import scaling, shrinking
from distnb.execute import debugger
from distnb.execute.execute import run_on_ranks, targets_of
from distnb.export.export import session_export
from distnb.train import background, checkpoints, training
from distnb.train.holdings import Holdings
from distnb.train.background import BackgroundRun, check_idle
from distnb.train.hfsaving import session_save
from distnb.train.results import StatusTable, TrainResult, WhereTable, status_table, where_table
from distnb.transfer import pulling
from distnb.transfer.data import gather as gather_shards
from distnb.transfer.data import scatter as scatter_shards
from distnb.transfer.data import scatter_line
from distnb.transfer.transfer import outgoing, pack_named, sweep_shm

_CURRENT = None
_STOPPED = None  # the Holdings of the last session stopped: what carries over to the next %dist start
#: Session.train()'s keyword options (TrainPlan and RunOptions fields), from their declarations.
TRAIN_OPTIONS = frozenset(options.keywords(TrainPlan)) - {"model", "data"}
RUN_OPTIONS = frozenset(options.keywords(RunOptions))
#: train()'s options that name a notebook object (and so also take the object itself).
OBJECT_OPTIONS = frozenset(opt.keyword or f.name for f, opt in options.declared(TrainPlan)
                           if opt.api and opt.kind in ("name", "text")) - {"model", "data"}


def start(*args, ns=None, spec=None, quiet=False, **given) -> "Session":
    """Start (or return the running) cluster and its process group.

    ``distnb.start(n=2)``; the options are :class:`~distnb.core.plan.ClusterSpec`'s (listed below,
    each as ``%dist start`` takes it), plus:

    Parameters
    ----------
    ns : dict, optional
        The namespace names are looked up in (default: the IPython user namespace or
        ``__main__``).
    spec : ClusterSpec, optional
        Start exactly this (what ``restart`` does); the options are then ignored, except
        ``auto_restart`` and ``on_failure``.
    quiet : bool
        Print nothing.
    {options}

    Returns
    -------
    Session

    Raises
    ------
    ClusterError
        If the engines cannot start or form a process group, or ``master_port`` is taken.
    PlanError
        For invalid options (``n < 1``, unknown backend, nccl without GPUs, a port
        outside 1-65535) and for a keyword that is not an option (the message lists them).
    """
    global _CURRENT, _STOPPED
    options.refuse_unknown(given, _START_SIGNATURE.parameters, "start")
    bound = _START_SIGNATURE.bind(*args, **given)
    explicit = {k: v for k, v in bound.arguments.items() if k not in ("auto_restart", "on_failure")}
    bound.apply_defaults()
    given = dict(bound.arguments)
    policy = failure_policy(given.pop("auto_restart"), given.pop("on_failure"))
    auto_device = spec is None and given["backend"] is None
    if spec is None:  # bad options are errors, running cluster or not
        spec = default_spec(**given)
    if _CURRENT is not None and _CURRENT.running:
        if policy is not None and policy != _CURRENT.on_failure:
            if not quiet:
                say_policy(policy, _CURRENT.on_failure)
            _CURRENT.on_failure = policy
        if not quiet:
            print(f"distnb: a cluster of {_CURRENT.world_size} ranks is already running; keeping it "
                  f"{_differences(explicit, spec, _CURRENT.cluster.spec)}")
        return _CURRENT
    cluster = Cluster(spec, auto_device=auto_device, say=None if quiet else print).start()
    _CURRENT = Session(cluster, ns=ns)
    _CURRENT.on_failure = policy or "stop"
    worlds.opened(_CURRENT)  # signed, and recorded for %dist attach (distnb.attaching)
    if _STOPPED is not None:  # %dist stop then %dist start: the models' carried options, as across a restart
        _STOPPED.keep_across_restart(_CURRENT.holdings)
        _STOPPED = None
    atexit.register(_stop_at_exit)
    if not quiet:
        _say_ready(cluster)
    return _CURRENT


_START_SIGNATURE = options.signature(ClusterSpec)
_START_SIGNATURE = _START_SIGNATURE.replace(parameters=[  # -n may be given by position: distnb.start(2)
    p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) if p.name == "n" else p
    for p in sorted(_START_SIGNATURE.parameters.values(), key=lambda p: p.name != "n")])
start.__doc__ = start.__doc__.replace("    {options}", "\n".join(
    "    " + line for line in options.doc(ClusterSpec).splitlines()))
start.__signature__ = _START_SIGNATURE.replace(parameters=[
    *_START_SIGNATURE.parameters.values(),
    *(inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=d) for k, d in
      (("ns", None), ("spec", None), ("quiet", False)))])


def _stop_at_exit():
    # Kernel shutdown or interpreter exit: stop quickly ourselves (engines leave with os._exit)
    # rather than through ipyparallel's slower atexit path; the reaper covers a killed kernel.
    if _CURRENT is not None and _CURRENT.running and not lease.outlives_kernel(_CURRENT):  # else its keeper's
        _CURRENT._end_background()
        _CURRENT.stop(quiet=True)


def current() -> "Session":
    """The running session. Raises ClusterError if none is running."""
    if _CURRENT is None or not _CURRENT.running:
        raise ClusterError("no distnb cluster is running; start one with %dist start (or distnb.start())")
    return _CURRENT


class Session:
    """A running cluster plus what distnb has sent to it.

    Parameters
    ----------
    cluster : object
        A started cluster (``distnb.cluster.cluster.Cluster``).
    ns : dict, optional
        Namespace in which names (``--model net``) are looked up.
    """

    def __init__(self, cluster: Cluster, ns=None):
        self.cluster = cluster
        self._ns = ns
        self.holdings = Holdings()  # what the ranks hold (models, data, pushed names, ...)
        self.last_result = None
        self._background = None  # a BackgroundRun while a %%distrain --background run is going on
        self.on_failure = "stop"  # when an engine dies during a cell: stop, restart or shrink (--on-failure)
        self.last_where = {}  # rank -> where the running (or last) cell is on it (distnb.engine.process.where)
        self.last_error = None  # the last RankError of a cell: %dist debug's rank by default
        self._bound = {}  # _distnb_model / _distnb_data -> the object last passed itself (train(model=net_object))

    # basics --------------------------------------------------------------
    @property
    def ns(self) -> dict:
        return self._ns if self._ns is not None else user_ns()

    @property
    def auto_restart(self) -> bool:
        """Whether a fresh world starts when an engine dies during a cell (``on_failure == "restart"``)."""
        return self.on_failure == "restart"

    @auto_restart.setter
    def auto_restart(self, on: bool) -> None:
        self.on_failure = "restart" if on else "stop"

    @property
    def running(self) -> bool:
        return self.cluster.client is not None

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    def _lookup(self, name, what="name"):
        if not isinstance(name, str):
            raise PlanError(f"{what} must be a notebook name (a string), got {name!r}")
        try:
            return self.ns[name]
        except KeyError:
            raise PlanError(f"{what} {name!r} is not defined in the notebook; define it in a cell first") from None

    def _check_running(self):
        if not self.running:
            raise ClusterError("the distnb cluster is stopped; run %dist start")
        check_idle(self)

    # lifecycle -----------------------------------------------------------
    def status(self, timeout: float = 10.0) -> StatusTable:
        """Rank, engine id, host, node_rank, local_rank, pid, device, backend, threads, bound cores (``all``: not
        bound, ``--cpu-bind``) and liveness of every rank; the title names the ``--on-failure`` policy.

        A rank is alive when its engine process runs and answers within ``timeout`` seconds (an engine
        loading torch right after a start can take a few); a dead one's ``died`` says how its engine
        ended, and the title the fix. During a background training run the ranks are not asked (they
        are busy training): the table shows what the kernel knows (pids, hosts, whether each engine
        process is alive, how a dead one died) and its title says the ranks are training.
        """
        if not self.running:
            raise ClusterError("the distnb cluster is stopped; run %dist start")
        run = self._background
        if run is not None and run.active:  # the ranks are busy training: what the kernel itself knows
            return status_table(self, timeout, busy=True)
        check_idle(self)
        return status_table(self, timeout)

    def where(self, timeout: float = 2.0) -> WhereTable:
        """Where every rank is (``%dist where``): state, seconds there, collective, cell line, stack.

        Between cells every rank answers at once and is ``idle``. During a background training
        run (the kernel is free) it shows what the run's ranks last published, at most about
        a second old, also while they are blocked in a collective.

        Returns
        -------
        WhereTable
            ``.stacks[rank]``: that rank's frames, innermost last.
        """
        if not self.running:
            raise ClusterError("the distnb cluster is stopped; run %dist start")
        run = self._background
        if run is not None and run.active:
            return where_table(self.last_where, self.world_size, "where the background run's ranks are")
        check_idle(self)
        wheres = dict(enumerate(self.cluster.wait_all(self.cluster.apply_all(calls.where_now), timeout=timeout,
                                                      what="where")))
        return where_table(wheres, self.world_size, "between cells: every rank is idle")

    def stop(self, quiet=False) -> None:
        """Stop every process this session started (engines, controller).

        A background training run is stopped first as :meth:`stop_training` does (every rank
        after the same step, bounded; then with the engines), and the one line says so.
        """
        global _CURRENT, _STOPPED
        said = background.stop_before_cluster_stop(self)
        if not self.running:
            if not quiet:
                print("distnb: the cluster is already stopped")
            return
        pids = self.cluster.pids
        worlds.closed(self)
        try:
            self.cluster.stop()
        finally:  # interrupted or not, this session's cluster is gone: %dist start may start a new one
            self.holdings.forget()
            sweep_shm()  # shared-memory transfer files a failure may have left
            if _CURRENT is self:
                _CURRENT, _STOPPED = None, self.holdings
        if not quiet:
            print(f"distnb: {said}stopped {count(len(pids['engines']), 'engine')} and the controller")

    def restart(self, quiet=False, **given) -> "Session":
        """Stop and start again, with the running cluster's options except those ``given``; the new session.

        ``given``: :func:`distnb.start`'s options (``restart(n=4)`` is ``%dist restart -n 4``).
        """
        check_idle(self)  # a background run is stopped by %dist stop or stop-training, not by a restart
        spec = self.cluster.spec
        policy = failure_policy(given.pop("auto_restart", None), given.pop("on_failure", None)) or self.on_failure
        if given:
            options.refuse_unknown(given, START_OPTIONS, "restart")
            kept = {k: getattr(spec, f) for k, f in START_OPTIONS.items() if k not in ("auto_restart", "on_failure")}
            spec = default_spec(**dict(kept, **given))
        self.stop(quiet=True)  # the carried options, and how far the weights are, go to the new session (start)
        return start(spec=spec, ns=self._ns, quiet=quiet, on_failure=policy)

    def scale(self, n, keep_global_batch=False, quiet=False) -> dict:
        return scaling.scale(self, n, keep_global_batch, quiet)

    def _restart_in_place(self) -> str:
        """After an engine death (``auto_restart``): a fresh world of the same spec in this session.

        Returns a sentence for the error message saying what happened.
        """
        spec = self.cluster.spec
        try:
            self.cluster.stop()
            self.holdings.forget()
            self.holdings.generation += 1
            self.cluster = Cluster(spec).start()
        except Exception as exc:
            return f"the automatic restart failed ({exc}); run %dist restart"
        return (f"distnb started a fresh world of {self.world_size} ranks (auto restart): their namespaces are "
                "empty, the next training cell sends the model again")

    # background training -------------------------------------------------
    def wait(self, timeout=None):
        """Wait for the background training run (``%dist wait``) and return its TrainResult.

        The trained weights are in the kernel's model by then, as after a foreground cell. A finished run
        waits here, whatever ran since, until it is returned once. Interrupting the wait stops the run.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most; None waits for the end of the run.

        Returns
        -------
        TrainResult or None
            None when there is no background run, or its result was returned already (or it is still going
            on after ``timeout``, or the wait was interrupted: the run is stopped, the Interrupted said).

        Raises
        ------
        RankError, Interrupted
            What the run raised (a failing rank, a stop).
        """
        return background.wait(self, timeout)

    def stop_training(self, quiet=False):
        """Stop the background training run (``%dist stop-training``) as the interrupt button would.

        Every rank stops after the same step; the kernel's model gets rank 0's weights.

        Returns
        -------
        TrainResult or None
            The result of what was trained (``interrupted`` True unless it had finished anyway).

        Raises
        ------
        RankError
            If the run had failed.
        """
        return background.stop(self, quiet)

    def _end_background(self):
        """At exit: stop a background run (bounded) so the cluster can be stopped."""
        background.end(self)

    # running code --------------------------------------------------------
    def run(self, code: str, all_output: bool = False, targets=None, unchecked: bool = False) -> list:
        """Run ``code`` on every rank, or on ``targets`` only (``rank``, ``world_size``, ``device`` defined).

        ``unchecked``: the cell's own collectives skip the cross-rank check of their tensors
        (``%%dist --unchecked``; tensors of different shapes then abort gloo's engines).

        Output is printed live, tagged ``[rank r]``, for rank 0 (the first target) only unless
        ``all_output``. Returns the repr of each rank's final expression (None for a rank
        outside ``targets``). A collective in a cell run on some ranks only is an error on
        those ranks (the others never call it), not a hang.

        Raises
        ------
        PlanError
            ``targets`` names no rank, or a rank that does not exist.
        RankError
            Naming the failing rank(s) with their remote tracebacks; the process group
            is re-formed first, so the next cell works.
        """
        self._check_running()
        if not isinstance(code, str):
            raise PlanError(f"code must be a string of Python source, got {type(code).__name__}")
        options.check_flags(unchecked=unchecked, all_output=all_output)
        try:
            compile(code, "<%%dist>", "exec")
        except SyntaxError as exc:
            raise PlanError(f"the cell is not valid Python: {exc}") from None
        targets = targets_of(targets, self.world_size)
        ranks = tuple(range(self.world_size)) if targets is None else targets
        show = ranks if all_output else ranks[:1]
        values = run_on_ranks(self, calls.run_cell, code, None if targets is None else list(ranks),
                              unchecked, what="%%dist cell", show_ranks=show)
        for rank in show:
            if values[rank] is not None:
                prefix = f"[rank {rank}] " if self.world_size > 1 else ""
                print(f"{prefix}{values[rank]}")
        return values

    def debug(self, rank=None, commands=None) -> str:
        return debugger.debug(self, rank, commands)

    def push(self, *names, auto=False, **values) -> None:
        """Send notebook objects to every rank by value (classes and functions included).

        ``push("MLP", "net")`` sends the kernel's ``MLP`` and ``net``; ``push(x=obj)``
        binds ``obj`` to ``x`` on the ranks. Tensors travel through shared memory when the
        ranks are on this host, else as zero-copy buffers.
        """

        self._check_running()
        items = {name: self._lookup(name) for name in names}
        items.update(values)
        if not items:
            raise PlanError("push needs at least one name, e.g. %dist push MLP")
        ars = []
        self.holdings.names.update(items)  # %dist scale hands them to added ranks
        with contextlib.ExitStack() as files:  # tensors: shared memory on one host, else zero-copy frames
            for name, value in items.items():
                payload, descs, buffers = pack_named(name, value, " (the training cell reads it)" if auto else "")
                sent = files.enter_context(outgoing(self.cluster, buffers))
                ars += self.cluster.apply_all(calls.bind, name, payload, descs, *sent)
            self.cluster.wait_all(ars, timeout=self.cluster.spec.timeout, what="push")

    def pull(self, name: str, rank=None):
        """The value of ``name`` on ``rank`` (or a list over all ranks when rank is None); ``NAME.path.to.param``:
        that tensor of a model, whole, for any strategy (``distnb.transfer.pulling.pull_tensor``). A name a rank lacks
        is a PlanError naming those ranks, the nearest names there and in the notebook, and the fix."""
        self._check_running()
        if isinstance(name, str) and "." in name:
            return pulling.pull_tensor(self, name, None if rank is None else self._rank(rank))
        if not isinstance(name, str) or not name.isidentifier():
            raise PlanError(f"pull/gather take a variable name defined on the ranks, got {name!r}")
        values = pulling.pull_value(self, name, list(range(self.world_size)) if rank is None else [self._rank(rank)])
        return values if rank is None else values[0]

    def _rank(self, rank, flag="--rank"):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise PlanError(f"{flag} must be {'' if type(rank) is int else 'an integer rank '}between 0 and "
                            f"{self.world_size - 1}, got {rank!r}")
        return rank

    def scatter(self, name: str, data=None, seed: int = 0, quiet: bool = False, num_shards=None) -> list:
        """Give each rank a disjoint shard of ``data`` (default: the kernel's ``name``).

        Shards are dealt from a seeded permutation (see ``distnb.engine.transport.shard``);
        together they cover the data. On the ranks ``name`` is bound to the shard, with the same
        structure (tensor, tuple or dict of tensors; a TensorDataset for a Dataset of tuples). With ``num_shards`` smaller
        than world_size, the ranks go in blocks: rank ``r`` gets shard
        ``r // (world_size // num_shards)`` (``distnb.engine.transport.shard.shard_index``; a tensor-parallel
        group of a mesh reads one shard; ``num_shards=1``: every rank holds the whole set, as model
        parallelism needs).

        Returns
        -------
        list of int
            Samples per rank.
        """
        self._check_running()
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise PlanError(f"--seed must be a non-negative integer, got {seed!r}")
        obj = self._lookup(name, "data") if data is None else data
        sizes = scatter_shards(self, name, obj, seed, self.world_size if num_shards is None else num_shards)
        if not quiet:
            print(f"distnb: {scatter_line(name, self.holdings.data[name], sizes)}")
        return sizes

    def gather(self, name: str):
        """Collect ``name`` from every rank.

        For data sent by :meth:`scatter` the shards are put back in the original sample
        order (a tensor, tuple or dict like the original); otherwise a list by rank.
        """
        return gather_shards(self, name)

    # training ------------------------------------------------------------
    def train(self, code: str, model, data, **given) -> TrainResult:
        """Train ``model`` on ``data`` over all ranks with the step (or loop) body ``code``.

        Parameters
        ----------
        code : str
            One training step: sees ``batch``, ``model`` (DDP-wrapped), ``optimizer`` and
            ``ctx``, and assigns a scalar tensor to ``loss``. With ``loop=True``, the whole
            per-rank loop, driven through ``ctx`` (``for epoch in ctx.epochs(): for batch
            in ctx.loader: ...; ctx.report(loss)``).
        model : str or torch.nn.Module
            The kernel's model (a name in the namespace, or the object). Its class and
            state are sent before training when the ranks do not already hold it; its
            weights are replaced in place by the trained ones when the cell ends.
        data : str or object
            The data set (a name in the namespace, or the object): tensors, a Dataset, ... Scattered as shards (see :meth:`scatter`) unless the ranks hold it already.
        {options}

        Returns
        -------
        TrainResult
            Or, with ``background=True``, a ``distnb.train.background.BackgroundRun`` at once:
            :meth:`wait` returns the TrainResult (the weights are back by then),
            :meth:`stop_training` stops it; other distnb calls raise BusyError until then.

        Raises
        ------
        PlanError
            Invalid options or names, before anything runs on the ranks.
        RankError
            A rank raised; the weights of the last completed step are still loaded back
            and the process group is re-formed.
        Interrupted
            The interrupt (Ctrl-C) stopped every rank after the same step: ``.result`` is the
            TrainResult of what was trained (marked ``interrupted``), whose weights are back.
        """
        options.refuse_unknown(given, TRAIN_OPTIONS | RUN_OPTIONS, "training")
        run = RunOptions(**{k: given.pop(k) for k in RUN_OPTIONS if k in given})
        self._check_running()
        self._bind_objects(given)
        if run.background:
            shown = {k: getattr(run, k) for k in RUN_OPTIONS - {"background"}}
            self._background = BackgroundRun(self.train, dict(code=code, model=model, data=data, **shown, **given))
            try:
                return self._background.start()
            except BaseException:
                self._background = None
                raise
        return shrinking.train_cell(self, code, model, data, run, given)  # training.train_cell; --on-failure

    # checkpoints -----------------------------------------------------------
    save = session_save  # %dist save DIR [--format safetensors | --adapters] (distnb/train/hfsaving.py)

    def load(self, directory: str, model=None, quiet=False, strategy=None) -> dict:
        """Restore a checkpoint into the ranks (and the kernel's model) with its strategy and optimizer.

        The kernel's model (same class and parameter names) is sent, distributed the way the
        checkpoint was saved, and its model, optimizer state, epoch and sampler position are
        loaded on every rank; the restored weights are loaded into the kernel's model too.
        The next ``%%distrain`` with the same strategy continues from there. Weights files (a
        safetensors file, a Hugging Face folder) are read on the ranks into the model distributed
        for ``strategy``, each rank its slices; either way the model is then
        live on the ranks as a trained one: ``save``, ``pull`` and the next cell take it as loaded.

        Parameters
        ----------
        directory : str
            A ``step_*`` checkpoint folder, or its parent (the newest complete one is used); or weights files.
        model : str or torch.nn.Module, optional
            Default: the model of the last training cell or load; with none since the cluster started,
            the notebook's model of the name the checkpoint was saved from.
        quiet : bool
            Print nothing.
        strategy : str, optional
            Weights files only: ``--strategy`` of the model on the ranks (default: its last one, ddp at first).

        Returns
        -------
        dict
            The checkpoint's metadata; for weights files ``{"path", "kind", "ranks"}``.

        Raises
        ------
        PlanError
            No complete checkpoint there, or no such model in the notebook; ``strategy`` other than a
            checkpoint's own (the fix named).
        """
        self._check_running()
        return checkpoints.load(self, *checkpoints.model_to_load(self, directory, model), directory, quiet,
                                strategy=strategy)

    export = session_export  # %dist export DIR: the last training cell as a torchrun job (distnb/export/export.py)

    def _bind_objects(self, given: dict) -> None:
        """Objects given for options that name them (``val_data=``, ``metric=``): their names (or ``_distnb_<option>``)."""
        for key in OBJECT_OPTIONS & given.keys():
            value = given[key]
            if value is not None and not isinstance(value, str):
                given[key], _ = self._named(value, key)
                self.ns[given[key]] = value

    def _named(self, value, what):
        if isinstance(value, str):
            return value, self._lookup(value, f"--{what}")
        atom = isinstance(value, (int, float, complex, bytes))  # interned: the same object is no sign of one name
        for k, v in self.ns.items():
            if v is value and not atom and k.isidentifier() and not k.startswith("_"):
                return k, value
        name = BOUND_PREFIX + what
        self._bound[name] = value  # save() and load() of "the last model trained" find it
        return name, value


Session.train.__signature__ = options.signature(TrainPlan, RunOptions, first=[
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("self", "code", "model", "data")])
Session.train.__doc__ = Session.train.__doc__.replace("        {options}", "\n".join(
    "        " + line for line in options.doc(TrainPlan, RunOptions, skip=("model", "data")).splitlines()))
Session.debug.__doc__ = debugger.debug.__doc__.replace("    session : distnb.session.Session\n", "")
Session.scale.__doc__ = scaling.scale.__doc__
