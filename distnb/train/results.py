"""What the cluster and a training cell return: the status table and the TrainResult (kernel side)."""

from __future__ import annotations

import math
import time

from distnb.cluster.recovery import dead_rank_fix, unregistered_fix
from distnb.core import calls
from distnb.core.errors import ClusterError, rank_list, ranks_named
from distnb.core.tables import Table, count
from distnb.display.aggregate import SCALE_THRESHOLD
from distnb.display.text import start_notes
from distnb.train import carried, compiled
from distnb.train.stepnotes import convention_note, stop_request
from distnb.train.stepnotes import notes as step_notes


class StatusTable(Table):
    """``%dist status``: one row per rank; the title names the batch job, the controller's pid and the store's address.

    Each row has the columns' keys and ``died``: how a dead rank's engine ended (``killed by
    SIGKILL ...``, ``exited with status 3``), else None. The ``died`` column is shown when a rank
    is dead, and the title then names each dead rank and the fix. A ``registered`` column is shown
    when an engine process runs that the controller no longer has registered (it missed the
    controller's heartbeats); such a rank's row is ``alive`` True, ``registered`` False.

    Attributes
    ----------
    controller_pid : int or None
        The ipyparallel controller's process id.
    store : str
        ``host:port`` of the torch.distributed store (rank 0's).
    job_id : str or None
        The batch job that holds the engines (``--launcher slurm``), also named in the title.
    on_failure : str
        What a cell does when an engine dies during it (``--on-failure``: ``stop``, ``restart`` or
        ``shrink``), also named in the title (``on failure: stop``).
    """

    columns = ("rank", "engine_id", "host", "node_rank", "local_rank", "pid", "device", "backend", "threads",
               "cores", "alive")


