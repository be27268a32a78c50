"""Validated descriptions of a cluster and of a training run (stdlib only).

Both dataclasses are checked on construction, so a bad option becomes a
:class:`~distnb.errors.PlanError` naming the option before any rank is touched.
They travel to the engines as plain dicts (:meth:`TrainPlan.to_dict`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .errors import PlanError

#: Strategies that ``%%distrain`` knows about (one module each in distnb/engine/strategies/).
STRATEGIES = ("ddp", "fsdp", "pipeline", "tensor", "ps")
#: Pipeline schedules (torch.distributed.pipelining): GPipe (Huang et al. 2019) and 1F1B
#: (PipeDream-Flush, Narayanan et al. 2021).
SCHEDULES = ("gpipe", "1f1b")
#: Built-in optimizers (torch.optim names) and their default learning rates.
DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3, "adamw": 1e-3}
BACKENDS = ("gloo", "nccl")
#: ipyparallel's batch-system engine launchers (the scheduler places the engines).
BATCH_LAUNCHERS = ("slurm", "pbs", "sge", "lsf", "htcondor")
#: ipyparallel engine launchers ``%dist start --launcher`` takes (ipyparallel's entry-point names).
LAUNCHERS = ("local", "mpi", "ssh") + BATCH_LAUNCHERS
#: Longest collective/rendezvous timeout ``%dist start --timeout`` takes, seconds.
MAX_TIMEOUT = 7 * 24 * 3600


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise PlanError(f"{name} must be at least {minimum}, got {value}")


def _check_number(name, value, positive=True):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise PlanError(f"{name} must be positive, got {value}")


def _check_placement(spec) -> None:
    """Where engines run: launcher and its options (see ClusterSpec)."""
    if spec.launcher is None and spec.profile is None:
        raise PlanError("--launcher is needed unless --profile names an ipyparallel profile that sets one")
    if spec.launcher is not None and spec.launcher not in LAUNCHERS:
        raise PlanError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {spec.launcher!r}")
    if not isinstance(spec.hosts, tuple) or not all(isinstance(h, str) and h.strip() for h in spec.hosts):
        raise PlanError(f"--hosts must be host names separated by commas, got {spec.hosts!r}")
    if len(set(spec.hosts)) != len(spec.hosts):
        raise PlanError(f"--hosts names a host twice: {', '.join(spec.hosts)} (use --engines-per-node for more "
                        "engines on one host)")
    for name in ("nodes", "engines_per_node"):
        value = getattr(spec, name)
        if value is not None:
            _check_int("--" + name.replace("_", "-"), value, 1)
    for name in ("queue", "time_limit", "account", "profile", "interface", "master_addr"):
        value = getattr(spec, name)
        if value is not None and (not isinstance(value, str) or not value.strip() or value != value.strip()):
            raise PlanError(f"--{name.replace('_', '-').replace('time-limit', 'time')} must be a non-empty word, "
                            f"got {value!r}")
    launcher = spec.launcher
    if spec.hosts and launcher not in ("ssh", "mpi", None):
        why = ("a batch launcher gets its hosts from the scheduler (use --nodes)" if launcher in BATCH_LAUNCHERS
               else "local engines run on this machine (add --launcher ssh or --launcher mpi)")
        raise PlanError(f"--hosts is for --launcher ssh or mpi, not {launcher}: {why}")
    if spec.engines_per_node is not None and launcher in ("ssh", "mpi") and not spec.hosts:
        raise PlanError(f"--engines-per-node needs --hosts with --launcher {launcher} (on this machine alone, "
                        "use -n)")
    if launcher == "ssh" and not spec.hosts and spec.profile is None:
        raise PlanError("--launcher ssh needs --hosts (e.g. --hosts node1,node2) or a --profile that sets "
                        "SSHEngineSetLauncher.engines")
    if launcher in ("local", "ssh", "mpi") and (spec.nodes is not None or spec.queue or spec.time_limit
                                                 or spec.account):
        raise PlanError(f"--nodes, --queue, --time and --account are for batch launchers "
                        f"({', '.join(BATCH_LAUNCHERS)}), not --launcher {launcher}")
    if launcher == "local" and spec.engines_per_node is not None:
        raise PlanError("--engines-per-node is for several hosts or nodes; with --launcher local use -n")
    hosts = len(spec.hosts) or spec.nodes
    if hosts and spec.engines_per_node and hosts * spec.engines_per_node != spec.num_engines:
        raise PlanError(f"-n {spec.num_engines} does not match {hosts} hosts x --engines-per-node "
                        f"{spec.engines_per_node}; leave out -n, or make them agree")
    if hosts and spec.num_engines < hosts:
        raise PlanError(f"-n {spec.num_engines} is fewer engines than the {hosts} hosts or nodes asked for")


@dataclass(frozen=True)
class ClusterSpec:
    """What ``%dist start`` starts.

    Parameters
    ----------
    num_engines : int
        Number of engines, i.e. the world_size (>= 1).
    backend : {"gloo", "nccl"}
        torch.distributed backend. ``nccl`` needs one GPU per engine.
    device_type : {"cpu", "cuda"}
        Where each rank computes; with ``cuda`` rank ``r`` sees only GPU ``local_rank``.
    num_threads : int
        torch intra-op threads per engine (CPU engines: cores // num_engines).
    timeout : float
        Collective and rendezvous timeout in seconds.
    master_addr : str or None
        Rendezvous address (``--master-addr``): where rank 0 serves the torch.distributed
        store. None: 127.0.0.1 when every rank runs on the kernel's host, else rank 0's
        address on ``interface``, else the address rank 0 uses to reach the controller.
    master_port : int or None
        TCP port of the torch.distributed store (``--master-port``); None: a free port
        is picked for every process group formed.
    launcher : str
        ipyparallel engine launcher (``--launcher``): ``local`` (default, distnb's fast
        local engines), ``mpi``, ``ssh``, ``slurm``, ``pbs``, ``sge``, ``lsf``, ``htcondor``.
        None with ``profile``: the profile's own launcher.
    hosts : tuple of str
        ``--hosts``: hosts to start engines on (``[user@]host[:sshport]``), ``engines_per_node``
        on each; ssh and mpi.
    nodes : int or None
        ``--nodes``: slurm: nodes to ask for (other batch systems: set it in the profile's
        batch template).
    engines_per_node : int or None
        ``--engines-per-node``: engines on each host or node (default: num_engines spread
        evenly over the hosts or nodes).
    queue : str or None
        ``--queue``: batch queue (slurm: partition).
    time_limit : str or None
        ``--time``: slurm: wall-clock limit in Slurm's format (``HH:MM:SS``).
    account : str or None
        ``--account``: slurm: account to charge.
    profile : str or None
        ``--profile``: an ipyparallel profile (name in the IPython directory, or a path to a
        profile directory) whose ``ipcluster_config.py`` configures the launchers; options
        given here override it.
    interface : str or None
        ``--interface``: network interface the ranks rendezvous (and gloo/nccl connect) over,
        e.g. ``eth0``; the controller also listens on it when engines are remote.
    """

    num_engines: int
    backend: str = "gloo"
    device_type: str = "cpu"
    num_threads: int = 1
    timeout: float = 60.0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str | None = "local"
    hosts: tuple = ()
    nodes: int | None = None
    engines_per_node: int | None = None
    queue: str | None = None
    time_limit: str | None = None
    account: str | None = None
    profile: str | None = None
    interface: str | None = None

    def __post_init__(self):
        _check_int("num_engines (-n)", self.num_engines, 1)
        _check_placement(self)
        if self.master_port is not None:
            _check_int("--master-port", self.master_port, 1)
            if self.master_port > 65535:
                raise PlanError(f"--master-port must be a TCP port (1-65535), got {self.master_port}")
        if self.backend not in BACKENDS:
            raise PlanError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.device_type not in ("cpu", "cuda"):
            raise PlanError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}")
        if self.backend == "nccl" and self.device_type != "cuda":
            raise PlanError("--backend nccl needs GPU engines; this machine has none (use --backend gloo)")
        _check_int("num_threads", self.num_threads, 1)
        _check_number("--timeout", self.timeout)
        if not 1 <= self.timeout <= MAX_TIMEOUT:
            raise PlanError(f"--timeout must be between 1 and {MAX_TIMEOUT} seconds (a week), got {self.timeout}")


@dataclass(frozen=True)
class TrainPlan:
    """One ``%%distrain`` cell.

    Parameters
    ----------
    model : str
        Name of the ``torch.nn.Module`` in the kernel namespace.
    data : str
        Name of the data set in the kernel namespace (Dataset, TensorDataset,
        tensor, array, or tuple of tensors/arrays with equal first dimension).
    epochs : int
        Passes over the data (>= 1). Epoch numbers continue across cells.
    batch_size : int
        Samples per rank per step; the global batch is ``batch_size * world_size``.
    optimizer : str or None
        ``sgd``, ``adam``, ``adamw`` (torch.optim), or the name of a kernel callable
        ``f(params) -> torch.optim.Optimizer`` (an Optimizer subclass works). None keeps the
        optimizer that lives on the ranks (with its state), or starts SGD if there is none.
    lr : float or None
        Learning rate. None keeps the live optimizer's rate; a new built-in optimizer then
        gets :data:`DEFAULT_LR`, a custom one its own default.
    seed : int
        Seed of the shard assignment and of each epoch's shuffle.
    strategy : str
        One of :data:`STRATEGIES`.
    reset : bool
        Re-send the kernel's model and start a fresh optimizer and epoch count.
    target_loss : float or None
        Stop after the first epoch whose mean loss over all ranks is <= this.
    loop : bool
        The cell body is the whole per-rank loop (driven through ``ctx``) rather than one step.
    drop_last : bool
        False (default): pad, so every rank runs ``ceil(ceil(n / world_size) / batch_size)``
        steps, a rank with a shorter shard repeating samples of its own shard. True: drop,
        every rank uses ``floor(n / world_size)`` samples and full batches only.
    find_unused_parameters : bool
        Passed to DDP: allow parameters that get no gradient in a step (costs a graph walk).
    nan : {"stop", "skip"}
        A non-finite loss stops training with an error naming the rank and step (default),
        or (``skip``) the step is dropped on every rank: no update, the ranks agree with one
        tiny all-reduce per step, and the cell reports how many steps it skipped.
    report_interval : float
        Seconds between progress messages per rank (0.1 for the dashboard: at most 10 a
        second; longer for text progress, which only prints per epoch).
    fsdp_units : tuple of str or None
        fsdp: names of the submodules that become FSDP units (each gets its own
        all-gather); None: every direct child that holds parameters. The root always is one.
    split : tuple of str or None
        pipeline: names of the submodules that begin a new stage (``world_size - 1`` of
        them); None: balance the top-level children by parameter count.
    microbatches : int or None
        pipeline: microbatches per batch (must divide --batch-size); None: world_size.
    schedule : {"gpipe", "1f1b"}
        pipeline schedule.
    loss : str or None
        pipeline: name of a kernel function ``loss(output, target) -> scalar tensor``; None:
        the step body computes the loss.
    tp_plan : str or None
        tensor: name of a kernel dict ``{module name: ParallelStyle}`` for
        ``parallelize_module``; None: consecutive nn.Linear pairs become column-wise then
        row-wise parallel.
    servers : int
        ps: ranks that hold (a split of) the parameters and the optimizer state.
    checkpoint_dir : str or None
        Save model, optimizer and position there with torch.distributed.checkpoint (see
        :mod:`distnb.engine.checkpoint`); a model the ranks receive fresh resumes from the
        newest checkpoint there (unless ``reset``).
    checkpoint_every : int or None
        Save every this many steps (global step count); None: at the end of every epoch.
    lr_if_new : float or None
        Learning rate for an optimizer made new while ``lr`` is None (the kernel passes the
        last one the user gave, so a model sent again keeps its rate); the live optimizer
        ignores it.
    staleness : int
        ps: 0 synchronous; K > 0 lets workers run up to K steps ahead of the last update
        they have received (bounded asynchrony, Ho et al. 2013, "Stale Synchronous Parallel").
    """

    model: str
    data: str
    epochs: int = 1
    batch_size: int = 32
    optimizer: str | None = None
    lr: float | None = None
    seed: int = 0
    strategy: str = "ddp"
    reset: bool = False
    target_loss: float | None = None
    loop: bool = False
    drop_last: bool = False
    find_unused_parameters: bool = False
    nan: str = "stop"
    report_interval: float = 0.1
    fsdp_units: tuple | None = None
    split: tuple | None = None
    microbatches: int | None = None
    schedule: str = "gpipe"
    loss: str | None = None
    tp_plan: str | None = None
    servers: int = 1
    staleness: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    lr_if_new: float | None = None

    def __post_init__(self):
        for name in ("model", "data"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.isidentifier():
                raise PlanError(f"--{name} must name a variable in the notebook, got {value!r}")
        _check_int("--epochs", self.epochs, 1)
        _check_int("--batch-size", self.batch_size, 1)
        _check_int("--seed", self.seed, 0)
        if self.optimizer is not None:
            if not isinstance(self.optimizer, str) or not self.optimizer:
                raise PlanError(f"--optimizer must be sgd, adam, adamw or a notebook name, got {self.optimizer!r}")
            if self.optimizer.lower() in DEFAULT_LR:
                object.__setattr__(self, "optimizer", self.optimizer.lower())
            elif not self.optimizer.isidentifier():
                raise PlanError(f"--optimizer must be sgd, adam, adamw or a notebook name, got {self.optimizer!r}")
        if self.lr is not None:
            _check_number("--lr", self.lr)
        if self.lr_if_new is not None:
            _check_number("lr_if_new", self.lr_if_new)
        if self.nan not in ("stop", "skip"):
            raise PlanError(f"--nan must be 'stop' or 'skip', got {self.nan!r}")
        if self.strategy not in STRATEGIES:
            raise PlanError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        for flag in ("reset", "loop", "drop_last", "find_unused_parameters"):
            if not isinstance(getattr(self, flag), bool):
                raise PlanError(f"--{flag.replace('_', '-')} is a flag (True or False), got {getattr(self, flag)!r}")
        self._check_strategy_options()
        if self.checkpoint_dir is not None and (not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir):
            raise PlanError(f"--checkpoint-dir must be a folder path, got {self.checkpoint_dir!r}")
        if self.checkpoint_every is not None:
            _check_int("--checkpoint-every", self.checkpoint_every, 1)
            if self.checkpoint_dir is None:
                raise PlanError("--checkpoint-every needs --checkpoint-dir DIR (where to save)")
        if self.target_loss is not None:
            _check_number("--target-loss", self.target_loss, positive=False)
        _check_number("report_interval", self.report_interval)

    def _check_strategy_options(self):
        for field in ("fsdp_units", "split"):
            value = getattr(self, field)
            if isinstance(value, str):
                value = tuple(v.strip() for v in value.split(",") if v.strip())
                object.__setattr__(self, field, value)
            if value is not None:
                if isinstance(value, list):
                    value = tuple(value)
                    object.__setattr__(self, field, value)
                flag = "--" + field.replace("_", "-")
                if not isinstance(value, tuple) or not value or not all(
                        isinstance(v, str) and all(part.isidentifier() or part.isdigit() for part in v.split(".")) for v in value):
                    raise PlanError(f"{flag} must be comma-separated submodule names like `layers.2,head`, "
                                    f"got {value!r}")
        if self.microbatches is not None:
            _check_int("--microbatches", self.microbatches, 1)
        if self.schedule not in SCHEDULES:
            raise PlanError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for field in ("loss", "tp_plan"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value.isidentifier()):
                raise PlanError(f"--{field.replace('_', '-')} must name a variable in the notebook, got {value!r}")
        _check_int("--servers", self.servers, 1)
        _check_int("--staleness", self.staleness, 0)
        own = {"fsdp": ("fsdp_units",), "pipeline": ("split", "microbatches", "loss"), "tensor": ("tp_plan",),
               "ps": ()}
        for strategy, fields in own.items():
            for field in fields:
                if getattr(self, field) is not None and self.strategy != strategy:
                    raise PlanError(f"--{field.replace('_', '-')} is a --strategy {strategy} option "
                                    f"(this cell uses --strategy {self.strategy})")
        if self.strategy != "pipeline" and self.schedule != "gpipe":
            raise PlanError(f"--schedule is a --strategy pipeline option (this cell uses --strategy {self.strategy})")
        if self.strategy != "ps" and (self.servers != 1 or self.staleness != 0):
            raise PlanError(f"--servers and --staleness are --strategy ps options (this cell uses "
                            f"--strategy {self.strategy})")
        if self.strategy == "pipeline" and self.microbatches is not None and self.batch_size % self.microbatches:
            raise PlanError(f"--microbatches {self.microbatches} does not divide --batch-size {self.batch_size}: "
                            "each microbatch must have the same number of samples")

    def strategy_key(self) -> tuple:
        """What decides how a model is distributed: a different key rebuilds the strategy."""
        return (self.strategy, self.find_unused_parameters, self.fsdp_units, self.split, self.microbatches,
                self.schedule, self.loss, self.tp_plan, self.servers, self.staleness)

    @property
    def builtin_optimizer(self) -> bool:
        """True unless --optimizer names a notebook callable."""
        return self.optimizer is None or self.optimizer in DEFAULT_LR

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainPlan":
        return cls(**{k: tuple(v) if k in ("fsdp_units", "split") and isinstance(v, list) else v
                      for k, v in d.items()})
