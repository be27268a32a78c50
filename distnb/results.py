"""What the cluster and a training cell return: the status table and the TrainResult (kernel side)."""

from __future__ import annotations

import math

from .display.tables import Table, count


class StatusTable(Table):
    """``%dist status``: one row per rank; the title names the batch job, the controller's pid and the store's address.

    Attributes
    ----------
    controller_pid : int or None
        The ipyparallel controller's process id.
    store : str
        ``host:port`` of the torch.distributed store (rank 0's).
    job_id : str or None
        The batch job that holds the engines (``--launcher slurm``), also named in the title.
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
        how = "reached --target-loss" if self.stopped_early else count(len(self.epochs), "epoch")
        self.title = (f"{plan.strategy} · {count(len(rows), 'rank')} · {how} · final mean loss {self.final_loss:.4f} · "
                      f"{self.samples_per_s:.0f} samples/s · {self.wall_seconds:.2f} s")


def training_notes(first: dict) -> list:
    """The sentences a finished training cell prints, from rank 0's row (``first``)."""
    notes = []
    if first["note"]:
        notes.append(first["note"])
    if first.get("skipped_steps"):
        notes.append(f"skipped {count(first['skipped_steps'], 'step')} whose loss was not finite on some rank "
                     "(--nan skip): no update was applied for them")
    if first.get("resumed"):
        notes.append(f"resumed from checkpoint {first['resumed']}")
    if first.get("continued"):
        c = first["continued"]
        notes.append(f"continued epoch {c['epoch']} where it stopped ({c['samples']} samples per rank already "
                     "trained); it counts as the first of this cell's epochs")
    return notes


def status_table(session, timeout: float) -> StatusTable:
    """Ask every live rank who it is (waiting at most ``timeout`` seconds in all); one row per rank."""
    import time

    from . import calls

    cluster = session.cluster
    dead = cluster.dead_ranks()
    ars = {r: cluster.apply(r, calls.info) for r in range(cluster.world_size) if r not in dead}
    deadline = time.monotonic() + timeout
    rows = []
    for rank in range(cluster.world_size):
        base = dict(cluster.ranks[rank], alive=False)
        if rank in ars:
            ars[rank].wait(max(0.0, deadline - time.monotonic()))
            try:
                base.update(ars[rank].get(0), alive=True)
            except Exception:
                pass
        base["threads"] = base.get("num_threads")
        rows.append(base)
    table = StatusTable(rows)
    table.controller_pid = cluster.pids["controller"]
    table.store = f"{cluster.master_addr}:{cluster.master_port}"
    table.job_id = getattr(cluster, "job_id", None)
    job = f"{cluster.launcher} job {table.job_id} · " if table.job_id else ""
    table.title = (f"{job}controller pid {table.controller_pid} · torch.distributed store {table.store} · "
                   f"auto restart {'on' if session.auto_restart else 'off'}")
    return table