class TrainResult(Table):
    """What a training cell returns: per-rank figures and the loss history.

    Attributes
    ----------
    rows : list of dict
        Per rank: rank, steps (micro-steps: batches), samples, seconds (training time on the rank),
        cpu_seconds (CPU seconds the rank's engine process, all its threads, used in that time:
        ``time.process_time``; a figure a busy machine disturbs far less than wall time),
        samples_per_s, final_loss (the rank's mean loss over its last epoch of the cell; with no
        epoch finished, over the steps it trained, ``final_loss_steps`` of them), param_bytes
        (bytes of parameters the rank holds: all of them for ddp, a shard for fsdp and
        tensor, its stage for pipeline), peak_memory (bytes: the rank's peak resident set on CPU, or
        ``torch.cuda.max_memory_allocated`` on a GPU; ``memory_kind`` ``"rss"`` or ``"cuda"``, as on the
        dashboard) and, for pipeline, stage.
    kernel_peak_memory : int or None
        Bytes: the kernel's own peak resident set over the cell (the model sent, trained and its weights
        back in place; shared-memory segments it maps count). ``kernel_memory_kind``: ``"rss"`` when
        measured from the cell's start (Linux ``/proc/self/clear_refs``), ``"rss-lifetime"`` when only
        the process's lifetime peak could be read (``distnb.train.kernel_memory``).
    epoch_losses : list of float
        Mean loss over all ranks for each epoch run in this cell.
    epochs : list of int
        The epoch numbers run (they continue across cells).
    final_loss : float
        The mean loss over all ranks of the cell's last epoch (``epoch_losses[-1]``). A cell that
        finished no epoch (interrupted in its first, or a ``--loop`` body that never iterates
        ``ctx.epochs()``) has the mean loss of the steps it trained instead; NaN only when no step
        reported a loss. ``final_loss_of`` says which: ``"epoch"``, ``"steps"`` or None (no loss).
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
        True when --target-loss was reached, --patience ran out or a rank asked to stop.
    stop_request : dict or None
        A stop a rank asked for with ``ctx.request_stop(reason)``: ``ranks`` (the ranks that asked),
        ``reason`` (the lowest one's), ``asked_at`` and ``step`` (the global optimizer step it was
        asked at, and the one every rank stopped after).
    skipped : list of dict
        Each optimizer step ``--nan skip`` dropped: ``step`` (of the cell, from 1), ``micro_steps``
        (first and last, the model's count) and ``ranks`` (where the loss was inf/NaN).
    token_weighted : bool
        The body set ``ctx.num_items``: gradients and logged losses are token-weighted over the
        whole global batch. Otherwise ``loss_convention`` states the convention: the mean per
        micro-batch, then over micro-steps and ranks.
    loss_scale : float or None
        ``--precision fp16``: the GradScaler's scale at the end of the cell.
    step_notes : list of str
        What the cell says of how its steps were done (``distnb.train.stepnotes``).
    optimizer_steps : int
        Optimizer steps of this cell (micro-steps / --accumulate, rounded up per epoch); with
        ``--loop``, the ``step()`` calls the body made on a ``torch.optim.Optimizer``.
    loss_history : dict
        ``{rank: [(step, loss), ...]}`` per micro-step (steps count across cells; a long run
        keeps at most about 2000 points, consecutive pairs averaged).
    mean_loss_history : list of tuple
        ``(step, loss)``: the mean over ranks at each step of ``loss_history``.
    lr_history : list of tuple
        ``(step, lr)``: the lr of every optimizer step.
    grad_norm_history : list of tuple
        ``(step, norm)``: the pre-clip total gradient norm of every optimizer step (``--clip-grad-norm``).
    lr : float or None
        The lr now.
    grad_norm : float or None
        The last pre-clip gradient norm.
    val_history : list of dict
        Every validation: epoch, loss, metric, metric_name, samples, step.
    val_loss : float or None
        The validation loss of the weights the model holds: the last validation's, or with
        ``restored_best`` the best one's.
    val_metric : float or None
        The validation metric of those weights; ``metric_name`` names the metric.
    best_epoch : int or None
        The epoch of the best validation loss; ``restored_best``: its weights were loaded back.
    converged : bool
        True when the run stopped on --target-loss or --patience; False when it used up its epochs
        (or was interrupted). ``stop_reason``: ``"target"``, ``"patience"``, ``"epochs"``,
        ``"requested"`` (``ctx.request_stop``) or ``"interrupted"``.
    interrupted : bool
        The cell was interrupted (the interrupt button, ``%dist stop-training``): every rank
        stopped after the same step, and this is what was trained until then.
    loss_dtype : str or None
        ``"bfloat16"`` or ``"float16"`` when the body's loss was a tensor of that dtype: every figure here was
        reduced from it upcast to float32 (each step's value still carries that dtype's rounding); None for a
        float32 or wider loss.
    compile_seconds : float or None
        With --compile: the first step's extra time (compiling), seconds, only when dynamo compiled graphs
        this cell (None when nothing compiled); ``speedup``: eager step time of an earlier cell / compiled step
        time, when known and something compiled.
    dynamo : dict
        With --compile, ``{rank: figures}`` of what dynamo did this cell: ``graphs``, ``graphs_since_compile``
        (0: nothing ever compiled for the model), ``graph_breaks``, ``break_reasons``, ``recompiles``,
        ``recompile_reasons`` (``distnb.engine.strategies.compiling.report``); empty without it.
    num_params : int or None
        Parameters of the model, each shared one counted once.
    num_trainable_params : int or None
        Those that require gradients, the ones the cell trained (LoRA: the adapters); the title says
        "N of M parameters trained" when some were frozen.
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
        self.final_loss, self.final_loss_of = _final_loss(self.epoch_losses, rows)
        self._step_figures(rows)
        self.interrupted = any(r.get("interrupted") for r in rows)
        self.interrupted_message = "training interrupted" if self.interrupted else ""
        self.stop_reason = "interrupted" if self.interrupted else first.get("stop_reason") or "epochs"
        self.stop_request = stop_request(rows)
        self.skipped = list(first.get("skipped") or [])
        self.token_weighted = bool(first.get("token_weighted"))
        self.loss_scale = first.get("loss_scale")
        self.loss_convention = convention_note(rows) or None
        self.step_notes = step_notes(rows, plan)
        self.converged = self.stop_reason in ("target", "patience")
        self.kernel_peak_memory = self.kernel_memory_kind = None  # set by distnb.train.training.finish
        self.num_params = self.num_trainable_params = None  # set by distnb.train.training.finish (set_param_counts)
        self._make_title()

    def set_param_counts(self, num_params: int, num_trainable_params: int) -> None:
        """Record the model's parameter count and how many of them trained (the title says it when some were frozen)."""
        self.num_params, self.num_trainable_params = num_params, num_trainable_params
        self._make_title()

    def _step_figures(self, rows) -> None:
        first = rows[0]
        self.optimizer_steps = first.get("optimizer_steps", first["steps"])
        self.loss_history = {r["rank"]: list(r.get("loss_history", ())) for r in rows}
        steps = [s for s, _ in self.loss_history[first["rank"]]]
        per_rank = [dict(h) for h in self.loss_history.values()]
        self.mean_loss_history = [(s, math.fsum(h[s] for h in per_rank) / len(per_rank)) for s in steps
                                  if all(s in h for h in per_rank)]
        self.lr_history = list(first.get("lr_history", ()))
        self.grad_norm_history = list(first.get("grad_norm_history", ()))
        self.lr, self.grad_norm = first.get("lr"), first.get("grad_norm")
        self.val_history = list(first.get("val_history", ()))
        self.best_epoch, self.restored_best = first.get("best_epoch"), bool(first.get("restored_best"))
        last = self.val_history[-1] if self.val_history else {}
        if self.restored_best:  # the model holds the best validation's weights: its figures are the result's
            last = next((v for v in reversed(self.val_history) if v.get("epoch") == self.best_epoch), last)
        self.val_loss, self.val_metric = last.get("loss"), last.get("metric")
        self.metric_name = first.get("metric_name")
        self.loss_dtype = next((r["loss_dtype"] for r in rows if r.get("loss_dtype")), None)
        first["loss_dtype"] = self.loss_dtype  # the notes read rank 0's row (pipeline: the last stage computes it)
        self.compile_seconds, self.speedup = compiled.compile_seconds(first), None
        self.dynamo = {r["rank"]: r["dynamo"] for r in rows if r.get("dynamo") is not None}
        if compiled.compiled_anything(first) and first.get("first_step_seconds") is not None:
            if first.get("eager_step_seconds") and first["step_seconds"] > 0:
                self.speedup = first["eager_step_seconds"] / first["step_seconds"]

    def mark_interrupted(self, message: str) -> None:
        """Mark this result as the part of an interrupted run (``message``: where the ranks stopped)."""
        self.interrupted, self.interrupted_message, self.stop_reason, self.converged = True, message, \
            "interrupted", False
        self._make_title()

    def _loss_text(self) -> str:
        """``final mean loss X``; for a cell that finished no epoch, the mean loss of the steps it trained."""
        if self.final_loss_of == "epoch":
            return f"final mean loss {self.final_loss:.4f}"
        if self.final_loss_of == "steps":
            steps = max(r.get("final_loss_steps") or 0 for r in self.rows)
            return f"no epoch finished, mean loss of its {count(steps, 'step')} {self.final_loss:.4f}"
        return "no epoch finished, no step loss reported"

    def _make_title(self) -> None:
        how = {"target": "reached --target-loss", "patience": "converged (--patience)", "interrupted": "interrupted",
               "requested": "stopped on request (ctx.request_stop)"}.get(self.stop_reason,
                                                                         count(len(self.epochs), "epoch"))
        parts = [self.plan.strategy, count(len(self.rows), "rank"), how, self._loss_text()]
        if self.num_params and self.num_trainable_params is not None and self.num_trainable_params < self.num_params:
            share = 100 * self.num_trainable_params / self.num_params
            parts.append(f"{self.num_trainable_params:,} of {self.num_params:,} parameters trained ({share:.2g}%)")
        if self.val_loss is not None:
            metric = f", {self.metric_name} {self.val_metric:.4f}" if self.val_metric is not None else ""
            parts.append(f"validation loss {self.val_loss:.4f}{metric}")
        if self.plan.accumulate > 1:
            parts.append(count(self.optimizer_steps, "optimizer step"))
        if self.lr is not None and (self.plan.lr_schedule or len({v for _, v in self.lr_history}) > 1):
            parts.append(f"lr {self.lr:.3g}")
        if self.grad_norm is not None:
            parts.append(f"grad norm {self.grad_norm:.3g}")
        parts += [f"{self.samples_per_s:.0f} samples/s", f"{self.wall_seconds:.2f} s"]
        self.title = " · ".join(parts)


