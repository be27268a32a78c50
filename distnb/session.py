"""The Python API behind every magic: start/stop, run, push/pull/scatter/gather, train.

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
import math
import os
import signal
import sys
import time

from .cluster import Cluster
from .defaults import default_spec
from .display import ProgressState, make_view, view_kind
from .display.tables import Table
from .background import BackgroundRun, check_idle, collect
from . import calls
from .errors import ClusterError, Interrupted, PlanError, RankError
from .plan import TrainPlan
from .transfer import sweep_shm

_CURRENT = None
#: Names a training body gets from distnb, never pushed from the notebook.
RESERVED_NAMES = frozenset({"batch", "model", "optimizer", "ctx", "loss", "rank", "world_size", "local_rank",
                            "device"})
#: Progress views and how often ranks report for each (seconds): the dashboard redraws live,
#: text progress prints per epoch (status and epoch-end messages are always sent at once).
PROGRESS_MODES = ("auto", "widgets", "text", "none")
REPORT_INTERVAL = {"widgets": 0.1, "text": 2.0, "none": 3600.0}
#: Keyword options of Session.train that become TrainPlan fields.
TRAIN_OPTIONS = frozenset({"epochs", "batch_size", "optimizer", "lr", "seed", "strategy", "reset", "target_loss",
                           "loop", "drop_last", "find_unused_parameters", "nan", "report_interval", "fsdp_units",
                           "split", "microbatches", "schedule", "loss", "tp_plan", "servers", "staleness",
                           "checkpoint_dir", "checkpoint_every"})
#: Seconds between checks that the ranks' engine processes are alive while a cell runs.
LIVENESS_SECONDS = 0.5
#: Seconds between checks of running ranks (results, output, progress) in the kernel.
POLL_SECONDS = 0.1
#: Seconds to wait for the other ranks once one rank has failed, before interrupting them.
FAILURE_GRACE = 5.0
#: Seconds to wait for a finished rank's remaining output messages.
OUTPUT_WAIT = 2.0
#: Seconds to wait for ranks to stop together at a step boundary after the first SIGINT.
STOP_WAIT = 3.0
#: Seconds to wait for ranks to stop after the second (hard) SIGINT.
INTERRUPT_WAIT = 10.0


#: start()'s keyword arguments that say where engines run (see distnb.plan.ClusterSpec).
PLACEMENT_OPTIONS = ("launcher", "hosts", "nodes", "engines_per_node", "queue", "time_limit", "account", "profile",
                     "interface", "master_addr")


def start(n=None, backend=None, timeout=60.0, ns=None, quiet=False, master_port=None,
          auto_restart=None, spec=None, **where) -> "Session":
    """Start (or return the running) cluster and its process group.

    Parameters
    ----------
    n : int, optional
        Number of engines (ranks). Default: one per visible GPU, else one per CPU core.
    backend : {"gloo", "nccl"}, optional
        Default nccl for GPU engines, gloo for CPU engines.
    timeout : float
        Collective and rendezvous timeout, seconds.
    ns : dict, optional
        The namespace names are looked up in (default: the IPython user namespace or
        ``__main__``).
    quiet : bool
        Print nothing.
    master_port : int, optional
        TCP port of the torch.distributed store on rank 0's rendezvous address (default: a
        free one for every process group formed). A taken port is a ClusterError naming it,
        before any engine starts when the engines run on this machine.
    auto_restart : bool, optional
        When an engine dies during a cell, start a fresh world of the same size at once
        (the cell still fails, naming the rank and how it died). Default off; None keeps
        the running session's setting.
    spec : ClusterSpec, optional
        Start exactly this (what ``restart`` does); the options above except ``ns``,
        ``quiet`` and ``auto_restart`` are then ignored.
    **where
        Where engines run (:data:`PLACEMENT_OPTIONS`, see :class:`distnb.plan.ClusterSpec`):
        ``launcher`` ("local", "mpi", "ssh", "slurm", ...: ipyparallel's launchers),
        ``hosts`` (tuple of str), ``nodes``, ``engines_per_node``, ``queue``,
        ``time_limit``, ``account``, ``profile``, ``interface``, ``master_addr``.

    Returns
    -------
    Session

    Raises
    ------
    ClusterError
        If the engines cannot start or form a process group, or ``master_port`` is taken.
    PlanError
        For invalid options (``n < 1``, unknown backend, nccl without GPUs, a port
        outside 1-65535).
    """
    global _CURRENT
    if auto_restart is not None and not isinstance(auto_restart, bool):
        raise PlanError(f"auto_restart must be True or False, got {auto_restart!r}")
    unknown = set(where) - set(PLACEMENT_OPTIONS)
    if unknown:
        raise TypeError(f"start() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    auto_device = spec is None and backend is None
    if spec is None:  # bad options are errors, running cluster or not
        spec = default_spec(n, backend, timeout, master_port, **where)
    if _CURRENT is not None and _CURRENT.running:
        if auto_restart is not None and auto_restart != _CURRENT.auto_restart:
            _CURRENT.auto_restart = auto_restart
            if not quiet:
                print(f"distnb: automatic restart after an engine death is now {'on' if auto_restart else 'off'}")
        if not quiet:
            print(f"distnb: a cluster of {_CURRENT.world_size} ranks is already running; keeping it "
                  "(%dist restart starts a fresh one)")
        return _CURRENT
    cluster = Cluster(spec, auto_device=auto_device).start()
    _CURRENT = Session(cluster, ns=ns)
    _CURRENT.auto_restart = bool(auto_restart)
    atexit.register(_stop_at_exit)
    if not quiet:
        spec = cluster.spec
        hosts = f" on {_count(cluster.num_nodes, 'host')}" if cluster.num_nodes > 1 else ""
        threads = sorted({r.get("num_threads", spec.num_threads) for r in cluster.ranks})
        print(f"distnb: {_count(spec.num_engines, 'rank')}{hosts} ready ({spec.backend}, {spec.device_type}, "
              f"{'-'.join(map(str, threads[::max(1, len(threads) - 1)]))} threads/rank) in "
              f"{cluster.start_seconds:.1f} s")
        if cluster.note:
            print(f"distnb: {cluster.note}")
    return _CURRENT


def _has_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a complete checkpoint (imports torch.distributed.checkpoint only then)."""
    if not os.path.isdir(directory):
        return False
    from .engine import checkpoint

    return checkpoint.latest(directory) is not None


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _stop_at_exit():
    # Kernel shutdown or interpreter exit: stop quickly ourselves (engines leave with os._exit)
    # rather than through ipyparallel's slower atexit path; the reaper covers a killed kernel.
    if _CURRENT is not None and _CURRENT.running:
        _CURRENT._end_background()
        _CURRENT.stop(quiet=True)


def current() -> "Session":
    """The running session. Raises ClusterError if none is running."""
    if _CURRENT is None or not _CURRENT.running:
        raise ClusterError("no distnb cluster is running; start one with %dist start (or distnb.start())")
    return _CURRENT


def _user_ns():
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.user_ns
    except ImportError:
        pass
    return sys.modules["__main__"].__dict__


class StatusTable(Table):
    """``%dist status``: one row per rank; the title names the controller's pid and the store's address.

    Attributes
    ----------
    controller_pid : int or None
        The ipyparallel controller's process id.
    store : str
        ``host:port`` of the torch.distributed store (rank 0's).
    """

    columns = ("rank", "engine_id", "host", "node_rank", "local_rank", "pid", "device", "backend", "threads",
               "alive")


class TrainResult(Table):
    """What a training cell returns: per-rank figures and the loss history.

    Attributes
    ----------
    rows : list of dict
        Per rank: rank, steps, samples, seconds (training time on the rank),
        samples_per_s, final_loss (the rank's mean loss over its last epoch), param_bytes
        (bytes of parameters the rank holds: all of them for ddp, a shard for fsdp and
        tensor, its stage for pipeline) and, for pipeline, stage.
    epoch_losses : list of float
        Mean loss over all ranks for each epoch run in this cell.
    epochs : list of int
        The epoch numbers run (they continue across cells).
    wall_seconds : float
        Cell wall time in the kernel, seconds.
    train_seconds : float
        The slowest rank's training time, seconds.
    overhead_seconds : float
        wall_seconds - train_seconds: distnb's own cost of the cell.
    samples_per_s : float
        Distinct samples trained per second: the sum over ranks for data parallelism,
        divided by the ranks that share each batch for model parallelism.
    stopped_early : bool
        True when --target-loss was reached.
    """

    columns = ("rank", "steps", "samples", "seconds", "samples_per_s", "final_loss", "param_bytes")

    def __init__(self, rows, plan, wall_seconds, num_shards=None):
        super().__init__(rows, title="")
        self.plan = plan
        first = rows[0]
        self.epoch_losses = list(first["epoch_losses"])
        self.epochs = list(range(first["first_epoch"], first["next_epoch"]))
        self.stopped_early = bool(first["stopped_early"])
        self.wall_seconds = wall_seconds
        self.train_seconds = max(r["seconds"] for r in rows)
        self.overhead_seconds = wall_seconds - self.train_seconds
        share = len(rows) // (num_shards or len(rows))  # ranks that train on the same batch
        self.samples_per_s = sum(r["samples_per_s"] for r in rows) / max(1, share)
        self.final_loss = self.epoch_losses[-1] if self.epoch_losses else math.nan
        how = "reached --target-loss" if self.stopped_early else _count(len(self.epochs), "epoch")
        self.title = (f"{plan.strategy} · {_count(len(rows), 'rank')} · {how} · final mean loss {self.final_loss:.4f} · "
                      f"{self.samples_per_s:.0f} samples/s · {self.wall_seconds:.2f} s")


class Session:
    """A running cluster plus what distnb has sent to it.

    Parameters
    ----------
    cluster : Cluster
        A started cluster.
    ns : dict, optional
        Namespace in which names (``--model net``) are looked up.
    """

    def __init__(self, cluster: Cluster, ns=None):
        self.cluster = cluster
        self._ns = ns
        self._models = {}  # name -> fingerprint of the kernel object the ranks hold
        self._distributed = {}  # name -> (strategy key, process-group generation) it was last trained with
        self._generation = 0  # bumps whenever the process group is re-formed
        self._data = {}  # name -> dict(fingerprint, seed, num_samples, shards)
        self._pushed = {}  # name -> fingerprint of what an automatic push sent
        self._optimizer_of = {}  # model name -> (optimizer, lr) the user chose last
        self.last_result = None
        self._background = None  # a BackgroundRun while a %%distrain --background run is going on
        self.auto_restart = False  # start a fresh world when an engine dies during a cell

    # basics --------------------------------------------------------------
    @property
    def ns(self) -> dict:
        return self._ns if self._ns is not None else _user_ns()

    @property
    def running(self) -> bool:
        return self.cluster.client is not None

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    def _lookup(self, name, what="name"):
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
        """Rank, engine id, host, node_rank, local_rank, pid, device, backend, threads and liveness of every rank.

        A rank is alive when its engine process runs and answers within ``timeout`` seconds
        (an engine still loading torch right after a start can take a few seconds).
        """
        self._check_running()
        dead = self.cluster.dead_ranks()
        ars = {r: self.cluster.apply(r, calls.info)
               for r in range(self.world_size) if r not in dead}
        deadline = time.monotonic() + timeout
        rows = []
        for rank in range(self.world_size):
            base = dict(self.cluster.ranks[rank], alive=False)
            if rank in ars:
                ars[rank].wait(max(0.0, deadline - time.monotonic()))
                try:
                    base.update(ars[rank].get(0), alive=True)
                except Exception:
                    pass
            base["threads"] = base.get("num_threads")
            rows.append(base)
        table = StatusTable(rows)
        table.controller_pid = self.cluster.pids["controller"]
        table.store = f"{self.cluster.master_addr}:{self.cluster.master_port}"
        table.title = (f"controller pid {table.controller_pid} · torch.distributed store {table.store} · "
                       f"auto restart {'on' if self.auto_restart else 'off'}")
        return table

    def stop(self, quiet=False) -> None:
        """Stop every process this session started (engines, controller)."""
        global _CURRENT
        check_idle(self)
        if not self.running:
            if not quiet:
                print("distnb: the cluster is already stopped")
            return
        pids = self.cluster.pids
        try:
            self.cluster.stop()
        finally:  # interrupted or not, this session's cluster is gone: %dist start may start a new one
            self._forget()
            sweep_shm()  # shared-memory transfer files a failure may have left
            if _CURRENT is self:
                _CURRENT = None
        if not quiet:
            print(f"distnb: stopped {_count(len(pids['engines']), 'engine')} and the controller")

    def _forget(self) -> None:
        """Drop what the session knows the ranks hold (they are gone)."""
        self._models.clear()
        self._distributed.clear()
        self._data.clear()
        self._pushed.clear()

    def restart(self, quiet=False) -> "Session":
        """Stop and start again with the same spec; returns the new session."""
        spec = self.cluster.spec
        auto = self.auto_restart
        chosen = dict(self._optimizer_of)
        self.stop(quiet=True)
        new = start(spec=spec, ns=self._ns, quiet=quiet, auto_restart=auto)
        new._optimizer_of.update(chosen)  # the optimizer the user chose for a model survives a restart
        return new

    def _restart_in_place(self) -> str:
        """After an engine death (``auto_restart``): a fresh world of the same spec in this session.

        Returns a sentence for the error message saying what happened.
        """
        spec = self.cluster.spec
        try:
            self.cluster.stop()
            self._forget()
            self._generation += 1
            self.cluster = Cluster(spec).start()
        except Exception as exc:
            return f"the automatic restart failed ({exc}); run %dist restart"
        return (f"distnb started a fresh world of {self.world_size} ranks (auto restart): their namespaces are "
                "empty, the next training cell sends the model again")

    # background training -------------------------------------------------
    def wait(self, timeout=None):
        """Wait for the background training run (``%dist wait``) and return its TrainResult.

        The trained weights are in the kernel's model by then, as after a foreground cell.
        Interrupting the wait (the interrupt button) stops the run like ``stop_training``.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most; None waits for the end of the run.

        Returns
        -------
        TrainResult or None
            None when there is no background run (or it is still going on after ``timeout``, or the
            wait was interrupted: the run is stopped and the Interrupted printed as one line).

        Raises
        ------
        RankError, Interrupted
            What the run raised (a failing rank, a stop).
        """
        run = self._background
        if run is None:
            print("distnb: no background training run to wait for (start one with %%distrain --background)")
            return None
        try:
            if not run.join(timeout):
                print(f"distnb: the background run is still going on after {timeout:g} s")
                return None
        except KeyboardInterrupt:  # the interrupt button during the wait: stop the run as stop_training does
            return self.stop_training()
        return collect(self)

    def stop_training(self, quiet=False):
        """Stop the background training run (``%dist stop-training``) as the interrupt button would.

        Every rank stops after the same step; the kernel's model gets rank 0's weights.

        Returns
        -------
        TrainResult or None
            The result if the run had finished anyway, else None.

        Raises
        ------
        RankError
            If the run had failed.
        """
        run = self._background
        if run is None:
            if not quiet:
                print("distnb: no background training run to stop")
            return None
        run.request_stop()
        run.join()
        try:
            return collect(self)
        except Interrupted as exc:
            if not quiet:
                print(f"distnb: {exc}")
            return None

    def _end_background(self):
        """At exit: stop a background run (bounded) so the cluster can be stopped."""
        run = self._background
        if run is not None and not run.current_thread_is_runner():
            run.request_stop()
            run.join(STOP_WAIT + INTERRUPT_WAIT + 5)
            self._background = None

    # watching running work ----------------------------------------------
    def _watch(self, ars, what, state=None, view=None, show_ranks=(0,)):
        """Wait for one AsyncResult per rank, streaming tagged output and progress.

        Returns the per-rank results; raises RankError (after re-forming the process
        group) if any rank failed, KeyboardInterrupt if the user interrupted.
        """
        offsets = {}
        progress = {}
        failed_since = None
        released = set()
        interrupted = set()
        dead = {}
        user_interrupt = False
        next_liveness = time.monotonic() + LIVENESS_SECONDS
        bg = self._background if self._background is not None and self._background.current_thread_is_runner() else None
        if bg is not None:  # a background run: the ranks train, the caller of train() may return
            bg.watching = True
            bg.started.set()
            if hasattr(view, "attach_stop"):
                view.attach_stop(bg.request_stop)
        try:
            while True:
                if bg is not None and bg.stop_requested.is_set():  # %dist stop-training: as the interrupt button
                    raise KeyboardInterrupt
                if time.monotonic() >= next_liveness:  # a dead engine never answers: stop waiting for it
                    next_liveness = time.monotonic() + LIVENESS_SECONDS
                    dead.update({r: d for r, d in self.cluster.dead_ranks().items() if not ars[r].ready()})
                    if dead and failed_since is None:
                        failed_since = time.monotonic()
                done = all(ar.ready() or r in dead for r, ar in enumerate(ars))
                if done:  # a result can arrive before the rank's last printed output
                    deadline = time.monotonic() + OUTPUT_WAIT
                    for ar in ars:
                        ar.wait_for_output(max(0.0, deadline - time.monotonic()))
                self._poll(ars, offsets, progress, state, view, show_ranks)
                if done:
                    break
                failed = {r for r, ar in enumerate(ars) if ar.ready() and not ar.successful() and r not in dead}
                for r in failed - released:  # let peers blocked in a collective fail at once
                    released.add(r)
                    try:
                        self.cluster.apply(r, calls.release)
                    except ClusterError:  # its engine died: the liveness check reports it
                        pass
                if failed and failed_since is None:
                    failed_since = time.monotonic()
                if failed_since is not None and time.monotonic() - failed_since > FAILURE_GRACE:
                    interrupted |= self._interrupt_ranks(ars)
                    failed_since = math.inf
                pending = [ar for r, ar in enumerate(ars) if not ar.ready() and r not in dead]
                if pending:
                    pending[0].wait(POLL_SECONDS)
        except KeyboardInterrupt:
            user_interrupt = True
            interrupted |= self._interrupt_ranks(ars)
            self._poll(ars, offsets, progress, state, view, show_ranks)
        dead.update(self.cluster.dead_ranks())
        failures = self._failures(ars, progress, interrupted, dead)
        if state is not None:
            for f in failures:
                status = "interrupted" if f["rank"] in interrupted or f.get("collateral") else "failed"
                error = f"{f['ename']}: {f['evalue']}"[:200]
                if f.get("collateral") and f["rank"] not in interrupted and failures[0] is not f:
                    error = f"stopped because rank {failures[0]['rank']} failed"
                state.set_status(status, ranks=[f["rank"]], error=error)
        if view is not None:
            view.close()
        clean = all(ar.ready() and ar.successful() for ar in ars)
        if (failures or not clean) and not dead:
            self._recover()
        if user_interrupt:
            spots = {r: (ar.get(0).get("where") if clean and isinstance(ar.get(0), dict) else None)
                     or progress.get(r) or {} for r, ar in enumerate(ars)}
            where = ", ".join(f"rank {r}: epoch {m.get('epoch')}, step {m.get('step')}"
                              for r, m in sorted(spots.items()) if m.get("epoch") is not None)
            how = "every rank stopped after the same step" if clean else "ranks stopped where they were"
            raise Interrupted(f"{what} interrupted: {how}" + (f" ({where})" if where else ""))
        if dead and self.auto_restart:
            note = self._restart_in_place()
            for f in failures:
                if f["rank"] in dead:
                    f["evalue"] = f["evalue"].split("; run %dist restart")[0] + f"; {note}"
        if failures:
            raise RankError(failures, context=what)
        return [ar.get(0) for ar in ars]

    def _failures(self, ars, progress, interrupted, dead) -> list:
        """RankError failure dicts: dead engines first, then raised exceptions, root cause first."""
        failures = [f for f in self.cluster.failures(ars, progress, collateral=interrupted) if f["rank"] not in dead]
        for rank, how in sorted(dead.items(), reverse=True):
            where = progress.get(rank) or {}
            failures.insert(0, dict(rank=rank, engine_id=self.cluster.engine_ids[rank], host=self.cluster.host_of(rank),
                                    ename="EngineDied", traceback="", epoch=where.get("epoch"), step=where.get("step"),
                                    evalue=f"{self.cluster.death_message(rank, how)}; run %dist restart for a "
                                           f"fresh world of {self.world_size} ranks"))
        return failures

    def _poll(self, ars, offsets, progress, state, view, show_ranks):
        for rank, ar in enumerate(ars):
            if rank in show_ranks or (ar.ready() and not ar.successful()):  # a failed rank's output too
                for stream_name, out in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                    text = getattr(ar, stream_name) or ""
                    seen = offsets.get((rank, stream_name), 0)
                    if len(text) > seen:
                        new = text[seen:]
                        offsets[(rank, stream_name)] = len(text)
                        prefix = f"[rank {rank}] " if len(self.cluster.engine_ids) > 1 else ""
                        lines = new.splitlines(keepends=True)
                        at_start = seen == 0 or text[seen - 1] == "\n"  # a line continued: no second tag
                        out.write("".join(("" if i == 0 and not at_start else prefix) + line
                                          for i, line in enumerate(lines)))
                        out.flush()
            if state is not None:
                msg = (ar.data or {}).get("distnb")
                if msg:
                    progress[rank] = msg
                    state.update(rank, msg)
        if view is not None:
            view.refresh()

    def _interrupt_ranks(self, ars):
        """SIGINT every rank still running, then wait (bounded) for them to stop."""
        running = [r for r, ar in enumerate(ars) if not ar.ready()]
        if not running:
            return set()
        # first SIGINT: a training cell stops every rank after the same step (engine.loop.StopRequest)
        self.cluster.signal(signal.SIGINT, running)
        deadline = time.monotonic() + STOP_WAIT
        for r in running:
            ars[r].wait(max(0.0, deadline - time.monotonic()))
        stuck = [r for r in running if not ars[r].ready()]
        if stuck:  # second SIGINT: KeyboardInterrupt wherever they are
            self.cluster.signal(signal.SIGINT, stuck)
            deadline = time.monotonic() + INTERRUPT_WAIT
            for r in stuck:
                ars[r].wait(max(0.0, deadline - time.monotonic()))
        return {r for r in running if not (ars[r].ready() and ars[r].successful())}

    def _recover(self):
        """After a failure: re-form the process group so the next cell works."""
        self.cluster.check_alive()
        try:
            self._generation += 1
            self.cluster.reform()
        except Exception as exc:
            raise ClusterError(f"could not re-form the process group after the failure ({exc}); "
                               "run %dist restart") from exc

    # running code --------------------------------------------------------
    def run(self, code: str, all_output: bool = False) -> list:
        """Run ``code`` on every rank (``rank``, ``world_size``, ``device`` defined there).

        Output is printed live, tagged ``[rank r]``, for rank 0 only unless
        ``all_output``. Returns the repr of each rank's final expression (or None).

        Raises
        ------
        RankError
            Naming the failing rank(s) with their remote tracebacks; the process group
            is re-formed first, so the next cell works.
        """
        self._check_running()
        if not isinstance(code, str):
            raise PlanError(f"code must be a string of Python source, got {type(code).__name__}")
        try:
            compile(code, "<%%dist>", "exec")
        except SyntaxError as exc:
            raise PlanError(f"the cell is not valid Python: {exc}") from None
        ars = self.cluster.apply_all(calls.run_cell, code)
        show = range(self.world_size) if all_output else (0,)
        values = self._watch(ars, "%%dist cell", show_ranks=tuple(show))
        for rank in show:
            if values[rank] is not None:
                prefix = f"[rank {rank}] " if self.world_size > 1 else ""
                print(f"{prefix}{values[rank]}")
        return values

    def push(self, *names, auto=False, **values) -> None:
        """Send notebook objects to every rank by value (classes and functions included).

        ``push("MLP", "net")`` sends the kernel's ``MLP`` and ``net``; ``push(x=obj)``
        binds ``obj`` to ``x`` on the ranks. Tensors travel through shared memory when the
        ranks are on this host, else as zero-copy buffers.
        """
        from .engine.wire import pack
        from .transfer import outgoing

        self._check_running()
        items = {name: self._lookup(name) for name in names}
        items.update(values)
        if not items:
            raise PlanError("push needs at least one name, e.g. %dist push MLP")
        ars = []
        with contextlib.ExitStack() as files:  # tensors: shared memory on one host, else zero-copy frames
            for name, value in items.items():
                try:
                    payload, descs, buffers = pack(value)
                except Exception as exc:
                    why = " (sent because the training cell reads it)" if auto else ""
                    raise PlanError(f"cannot send {name!r} ({type(value).__name__}) to the ranks{why}: "
                                    f"{type(exc).__name__}: {exc}. Create it on the ranks in a %%dist cell "
                                    "instead") from None
                sent = files.enter_context(outgoing(self.cluster, buffers))
                ars += self.cluster.apply_all(calls.bind, name, payload, descs, *sent)
            self.cluster.wait_all(ars, timeout=self.cluster.spec.timeout, what="push")

    def pull(self, name: str, rank=None):
        """The value of ``name`` on ``rank`` (or a list over all ranks when rank is None)."""
        self._check_running()
        if not isinstance(name, str) or not name.isidentifier():
            raise PlanError(f"pull/gather take a variable name defined on the ranks, got {name!r}")
        ranks = range(self.world_size) if rank is None else [self._rank(rank)]
        from .engine import wire

        ars = [self.cluster.apply(r, calls.lookup, name) for r in ranks]
        packed = self.cluster.wait_all(ars, timeout=self.cluster.spec.timeout, what=f"pull {name}")
        values = [wire.loads(*p) for p in packed]
        return values if rank is None else values[0]

    def _rank(self, rank):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise PlanError(f"--rank must be between 0 and {self.world_size - 1}, got {rank!r}")
        return rank

    def scatter(self, name: str, data=None, seed: int = 0, quiet: bool = False, num_shards=None) -> list:
        """Give each rank a disjoint shard of ``data`` (default: the kernel's ``name``).

        Shards are dealt from a seeded permutation (see :mod:`distnb.engine.shard`);
        together they cover the data. On the ranks ``name`` is bound to the shard, with
        the same structure (tensor, tuple or dict of tensors). With ``num_shards`` smaller
        than world_size, rank ``r`` gets shard ``r % num_shards`` (``num_shards=1``: every
        rank holds the whole set, as model parallelism needs).

        Returns
        -------
        list of int
            Samples per rank.
        """
        from .engine import shard as sharding
        from .transfer import columns_of, fingerprint, outgoing_rows

        self._check_running()
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise PlanError(f"--seed must be a non-negative integer, got {seed!r}")
        obj = self._lookup(name, "data") if data is None else data
        structure, columns, n = columns_of(obj, name)
        num_shards = self.world_size if num_shards is None else num_shards
        if n < num_shards:
            raise PlanError(f"{name} has {n} samples, fewer than world_size={self.world_size}")
        shards = sharding.assign(n, num_shards, seed)
        ars = []
        with contextlib.ExitStack() as files:  # each shard written once (shared memory on one host)
            for index, idx in enumerate(shards):
                ranks = range(index, self.world_size, num_shards)
                descs, sent = files.enter_context(outgoing_rows(self.cluster, columns, idx, ranks))
                for rank in ranks:
                    ars.append(self.cluster.apply(rank, calls.install_shard, name, n,
                                                  num_shards, seed, index, structure, descs, *sent))
            sizes = self.cluster.wait_all(ars, timeout=self.cluster.spec.timeout, what=f"scatter {name}")
        self._data[name] = dict(fingerprint=fingerprint(obj), seed=seed, num_samples=n, shards=shards,
                                structure=structure, num_shards=num_shards)
        if not quiet:
            print(f"distnb: scattered {name} ({n} samples) as shards of {', '.join(map(str, sizes))}")
        return sizes

    def gather(self, name: str):
        """Collect ``name`` from every rank.

        For data sent by :meth:`scatter` the shards are put back in the original sample
        order (a tensor, tuple or dict like the original); otherwise a list by rank.
        """
        import torch

        values = self.pull(name)
        info = self._data.get(name)
        if info is None:
            return values
        values = values[:info["num_shards"]]  # ranks beyond hold copies of the same shards
        kind = info["structure"][0]
        cols_by_rank = [[v] if kind == "tensor" else list(v.values()) if kind == "dict" else list(v)
                        for v in values]
        columns = []
        for j in range(len(cols_by_rank[0])):
            parts = [cols[j] for cols in cols_by_rank]
            if not all(isinstance(p, torch.Tensor) and len(p) == len(i) for p, i in zip(parts, info["shards"])):
                return values
            out = parts[0].new_empty((info["num_samples"],) + tuple(parts[0].shape[1:]))
            for p, idx in zip(parts, info["shards"]):
                out[idx] = p
            columns.append(out)
        if kind == "tensor":
            return columns[0]
        if kind == "dict":
            return dict(zip(info["structure"][1], columns))
        return tuple(columns)

    # training ------------------------------------------------------------
    def train(self, code: str, model, data, *, progress="auto", all_output=False, quiet=False,
              background=False, **options) -> TrainResult:
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
        data : str or data set
            Scattered as shards (see :meth:`scatter`) unless the ranks hold it already.
        progress : {"auto", "widgets", "text", "none"}
        all_output : bool
            Show every rank's printed output (default rank 0 only).
        background : bool
            Return as soon as the ranks train, leaving the kernel free while the dashboard
            updates; returns a :class:`~distnb.background.BackgroundRun`. :meth:`wait` returns
            the TrainResult (the weights are back by then), :meth:`stop_training` stops it;
            other distnb calls raise BusyError until then.
        **options
            :class:`~distnb.plan.TrainPlan` fields: epochs, batch_size, optimizer, lr,
            seed, strategy, reset, target_loss, loop, drop_last.

        Returns
        -------
        TrainResult

        Raises
        ------
        PlanError
            Invalid options or names, before anything runs on the ranks.
        RankError
            A rank raised; the weights of the last completed step are still loaded back
            and the process group is re-formed.
        """
        if background:
            self._check_running()
            self._background = BackgroundRun(self.train, dict(
                code=code, model=model, data=data, progress=progress, all_output=all_output, quiet=quiet, **options))
            try:
                return self._background.start()
            except BaseException:
                self._background = None
                raise
        import torch

        from .engine import shard as sharding
        from .engine import strategies

        t0 = time.perf_counter()
        self._check_running()
        model_name, model_obj = self._named(model, "model")
        data_name, data_obj = self._named(data, "data")
        if not isinstance(code, str) or not code.strip():
            raise PlanError("the training cell body is empty: write one step that sets `loss`, e.g. "
                            "`x, y = batch; loss = F.cross_entropy(model(x), y)`")
        if progress not in PROGRESS_MODES:
            raise PlanError(f"progress must be one of {', '.join(PROGRESS_MODES)}, got {progress!r}")
        unknown = sorted(set(options) - TRAIN_OPTIONS)
        if unknown:
            raise PlanError(f"unknown training option(s) {', '.join(unknown)}; known: {', '.join(sorted(TRAIN_OPTIONS))}")
        options.setdefault("report_interval", REPORT_INTERVAL[view_kind(progress)])
        if isinstance(options.get("checkpoint_dir"), str) and options["checkpoint_dir"]:
            options["checkpoint_dir"] = os.path.abspath(os.path.expanduser(options["checkpoint_dir"]))
        remembered = self._optimizer_of.get(model_name)
        if remembered is not None and options.get("optimizer") is None:
            # the ranks keep their live optimizer anyway; one made new (the model sent again after a
            # restart, a strategy switch, --reset or a changed model) is the one the user chose last
            options["optimizer"] = remembered[0]
            if options.get("lr") is None:
                options["lr_if_new"] = remembered[1]
        plan = TrainPlan(model=model_name, data=data_name, **options)
        if not isinstance(model_obj, torch.nn.Module):
            raise PlanError(f"--model {model_name} is a {type(model_obj).__name__}, not a torch.nn.Module")
        if not plan.builtin_optimizer:
            if plan.optimizer not in self.ns:
                raise PlanError(f"--optimizer {plan.optimizer!r} is neither sgd, adam, adamw nor a name defined in "
                                "the notebook (a function params -> torch.optim.Optimizer)")
            factory = self.ns[plan.optimizer]
            if not callable(factory):
                raise PlanError(f"--optimizer {plan.optimizer} must be callable: f(params) -> Optimizer")
            self.push(plan.optimizer)
        try:
            strategies.check(plan, model_obj, self.world_size, ns=self.ns)
        except strategies.StrategyError as exc:
            raise PlanError(f"--strategy {plan.strategy}: {exc}") from None
        num_shards = strategies.data_parallel_size(plan, self.world_size)
        for option in (plan.loss, plan.tp_plan):
            if option is not None:
                self._lookup(option, "--loss" if option == plan.loss else "--tp-plan")
                self.push(option)
        self._autopush(code, exclude=(model_obj, data_obj))
        sent = self._ensure_model(plan, model_obj, quiet)
        self._ensure_data(plan, data_obj, quiet or not sent, num_shards, silent=quiet)
        n = self._data[data_name]["num_samples"]
        try:
            sharding.check_sizes(n, num_shards, plan.batch_size, plan.drop_last)
        except ValueError as exc:
            raise PlanError(f"--data {data_name}: {exc}") from None
        steps = sharding.steps_per_epoch(n, num_shards, plan.batch_size, plan.drop_last)
        state = ProgressState(self.world_size, steps * plan.epochs, plan.epochs,
                              hosts=[r["host"] for r in self.cluster.ranks],
                              devices=[r["device"] for r in self.cluster.ranks], strategy=plan.strategy)
        view = make_view(state, progress)
        view.show()
        ars = self.cluster.apply_all(calls.train, plan.to_dict(), code)
        show = tuple(range(self.world_size)) if all_output else (0,)
        try:
            rows = self._watch(ars, "training", state, view, show_ranks=show)
        except (RankError, KeyboardInterrupt):
            self._weights_back(plan.model, model_obj, best_effort=True)
            if plan.builtin_optimizer:  # a built-in optimizer was not what failed (a dead engine, the body, ...)
                self._remember_optimizer(plan)
            raise
        self._weights_back(plan.model, model_obj, packed=rows[0].pop("state"))
        for row in rows:
            row.pop("state", None)
            row.update(row.pop("holdings", {}))
        if rows[0]["note"] and not quiet:
            print(f"distnb: {rows[0]['note']}")
        if rows[0].get("skipped_steps") and not quiet:
            print(f"distnb: skipped {_count(rows[0]['skipped_steps'], 'step')} whose loss was not finite on some "
                  "rank (--nan skip): no update was applied for them")
        if rows[0].get("resumed") and not quiet:
            print(f"distnb: resumed from checkpoint {rows[0]['resumed']}")
        if rows[0].get("continued") and not quiet:
            c = rows[0]["continued"]
            print(f"distnb: continued epoch {c['epoch']} where it stopped ({c['samples']} samples per rank "
                  "already trained); it counts as the first of this cell's epochs")
        result = TrainResult(rows, plan, time.perf_counter() - t0, num_shards)
        self.last_result = result
        self._remember_optimizer(plan)  # what the ranks accepted becomes the model's chosen optimizer
        return result

    def _remember_optimizer(self, plan) -> None:
        """The optimizer and lr ``plan`` asked for become the model's choice for optimizers made new later."""
        if plan.optimizer is not None:
            known = self._optimizer_of.get(plan.model)
            same = known is not None and known[0] == plan.optimizer
            self._optimizer_of[plan.model] = (plan.optimizer, plan.lr if plan.lr is not None else
                                              known[1] if same else None)

    # checkpoints -----------------------------------------------------------
    def _trained_model(self, model):
        if model is not None:
            return self._named(model, "model")
        if self.last_result is None:
            raise PlanError("no model has been trained in this session; name one with --model")
        name = self.last_result.plan.model
        return name, self._lookup(name, "--model")

    def save(self, directory: str, model=None, quiet=False) -> dict:
        """Checkpoint the ranks' live model, optimizer and position with torch.distributed.checkpoint.

        Parameters
        ----------
        directory : str
            Parent folder; the checkpoint is ``directory/step_<global step>``.
        model : str or torch.nn.Module, optional
            Default: the model of the last training cell.

        Returns
        -------
        dict
            The checkpoint's metadata: path, epoch, epoch_step, steps, seconds.

        Raises
        ------
        PlanError
            No such model, or it has not been trained on the ranks.
        RankError
            A rank failed to write (e.g. the folder is not writable); nothing is marked complete.
        """
        self._check_running()
        name, _ = self._trained_model(model)
        if name not in self._models:
            raise PlanError(f"{name} is not on the ranks (train it with %%distrain first)")
        directory = os.path.abspath(os.path.expanduser(directory))
        ars = self.cluster.apply_all(calls.save_checkpoint, name, directory)
        meta = self._watch(ars, f"saving {name}")[0]
        if not quiet:
            print(f"distnb: saved {name} to {meta['path']} (epoch {meta['epoch']}, step {meta['epoch_step']} of it, "
                  f"{meta['steps']} steps in all) in {meta['seconds']:.2f} s")
        return meta

    def load(self, directory: str, model=None, quiet=False) -> dict:
        """Restore a checkpoint into the ranks (and the kernel's model) with its strategy and optimizer.

        The kernel's model (same class and parameter names) is sent, distributed the way the
        checkpoint was saved, and its model, optimizer state, epoch and sampler position are
        loaded on every rank; the restored weights are loaded into the kernel's model too.
        The next ``%%distrain`` with the same strategy continues from there.

        Parameters
        ----------
        directory : str
            A ``step_*`` checkpoint folder, or its parent (the newest complete one is used).
        model : str or torch.nn.Module, optional
            Default: the model of the last training cell.

        Returns
        -------
        dict
            The checkpoint's metadata.

        Raises
        ------
        PlanError
            No complete checkpoint there, or no such model in the notebook.
        """
        from .engine import checkpoint
        from .plan import TrainPlan

        self._check_running()
        name, model_obj = self._trained_model(model)
        directory = os.path.abspath(os.path.expanduser(directory))
        try:
            meta = checkpoint.read_meta(directory)
        except FileNotFoundError as exc:
            raise PlanError(str(exc)) from None
        saved = dict(meta["plan"], model=name, reset=True, checkpoint_dir=None, checkpoint_every=None)
        plan = TrainPlan.from_dict(saved)
        self._ensure_model(plan, model_obj, quiet=True)
        ars = self.cluster.apply_all(calls.restore, name, meta["path"])
        self._watch(ars, f"loading {name}")
        self._optimizer_of[name] = (meta["optimizer"], None)  # the restored optimizer is the live one now
        self._weights_back(name, model_obj)
        if not quiet:
            print(f"distnb: loaded {meta['path']} into {name} on {_count(self.world_size, 'rank')} and the kernel "
                  f"(--strategy {plan.strategy}, epoch {meta['epoch']}, step {meta['epoch_step']} of it)")
        return meta

    def _autopush(self, code, exclude=()) -> None:
        """Push the notebook names a training body reads (modules, functions, classes, values).

        Re-sent only when the kernel's object changed (a re-run defining cell makes a new
        object), so the ranks always use the current definitions.
        """
        from .transfer import fingerprint, free_names

        try:
            names = free_names(code)
        except SyntaxError as exc:
            raise PlanError(f"the cell body is not valid Python: {exc}") from None
        todo = {}
        for name in sorted(names - RESERVED_NAMES):
            if name not in self.ns:
                continue
            value = self.ns[name]
            if any(value is e for e in exclude):
                continue
            fp = fingerprint(value)
            if self._pushed.get(name) != fp:
                todo[name] = (value, fp)
        if todo:
            self.push(auto=True, **{k: v for k, (v, _) in todo.items()})
            self._pushed.update({k: fp for k, (_, fp) in todo.items()})

    def _named(self, value, what):
        if isinstance(value, str):
            return value, self._lookup(value, f"--{what}")
        for k, v in self.ns.items():
            if v is value and k.isidentifier() and not k.startswith("_"):
                return k, value
        name = f"_distnb_{what}"
        return name, value

    def _ensure_model(self, plan, model_obj, quiet) -> bool:
        """Send the model unless the ranks hold this state, distributed in a way that can be reused.

        A strategy that shards the module in place (fsdp, tensor, pipeline) cannot be
        re-distributed another way, nor survive a re-formed process group: the model is then
        sent again from the kernel's weights (which are the last trained ones).
        """
        from .engine import strategies
        from .engine.wire import pack
        from .transfer import fingerprint, outgoing

        fp = fingerprint(model_obj)
        key = plan.strategy_key()
        last = self._distributed.get(plan.model)
        reusable = last is None or last[0][0] == key[0] and not (
            strategies.strategy_class(last[0][0]).modifies_module and last != (key, self._generation))
        self._distributed[plan.model] = (key, self._generation)
        if not plan.reset and reusable and self._models.get(plan.model) == fp:
            return False
        payload, descs, buffers = pack(model_obj)
        with outgoing(self.cluster, buffers) as sent:  # shared memory on one host, else zero-copy frames
            ars = self.cluster.apply_all(calls.install_model, plan.model, payload, descs,
                                         *sent)
            counts = self.cluster.wait_all(ars, timeout=self.cluster.spec.timeout + 60,
                                           what=f"sending {plan.model}")
        self._models[plan.model] = fp
        if not quiet:
            if plan.checkpoint_dir and not plan.reset and _has_checkpoint(plan.checkpoint_dir):
                then = "it resumes from the newest checkpoint in --checkpoint-dir"
            else:
                then = f"fresh {plan.optimizer or 'sgd'} optimizer, epoch 0"
            print(f"distnb: sent {plan.model} ({type(model_obj).__name__}, {counts[0]:,} parameters) to "
                  f"{self.world_size} ranks; {then}")
        return True

    def _ensure_data(self, plan, data_obj, quiet, num_shards, silent=False) -> None:
        """Scatter ``data_obj`` unless the ranks hold it cut this way; say how batches are cut when
        that changes (unless ``silent``)."""
        from .engine import shard as sharding
        from .transfer import fingerprint

        info = self._data.get(plan.data)
        if info is None or info["fingerprint"] != fingerprint(data_obj) or info["seed"] != plan.seed or \
                info["num_shards"] != num_shards:
            self.scatter(plan.data, data_obj, seed=plan.seed, quiet=True, num_shards=num_shards)
            info = self._data[plan.data]
            quiet = False
        layout = (plan.batch_size, plan.drop_last)
        if info.get("layout") != layout:  # say how batches are cut whenever that changes
            info["layout"] = layout
            quiet = False
        if quiet or silent:
            return
        n, w = info["num_samples"], num_shards
        if num_shards == 1 and self.world_size > 1:
            steps = sharding.steps_per_epoch(n, 1, plan.batch_size, plan.drop_last)
            print(f"distnb: {plan.data}: {_count(n, 'sample')}, the whole set on every rank (--strategy "
                  f"{plan.strategy} trains all ranks on the same batches); {_count(steps, 'step')}/epoch of "
                  f"{plan.batch_size}")
            return
        per = sharding.samples_per_epoch(n, w, plan.drop_last)
        steps = sharding.steps_per_epoch(n, w, plan.batch_size, plan.drop_last)
        lens = [sharding.shard_length(n, w, r) for r in range(w)]
        if plan.drop_last:
            how = f"drop: each rank uses {per} of its {min(lens)}-{max(lens)} samples, full batches only"
        elif min(lens) < per:
            how = f"pad: ranks with {min(lens)} samples repeat {per - min(lens)} so all visit {per}"
        else:
            how = f"every rank visits {per} samples"
        print(f"distnb: {plan.data}: {_count(n, 'sample')} in {_count(w, 'shard')}; {how}; "
              f"{_count(steps, 'step')}/epoch of "
              f"{plan.batch_size} per rank")

    def _weights_back(self, name, model_obj, best_effort=False, packed=None) -> None:
        """Load rank 0's weights (``packed`` from its training result, else fetched) into ``model_obj``."""
        from .transfer import fingerprint, load_state_into

        try:
            if packed is None:  # every rank: sharded strategies assemble the state with collectives
                ars = self.cluster.apply_all(calls.pull_state, name)
                packed = self.cluster.wait_all(ars, timeout=self.cluster.spec.timeout, what="weights back")[0]
            keys, descs, sizes, flat = packed
            load_state_into(model_obj, keys, descs, sizes, flat)
            self._models[name] = fingerprint(model_obj)
        except Exception:
            if not best_effort:
                raise