def _final_loss(epoch_losses, rows) -> tuple:
    """``(final_loss, final_loss_of)`` of a result (see :class:`TrainResult`): the last epoch's mean, else the
    mean over the ranks' steps of the cell (each rank's mean weighted by its steps), else ``(nan, None)``."""
    if epoch_losses:
        return epoch_losses[-1], "epoch"
    weighted = [(r["final_loss"], r.get("final_loss_steps") or 0) for r in rows if r.get("final_loss") is not None]
    weighted = [(x, n) for x, n in weighted if n > 0 and math.isfinite(x)]
    if not weighted:
        return math.nan, None
    return math.fsum(x * n for x, n in weighted) / sum(n for _, n in weighted), "steps"


def loss_dtype_note(dtype: str) -> str:
    """The sentence said once when the body's loss was a low-precision tensor (``dtype``: ``"bfloat16"``)."""
    return (f"the body's loss is a {dtype} tensor: distnb upcast it to float32 to reduce and log it (step losses, "
            f"epoch means, validation, the result); each step's value still carries {dtype}'s rounding (about 3 "
            "significant digits for bfloat16): compute the loss in float32 for exact figures, e.g. "
            "`loss = F.mse_loss(out.float(), y.float())`")


def training_notes(first: dict, started: bool = True) -> list:
    """The sentences a finished training cell prints, from rank 0's row (``first``).

    ``started``: with the :func:`start_notes` first (False: the progress printed them already).
    """
    notes = start_notes(first) if started else []
    if first.get("loss_dtype"):
        notes.append(loss_dtype_note(first["loss_dtype"]))
    if first.get("restored_best"):
        notes.append(f"loaded the weights of the best validation loss back (epoch {first['best_epoch']})")
    said = compiled.note(first)
    if said:
        notes.append(said)
    return notes


def status_table(session, timeout: float, busy: bool = False) -> StatusTable:
    """Ask every live rank who it is (waiting at most ``timeout`` seconds in all); one row per rank.

    A rank whose engine process has ended is not asked: its row is what the kernel recorded at the
    start, ``alive`` False and ``died`` how it ended (the title names the fix). Nor is a rank whose
    engine process runs but that the controller no longer has registered (it missed its heartbeats):
    ``alive`` True, ``registered`` False (a column shown then), and the title says so and names the
    fix. With ``busy`` (a
    background training run holds the ranks) no rank is asked: each row is what the kernel recorded
    at the start (host, pid, local_rank, ...), ``alive`` is whether the engine process still runs
    as the kernel sees it, and the title says so.
    """

    from distnb.cluster import hub  # loads psutil: at first use, not when this module is imported

    cluster = session.cluster
    dead = cluster.dead_ranks()
    gone = hub.controller_death(cluster)  # nothing can be asked through a dead controller
    unregistered = [] if gone else _unregistered(cluster, dead)
    ars = {} if busy or gone else _ask_info(cluster, calls.info, dead, unregistered)
    deadline = time.monotonic() + timeout
    rows = []
    for rank in range(cluster.world_size):
        base = dict(cluster.ranks[rank], alive=False)
        if rank in unregistered:  # its process runs, but the controller dropped it: nothing can be asked
            base.update(alive=True, registered=False)
        elif rank in ars:
            ars[rank].wait(max(0.0, deadline - time.monotonic()))
            try:
                base.update(ars[rank].get(0), alive=True)
            except Exception:
                pass
        if busy or gone:
            base.update(alive=rank not in dead)
        base.update(died=dead.get(rank), threads=base.get("num_threads"))
        rows.append(base)
    for row in rows if unregistered else ():
        row.setdefault("registered", True)
    # ranks whose model is on a named device mesh (--strategy fsdp+tensor) say where they sit in it
    columns = StatusTable.columns + (("mesh",) if any(row.get("mesh") for row in rows) else ())
    columns += ("registered",) if unregistered else ()
    columns += ("died",) if dead else ()
    table = StatusTable(rows, columns)
    table.controller_pid = cluster.pids["controller"]
    table.store = f"{cluster.master_addr}:{cluster.master_port}"
    table.job_id = getattr(cluster, "job_id", None)
    table.on_failure = getattr(session, "on_failure", "stop")
    job = f"{cluster.launcher} job {table.job_id} · " if table.job_id else ""
    table.title = (f"{job}controller pid {table.controller_pid} · torch.distributed store {table.store} · "
                   f"on failure: {table.on_failure}")
    if busy:
        table.title += (" · the ranks are busy training in the background (%dist wait, %dist stop-training): not "
                        "asked, alive is whether each engine process runs")
    table.title += _dead_note(cluster, dead, fix=not busy)  # busy: %dist wait or stop-training comes first
    table.title += _unregistered_note(cluster, unregistered, dead, fix=not busy)
    if gone:
        table.title += f" · {hub.controller_message(cluster, gone)} (alive is whether each engine process runs)"
    table.notes = carried.status_notes(session.holdings.carried)  # what each model's next cell takes unasked
    silent = [rank for rank, row in enumerate(rows) if not row["alive"] and rank not in dead and not busy]
    if silent:
        table.title += (f" · {ranks_named(silent)} did not answer within {timeout:g} s (the engine process "
                        "runs: busy, or still loading)")
    return table


def _unregistered(cluster, dead: dict) -> list:
    """Ranks whose engine process runs but is no longer registered with the controller (it missed the controller's
    heartbeats: stopped, frozen, starved of CPU); ranks on other hosts are dead then (:meth:`Cluster.dead_ranks`)."""
    ids = set(cluster.client.ids) if cluster.client is not None else set()
    return [r for r in range(cluster.world_size) if r not in dead and cluster.engine_ids[r] not in ids]


def _ask_info(cluster, info, dead: dict, unregistered: list) -> dict:
    """``{rank: AsyncResult}`` of ``info`` sent to each rank that can be asked; a rank the controller drops
    meanwhile is added to ``unregistered``."""

    ars = {}
    for rank in range(cluster.world_size):
        if rank in dead or rank in unregistered:
            continue
        try:
            ars[rank] = cluster.apply(rank, info)
        except ClusterError:
            if rank not in cluster.dead_ranks():
                unregistered.append(rank)
    return ars


def _unregistered_note(cluster, unregistered: list, dead: dict, fix: bool) -> str:
    """`` · rank 1 (engine 1, pid P) runs but is no longer registered with the controller ...``, or ``""``."""
    if not unregistered:
        return ""

    what = "; ".join(f"{cluster.describe(r)} runs but is no longer registered with the controller"
                     for r in unregistered)
    return (f" · {what} (it missed the controller's heartbeats: stopped, frozen or starved of CPU; distnb cannot "
            f"reach it)" + (f". {unregistered_fix(cluster.world_size)}" if fix and not dead else ""))


def _dead_note(cluster, dead: dict, fix: bool) -> str:
    """`` · rank 1 died (its engine process, pid P): killed by SIGKILL ...`` (``fix``: ``. Run %dist restart ...``),
    or ``""``."""
    if not dead:
        return ""

    what = "; ".join(f"rank {r} died (its engine process, pid {cluster.ranks[r]['pid']}): {how}"
                     for r, how in sorted(dead.items()))
    return f" · {what}" + (f". {dead_rank_fix(dead, cluster.world_size, cluster.world_size)}" if fix else "")


class WhereTable(Table):
    """``%dist where``: where each rank is, one row per rank.

    Columns: rank; state (``idle`` between cells, ``running`` in its cell's code, ``collective``
    waiting in torch.distributed); seconds (at that spot); op and shape (the collective);
    cell_line and code (the innermost line of the cell's code); at (the innermost frame,
    ``file:line function``). ``stacks`` holds each rank's frames, innermost last.
    """

    columns = ("rank", "state", "seconds", "op", "shape", "cell_line", "code", "at")
    # above SCALE_THRESHOLD ranks, ranks at the same spot share a row: rank "0-14,16-31", seconds "3-5"


def where_table(wheres: dict, world_size: int, title: str) -> WhereTable:
    """A WhereTable from ``{rank: where}`` (see distnb.engine.process.where); a rank with none is ``unknown``, "no report
    yet" (a background run's rank before its cell has run :data:`distnb.engine.process.where.INTERVAL` seconds)."""
    rows, stacks = [], {}
    for rank in range(world_size):
        w = wheres.get(rank)
        if w is None:
            rows.append(dict(rank=rank, state="unknown", code="no report yet"))
            continue
        top = (w.get("stack") or [None])[-1]
        stacks[rank] = w.get("stack") or []
        rows.append(dict(rank=rank, state=w.get("state"), seconds=round(max(0.0, w.get("sent", 0) - w.get("since", 0)), 1)
                         if w.get("state") != "idle" else None, op=w.get("op"), shape=w.get("shape"),
                         cell_line=w.get("cell_line"), code=w.get("cell_code"),
                         at=f"{top[0].rsplit('/', 1)[-1]}:{top[1]} {top[2]}" if top else None))
    if world_size > SCALE_THRESHOLD:
        rows = _fold_where_rows(rows)
    table = WhereTable(rows, title=title)
    table.stacks = stacks
    return table


def _fold_where_rows(rows: list) -> list:
    """Rows of ranks at the same spot (state, op, shape, cell line, code, frame) as one row whose rank is
    their list (``0-14,16-31``) and whose seconds are their range: the odd ranks out of 256 stand out."""

    groups = {}
    for row in rows:
        spot = tuple(repr(row.get(k)) for k in WhereTable.columns if k not in ("rank", "seconds"))
        groups.setdefault(spot, []).append(row)
    out = []
    for group in sorted(groups.values(), key=lambda g: (-len(g), g[0]["rank"])):
        row = dict(group[0], rank=rank_list(r["rank"] for r in group) if len(group) > 1 else group[0]["rank"])
        seconds = [r["seconds"] for r in group if r.get("seconds") is not None]
        if len(set(seconds)) > 1:
            row["seconds"] = f"{min(seconds)}-{max(seconds)}"
        out.append(row)
    return out


def summary(lost: dict) -> str:
    """One sentence on a shrink (``result.lost``): the ranks lost, the world before and after, the steps
    trained again and the samples re-assigned (also said by ``%dist wait`` after a background run)."""
    old, n = lost["world_size"]
    return (f"--on-failure shrink: lost {', '.join(lost['ranks'].values())}; the cell finished on "
            f"{count(n, 'rank')} (was {old}); {_lost_steps(lost)}; {lost['samples_reassigned']} samples "
            "re-assigned to the survivors")


def _lost_steps(lost: dict) -> str:
    if lost["resumed_from"]:
        return f"{count(lost['steps_lost'], 'step')} after the checkpoint {lost['resumed_from']} trained again"
    return "no completed step lost (every ddp replica held the last one)"
