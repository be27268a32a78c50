"""Validated descriptions of a cluster and of a training run, each option declared once (stdlib only).

:class:`TrainPlan` (a ``%%distrain`` cell), :class:`RunOptions` (how the kernel runs and
shows that cell) and :class:`ClusterSpec` (what ``%dist start`` starts) are frozen
dataclasses whose fields are declared with :func:`distnb.core.options.option`: name, type,
default, help and check in one place. The magics' parsers, the Python keywords of
``Session.train`` and ``distnb.start`` and their help are derived from these fields.
All three are checked on construction, so a bad option becomes a
:class:`~distnb.core.errors.PlanError` naming the option before any rank is touched.
TrainPlan travels to the engines as a plain dict (:meth:`TrainPlan.to_dict`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from distnb.core import levers, lingering, options, weightfiles
from distnb.core.errors import PlanError
from distnb.core.options import check_int, option

#: Strategies ``%%distrain --strategy`` takes: name -> (what it is, whether distributing it changes
#: the module in place). One module each in distnb/engine/strategies/, named as the strategy.
STRATEGIES = {
    "ddp": ("DistributedDataParallel, default", False),
    "fsdp": ("FSDP2 fully_shard", True),
    "pipeline": ("torch.distributed.pipelining", True),
    "tensor": ("DTensor tensor parallel", True),
    "fsdp+tensor": ("FSDP2 across, tensor parallel within the --mesh", True),
    "ps": ("parameter server", True),
}
#: How a strategy's checkpoints lay out the optimizer state, where it is not nested by parameter name
#: (as ``torch.distributed.checkpoint.state_dict`` has it for ddp, fsdp, tensor and fsdp+tensor):
#: pipeline stages and ps servers each save their own parameters' entries flattened by name. A
#: strategy reads only its own layout's state, so a resume into another takes the checkpoint's
#: weights and position with a fresh optimizer (:func:`optimizer_state_readable`).
OPTIMIZER_LAYOUTS = {"pipeline": "flat by name", "ps": "flat by name"}


def optimizer_state_readable(saved_strategy: str, strategy: str) -> bool:
    """Whether ``strategy`` can load the optimizer state of a checkpoint ``saved_strategy`` wrote."""
    return OPTIMIZER_LAYOUTS.get(saved_strategy, "by name") == OPTIMIZER_LAYOUTS.get(strategy, "by name")


#: Pipeline schedules (torch.distributed.pipelining): GPipe (Huang et al. 2019) and 1F1B
#: (PipeDream-Flush, Narayanan et al. 2021).
SCHEDULES = ("gpipe", "1f1b")
#: Built-in optimizers (torch.optim names) and their default learning rates.
DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3, "adamw": 1e-3}
BACKENDS = ("gloo", "nccl")
#: The name an object passed to the Python API without a notebook name is bound under: ``_distnb_<option>``.
BOUND_PREFIX = "_distnb_"
#: ipyparallel's batch-system engine launchers (the scheduler places the engines).
BATCH_LAUNCHERS = ("slurm", "pbs", "sge", "lsf", "htcondor")
#: ipyparallel engine launchers ``%dist start --launcher`` takes (ipyparallel's entry-point names).
LAUNCHERS = ("local", "mpi", "ssh") + BATCH_LAUNCHERS
#: What a cell does when an engine dies during it (``%dist start --on-failure``).
FAILURE_POLICIES = ("stop", "restart", "shrink")
CPU_BINDS = ("auto", "cores", "none")
#: Longest collective/rendezvous timeout ``%dist start --timeout`` takes, seconds.
MAX_TIMEOUT = 7 * 24 * 3600
#: Progress views of a training cell (auto: widgets in Jupyter, text elsewhere).
PROGRESS_MODES = ("auto", "widgets", "text", "none")
#: Autocast precisions of ``--precision`` (fp16 scales the loss with a GradScaler, on CUDA or CPU ranks).
PRECISIONS = ("fp32", "bf16", "fp16")
#: Built-in learning-rate schedules of ``--lr-schedule`` (after ``--warmup-steps`` of linear warm-up).
LR_SCHEDULES = ("cosine", "linear", "constant")


def mesh_shape(mesh: str | None, world_size: int) -> tuple[int, int]:
    """``--mesh DPxTP`` as ``(dp, tp)`` for ``world_size`` ranks (None: the default shape).

    The default makes TP the largest divisor of ``world_size`` not above its square root
    (4 ranks: 2x2, 8: 4x2, 2: 2x1), so both dimensions are used where the world allows.

    Raises
    ------
    PlanError
        If ``mesh`` is not two positive integers ``DPxTP`` whose product is ``world_size``;
        the message names the world size and the shapes that fit it.
    """
    fits = [f"{world_size // t}x{t}" for t in range(1, world_size + 1) if world_size % t == 0]
    fix = f"world_size is {world_size}: give DPxTP with DP * TP = {world_size}, e.g. --mesh {' or '.join(fits)}"
    if mesh is None:
        tp = max(t for t in range(1, world_size + 1) if world_size % t == 0 and t * t <= world_size)
        return world_size // tp, tp
    parts = mesh.lower().split("x") if isinstance(mesh, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or 0 in (int(parts[0]), int(parts[1])):
        raise PlanError(f"--mesh {mesh} is not DPxTP (two positive integers: FSDP size x tensor-parallel size); {fix}")
    dp, tp = int(parts[0]), int(parts[1])
    if dp * tp != world_size:
        raise PlanError(f"--mesh {mesh} has {dp * tp} ranks ({dp} x {tp}) but {fix}")
    return dp, tp


def redistribution(last, key: tuple, generation: int) -> str:
    """What the ranks' copy of a model needs before a cell distributed as ``key`` (the one rule).

    Parameters
    ----------
    last : tuple or None
        ``(strategy key, process-group generation)`` the model was last distributed with on
        this side, None if never.
    key : tuple
        :meth:`TrainPlan.strategy_key` of the cell; ``key[0]`` is the strategy name.
    generation : int
        The process group's generation now (it bumps whenever the group is re-formed).

    Returns
    -------
    str
        ``"keep"``: same distribution on the same group, the live model and optimizer
        carry on. ``"rebuild"``: the module is intact (a strategy that wraps it, such as
        DDP): wrap it again on the ranks. ``"resend"``: another strategy, or a strategy that
        changed the module in place (sharded, split) asked to change or to survive a
        re-formed group: the kernel sends the model again from its weights.
    """
    if last is None:
        return "rebuild"
    if last == (key, generation):
        return "keep"
    name = last[0][0]
    if name != key[0] or STRATEGIES[name][1] or levers.changed(last[0], key, DISTRIBUTION):
        return "resend"
    return "rebuild"


@dataclass(frozen=True)
class TrainPlan:
    """One ``%%distrain`` cell: what to train, how, and how it is distributed.

    Every field is an option (see ``distnb.core.options``); the parameters are listed below
    from their declarations.
    """

    model: str = option(kind="name", help="notebook name of the torch.nn.Module to train")
    data: str = option(kind="name", help="notebook name of the data set: tensors (scattered as shards), a Dataset "
                       "or IterableDataset (sent by value, loaded on the ranks), or make(rank, world_size) -> Dataset",
                       doc="Name of the data set in the kernel namespace. Tensor containers (TensorDataset, tensor, "
                           "array, tuple or dict of them) are scattered once as shards; any other map-style Dataset "
                           "or IterableDataset is sent by value and loaded on the ranks each epoch; a function "
                           "``make(rank, world_size) -> Dataset`` runs on each rank and returns that rank's part.")
    epochs: int = option(1, "int", "epochs to run (default 1)", minimum=1,
                         doc="Passes over the data (>= 1). Epoch numbers continue across cells.")
    batch_size: int = option(32, "int", "samples per rank per step (default 32)", minimum=1,
                             doc="Samples per rank per step; the global batch is ``batch_size * world_size``.")
    optimizer: str | None = option(None, "text", "sgd, adam, adamw, or a notebook name f(params)->Optimizer; default: "
                                   "keep the optimizer live on the ranks (with its state), sgd for a new model", carry=True)
    lr: float | None = option(None, "float", "learning rate, >= 0 (0: the weights stay, e.g. to validate only); "
                              "default: keep the live one (a new optimizer: 0.01 sgd, 1e-3 adam/adamw)", minimum=0)
    seed: int = option(0, "int", "seed of shards, per-epoch shuffles and, for a Dataset, the ranks' and workers' "
                       "random streams (default 0)", minimum=0)
    strategy: str = option("ddp", "choice", ", ".join(f"{k} ({v[0]})" for k, v in STRATEGIES.items())
                           + "; default: the model's last one, ddp at first", choices=tuple(STRATEGIES),
                           distribution=True)
    fsdp_units: tuple | None = option(None, "names", "fsdp: comma-separated submodules that become FSDP units (default: "
                                      "each child with parameters; a Hugging Face model's decoder blocks)", strategy=(
                                      "fsdp", "fsdp+tensor"), doc="Names of the submodules that become FSDP units (each "
                                      "gets its own all-gather); None: every direct child that holds parameters, or a "
                                      "Hugging Face model's blocks (its _no_split_modules). The root always is one.")
    split: tuple | None = option(None, "names", "pipeline: comma-separated submodules that begin a new stage "
                                 "(default: balanced by parameters)", strategy="pipeline")
    microbatches: int | None = option(None, "int", "pipeline: microbatches per batch, must divide --batch-size "
                                      "(default: world_size)", minimum=1, strategy="pipeline")
    schedule: str = option("gpipe", "choice", "pipeline: schedule (default gpipe)", choices=SCHEDULES,
                           strategy="pipeline")
    loss: str | None = option(None, "name", "pipeline: notebook function loss(output, target); default: the body's "
                              "`loss`", strategy="pipeline")
    tp_plan: str | None = option(None, "name", "tensor: notebook dict {submodule: ParallelStyle}; default: Linear "
                                 "pairs column- then row-wise in definition order, assuming the forward between "
                                 "them is elementwise (ReLU, GELU, dropout); either plan is verified against the "
                                 "whole model on the first batch (a mismatch fails the cell before any step)",
                                 strategy=("tensor", "fsdp+tensor"))
    mesh: str | None = option(None, "word", "fsdp+tensor: DPxTP, the 2-D device mesh, e.g. --mesh 2x2 on 4 ranks: "
                              "tensor parallel within groups of TP consecutive ranks, FSDP across the DP groups "
                              "(default: TP the largest divisor of world_size not above its square root)",
                              strategy="fsdp+tensor",
                              doc="``\"DPxTP\"`` with DP * TP = world_size, e.g. ``\"2x2\"``: ranks "
                                  "``d*TP .. d*TP+TP-1`` split each layer (tensor parallel, ``--tp-plan``) and "
                                  "train on data shard ``d``; the DP groups shard every parameter over each other "
                                  "(FSDP2, ``--fsdp-units``). ``1xN`` is pure tensor parallel, ``Nx1`` pure FSDP. "
                                  "None: TP is the largest divisor of world_size not above its square root.")
    checkpoint_dir: str | None = option(None, "path", "save model, optimizer and position there "
                                        "(torch.distributed.checkpoint); a model sent fresh to the ranks (e.g. after "
                                        "%dist restart) resumes from the newest checkpoint there")
    checkpoint_every: int | None = option(None, "int", "save every N steps (default: at the end of every epoch)",
                                          minimum=1)
    servers: int = option(1, "int", "ps: ranks holding the parameters and optimizer (default 1)", minimum=1,
                          strategy="ps")
    staleness: int = option(0, "int", "ps: steps a worker may run ahead of the last update it received (default 0: "
                            "synchronous)", minimum=0, strategy="ps",
                            doc="0 synchronous; K > 0 lets workers run up to K steps ahead of the last update they "
                                "have received (bounded asynchrony, Ho et al. 2013, \"Stale Synchronous Parallel\").")
    init: str | None = option(None, "name", "a model built on the meta device: notebook function f(module) called on "
                              "the ranks for each module holding tensors itself, in named_modules() order, instead of "
                              "its reset_parameters(), from the notebook's torch generator (e.g. --init init_weights)")
    load: str | None = option(None, "path", weightfiles.HELP)
    reset: bool = option(False, "flag", "re-send the kernel's model as it is now (its trained weights; build a new "
                         "model for fresh ones) with a fresh optimizer and epoch count")
    target_loss: float | None = option(None, "float", "stop after an epoch whose mean loss (with --val-data: "
                                                "the validation loss) is <= this", signed=True)
    precision: str = option("fp32", "choice", "fp32 (default), bf16 (no loss scaling) or fp16 (with a GradScaler) autocast in "
                            "the forward and the loss; weights stay fp32; not with --strategy pipeline", choices=PRECISIONS, distribution=True,
                            doc="Autocast dtype of the forward pass and the loss (``torch.autocast``). ``fp16`` "
                                "scales the loss with ``torch.amp.GradScaler`` (CUDA or CPU ranks; the ranks skip a step "
                                "and back off the scale together); bf16 runs without loss scaling; fsdp also gets "
                                "a ``MixedPrecisionPolicy``. Master weights, optimizer state and the weights that "
                                "come back to the notebook stay fp32.")
    activation_checkpointing: bool = option(False, "flag", levers.HELP["activation_checkpointing"], distribution=True)
    offload: str | None = option(None, "choice", levers.HELP["offload"], choices=levers.OFFLOADS, strategy=levers.FSDP)
    param_dtype: str = option("fp32", "choice", levers.HELP["param_dtype"], choices=levers.PARAM_DTYPES, strategy=levers.FSDP)
    accumulate: int = option(1, "int", "micro-steps whose gradients are summed before one optimizer step (default 1)",
                             minimum=1, doc="Gradient accumulation: N consecutive micro-steps (batches) add up their "
                                            "gradients (each loss scaled by its batch's share of the group's samples: "
                                            "1/N for full batches) before one optimizer step; ddp skips "
                                            "the all-reduce on the first N-1 (``no_sync``), fsdp its reduce-scatter "
                                            "(``set_requires_gradient_sync``). A body whose loss is a sum over "
                                            "tokens sets ``ctx.num_items``: the group is then normalised by the "
                                            "count over its micro-steps and the ranks (token-weighted).")
    check_replicas: str = option("epoch", "choice", "compare the copies of the parameters that ranks must hold equal "
                                 "(ddp; tensor parallelism's unsharded ones): epoch (default: at each cell's start and "
                                 "each epoch's end), step (after every optimizer step) or off; a drift is an error "
                                 "naming the tensor, the ranks and the largest difference", choices=("off", "epoch", "step"),
                                 doc="Replicas checked for silent drift (``distnb/engine/train/replicas.py``): each rank "
                                     "digests its copies with ``torch.hash_tensor`` and one all-reduce of two int64 "
                                     "per tensor compares them. E.g. ``--check-replicas step`` while hunting a "
                                     "divergence.")
    clip_grad_norm: float | None = option(None, "float", "clip the gradients' total norm (over the whole model, every "
                                          "rank's part) to this before each optimizer step")
    lr_schedule: str | None = option(None, "text", "cosine, linear, constant, or a notebook name f(optimizer, "
                                     "total_steps) -> LRScheduler; stepped per optimizer step (default: keep the "
                                     "live one, none for a new optimizer)")
    warmup_steps: int = option(0, "int", "optimizer steps of linear warm-up before --lr-schedule (default 0)",
                               minimum=0)
    val_data: str | None = option(None, "name", "notebook name of a validation set, sharded like --data (tensors, a "
                                  "Dataset or IterableDataset, or make(rank, world_size) run on each rank; fewer samples "
                                  "than ranks is fine); evaluated after every --val-every epochs with model.eval() and "
                                  "no_grad, e.g. --val-data val_set")
    val_every: int = option(1, "int", "epochs between validations (default 1; the cell's last epoch always is one)",
                            minimum=1)
    metric: str | None = option(None, "name", "notebook function metric(output, target) -> per-sample scores (or a "
                                "batch mean); default: accuracy for class scores")
    patience: int | None = option(None, "int", "stop when the validation loss has not improved for K validations "
                                  "(needs --val-data)", minimum=1)
    min_delta: float = option(0.0, "float", "improvement smaller than this does not count for --patience (default 0)",
                              minimum=0.0)
    restore_best: bool = option(False, "flag", "at the end, load the weights of the best validation loss back "
                                "(needs --val-data)")
    compile: bool = option(False, "flag", "torch.compile the model's forward on every rank (ddp: the module DDP wraps; "
                           "fsdp: each innermost unit); the cell reports dynamo's graphs, breaks and recompiles",
                           distribution=True)
    sync_bn: bool = option(False, "flag", "BatchNorm becomes SyncBatchNorm on the ranks (GPU ranks only); the "
                           "notebook's model keeps plain BatchNorm", distribution=True)
    log_dir: str | None = option(None, "path", "write TensorBoard event files there (loss, lr, grad norm, samples/s "
                                 "per rank, validation); needs the tensorboard package")
    loop: bool = option(False, "flag", "the body is the whole per-rank loop, driven through ctx (--epochs runs "
                        "only through ctx.epochs())",
                        doc="The body is the whole per-rank loop, driven through ``ctx``: ``for epoch in ctx.epochs(): "
                            "for batch in ctx.loader: ...; ctx.report(loss)``. ``epochs`` acts only through "
                            "``ctx.epochs()``, the one thing that moves the model's epoch count; ``optimizer_steps`` "
                            "counts the body's own ``optimizer.step()`` calls.")
    unchecked: bool = option(False, "flag", "collectives the body calls itself (dist.all_reduce(...)) skip the "
                             "cross-rank check of their tensors, a fingerprint exchanged before each call: as fast "
                             "as torchrun's, but tensors of different shapes abort gloo's engines instead of an "
                             "error naming each rank's tensor")
    drop_last: bool = option(False, "flag", "drop the uneven tail instead of padding",
                             doc="False (default): pad, so every rank runs ``ceil(ceil(n / world_size) / batch_size)`` "
                                 "steps, a rank with a shorter shard repeating samples of its own shard. True: drop, "
                                 "every rank uses ``floor(n / world_size)`` samples and full batches only.")
    workers: int = option(0, "int", "a Dataset: DataLoader worker processes per rank (default 0: the rank loads "
                          "its samples itself)", minimum=0, maximum=64)
    prefetch_factor: int | None = option(None, "int", "a Dataset with --workers: batches each worker loads ahead "
                                         "(default 2)", minimum=1)
    collate: str | None = option(None, "name", "a Dataset: notebook function list of samples -> batch for the "
                                 "DataLoader (default: torch's default_collate)")
    data_on_ranks: bool = option(False, "flag", "--data names a Dataset that a %%dist cell made on the ranks; "
                                 "nothing passes through the kernel")
    steps_per_epoch: int | None = option(None, "int", "an IterableDataset: steps per epoch on every rank (default: "
                                         "until the first rank's stream ends)", minimum=1)
    find_unused_parameters: bool = option(False, "flag", "let DDP train models with parameters that get no gradient "
                                          "in a step", distribution=True)
    nan: str = option("stop", "choice", "a non-finite loss stops training naming the rank and step (default); skip: "
                      "drop that step on every rank", choices=("stop", "skip"))
    report_interval: float = option(0.1, "float", "seconds between progress messages per rank (default: from "
                                    "progress, 0.1 for the dashboard, at most 10 a second)", cli=False, given=None)
    relay_above: int = option(16, "int", "above this world size each host's local rank 0 relays its host's "
                              "progress messages, so the kernel receives one message per host, not per rank "
                              "(distnb.engine.transport.report.HostRelay)", cli=False, minimum=1)
    lr_if_new: float | None = option(None, "float", "learning rate for an optimizer made new while lr is None (the "
                                     "kernel passes the last one the user gave)", cli=False, api=False, minimum=0)
    resume: bool = option(True, "flag", "a model the ranks receive fresh resumes from --checkpoint-dir's newest "
                          "checkpoint (the kernel sets False when the notebook's weights are as new)", cli=False, api=False)

    def __post_init__(self):
        options.check_fields(self)
        if self.optimizer is not None:
            if not isinstance(self.optimizer, str) or not self.optimizer:
                raise PlanError(f"--optimizer must be sgd, adam, adamw or a notebook name, got {self.optimizer!r}")
            if self.optimizer.lower() in DEFAULT_LR:
                object.__setattr__(self, "optimizer", self.optimizer.lower())
            elif not self.optimizer.isidentifier():
                raise PlanError(f"--optimizer must be sgd, adam, adamw or a notebook name, got {self.optimizer!r}")
        if self.prefetch_factor is not None and not self.workers:
            raise PlanError("--prefetch-factor needs --workers N (batches are loaded ahead by worker processes)")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise PlanError("--checkpoint-every needs --checkpoint-dir DIR (where to save)")
        _check_training(self)
        levers.check(self)
        if self.strategy == "pipeline" and self.microbatches is not None and self.batch_size % self.microbatches:
            raise PlanError(f"--microbatches {self.microbatches} does not divide --batch-size {self.batch_size}: "
                            "each microbatch must have the same number of samples")

    def strategy_key(self) -> tuple:
        """What decides how a model is distributed (the distribution options, strategy first)."""
        return tuple(getattr(self, name) for name in DISTRIBUTION)

    @property
    def builtin_optimizer(self) -> bool:
        """True unless --optimizer names a notebook callable."""
        return self.optimizer is None or self.optimizer in DEFAULT_LR

    def to_dict(self) -> dict:
        """The fields by name; as ``dataclasses.asdict`` (which deep-copies) returns them, made ten times faster
        for the usual plan of plain values and tuples of them (one made per cell in the kernel and on each rank)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        plain = all(type(v) in _PLAIN or (type(v) is tuple and all(type(x) in _PLAIN for x in v)) for v in d.values())
        return d if plain else dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainPlan":
        return cls(**d)


_PLAIN = frozenset((str, int, float, bool, type(None)))  # the types of values TrainPlan.to_dict need not copy


def _check_training(plan) -> None:
    """How the step, schedule and validation options fit together (see TrainPlan)."""
    if plan.lr_schedule is not None:
        if not isinstance(plan.lr_schedule, str) or not (plan.lr_schedule.lower() in LR_SCHEDULES
                                                         or plan.lr_schedule.isidentifier()):
            raise PlanError(f"--lr-schedule must be {', '.join(LR_SCHEDULES)} or a notebook name "
                            f"f(optimizer, total_steps) -> LRScheduler, got {plan.lr_schedule!r}")
        if plan.lr_schedule.lower() in LR_SCHEDULES:
            object.__setattr__(plan, "lr_schedule", plan.lr_schedule.lower())
        elif plan.warmup_steps:
            raise PlanError(f"--warmup-steps is for the built-in schedules ({', '.join(LR_SCHEDULES)}); "
                            f"--lr-schedule {plan.lr_schedule} builds its own warm-up")
    elif plan.warmup_steps:
        raise PlanError("--warmup-steps needs --lr-schedule (cosine, linear, constant): warm-up is its first phase")
    if plan.val_data is None:
        needs = [flag for flag, on in (("--patience", plan.patience is not None), ("--metric", plan.metric is not None),
                                        ("--restore-best", plan.restore_best), ("--min-delta", plan.min_delta != 0.0),
                                        ("--val-every", plan.val_every != 1)) if on]
        if needs:
            raise PlanError(f"{needs[0]} needs validation: pass --val-data NAME (a held-out data set)")
    elif plan.val_data == plan.data:
        raise PlanError(f"--val-data {plan.val_data} is the training set (--data); validation needs held-out data")
    if plan.loop and (plan.accumulate != 1 or plan.clip_grad_norm is not None or plan.precision != "fp32"):
        raise PlanError("--accumulate, --clip-grad-norm and --precision act on distnb's own step; a --loop body "
                        "drives its own (drop --loop, or do them in the loop)")
    if plan.loop and plan.val_data is not None:
        raise PlanError("--val-data runs the step body on each validation batch; a --loop body is the whole loop "
                        "(drop --loop, or evaluate in the loop)")
    refused = strategy_refuses(plan.strategy, {name: getattr(plan, name) for name, *_ in STRATEGY_LIMITS})
    if refused:
        raise PlanError(next(iter(refused.values())))


#: What a strategy cannot take besides another strategy's options: (field, refused(value), the
#: strategies, the error). :func:`_check_training` raises the error; :func:`~distnb.core.carryover.carry_over` drops a
#: carried value that the cell's strategy refuses.
STRATEGY_LIMITS = (
    ("clip_grad_norm", lambda v: v is not None, ("ps",), "--clip-grad-norm is not available with --strategy ps: "
     "the servers apply the averaged gradients, which no single rank sees"),
    ("precision", lambda v: v == "fp16", ("ps",), "--precision fp16 is not available with --strategy ps: the "
     "GradScaler cannot unscale gradients the servers apply (use bf16)"),
    ("compile", bool, ("pipeline", "ps"), "--compile is not available with --strategy {strategy} (use ddp, fsdp or "
     "tensor)"),
    ("sync_bn", bool, tuple(s for s in STRATEGIES if s not in ("ddp", "fsdp")), "--sync-bn is for data-parallel ddp "
     "and fsdp, not --strategy {strategy}"),
    ("precision", lambda v: v != "fp32", ("pipeline",), "--precision {value} with --strategy pipeline is not "
     "supported yet (the stages' losses come out NaN: the activations sent between stages are not cast); use fp32 "
     "for pipeline, or --precision with ddp, fsdp or tensor"),
)


def strategy_refuses(strategy: str, values: dict) -> dict:
    """Field -> error for each of ``values`` (field -> value) that ``strategy`` cannot take (:data:`STRATEGY_LIMITS`).

    In :data:`STRATEGY_LIMITS`' order; fields absent from ``values`` are not checked.
    """
    refused = {}
    for name, refuses, strategies, error in STRATEGY_LIMITS:
        if name in values and name not in refused and strategy in strategies and refuses(values[name]):
            refused[name] = error.format(strategy=strategy, value=values[name])
    return refused


@dataclass(frozen=True)
class RunOptions:
    """How the kernel runs and shows a training cell (nothing here reaches the ranks)."""

    progress: str = option("auto", "choice", "dashboard (auto: widgets in Jupyter, text elsewhere)",
                           choices=PROGRESS_MODES)
    all_output: bool = option(False, "flag", "show every rank's printed output")
    background: bool = option(False, "flag", "return at once and keep the kernel free while the dashboard updates; "
                              "%dist wait returns the result (and the weights), %dist stop-training stops the run")
    quiet: bool = option(False, "flag", "print nothing but errors", cli=False)

    def __post_init__(self):
        options.check_fields(self)


#: The options that decide how a model is distributed (:meth:`TrainPlan.strategy_key`).
DISTRIBUTION = options.distribution_fields(TrainPlan)


def _check_placement(spec) -> None:
    """Where engines run: how the launcher and its options fit together (see ClusterSpec)."""
    if spec.launcher is None and spec.profile is None:
        raise PlanError("--launcher is needed unless --profile names an ipyparallel profile that sets one")
    if len(set(spec.hosts)) != len(spec.hosts):
        raise PlanError(f"--hosts names a host twice: {', '.join(spec.hosts)} (use --engines-per-node for more "
                        "engines on one host)")
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


def _where(default, kind, help, **declared):
    """A placement option of ClusterSpec: where engines run (group ``placement``)."""
    return option(default, kind, help, group="placement", **declared)


@dataclass(frozen=True)
class ClusterSpec(lingering.Lingering):
    """What ``%dist start`` starts; every field is an option (see ``distnb.core.options``).

    ``n`` (``num_engines``) and ``backend`` left out are decided from the machine (one engine
    per GPU with nccl, else one per CPU core with gloo: ``distnb.cluster.cluster.default_spec``).
    """

    num_engines: int = option(kind="int", help="number of engines (ranks); default one per GPU, or one per CPU core "
                              "without GPUs", flags=("-n", "--engines"), keyword="n", given=None, minimum=1,
                              label="num_engines (-n)")
    backend: str = option("gloo", "choice", "torch.distributed backend (default nccl on GPUs, gloo on CPU)",
                          choices=BACKENDS, given=None)
    device_type: str = option("cpu", "choice", "where each rank computes; with cuda rank r sees only GPU local_rank",
                              choices=("cpu", "cuda"), cli=False, api=False)
    num_threads: int = option(1, "int", "torch intra-op threads per engine (CPU engines: cores // num_engines)",
                              minimum=1, cli=False, api=False)
    cpu_bind: str = option("auto", "choice", "CPU engines: cores binds each rank (every thread of its process) to its "
                           "own equal share of its host's cores when the host has at least as many cores as ranks "
                           "(1.18x faster DDP on 2 cores); none leaves them where the OS puts them; auto (default) "
                           "binds unless other processes keep this host busy during the start (a rank bound to a "
                           "core that another process also uses gets half of it), e.g. --cpu-bind none",
                           choices=CPU_BINDS)
    timeout: float = option(60.0, "float", "collective/rendezvous timeout in seconds (default 60)")
    hang_after: float | None = option(None, "float", "seconds ranks may wait in a collective that another rank has "
                                      "not reached before the cell ends, naming both (default 10, or half of a "
                                      "--timeout under 20; at most --timeout)")
    master_port: int | None = option(None, "int", "TCP port of the torch.distributed store (default: a free port); "
                                     "a taken port is an error naming it; 0 is a free port too (restart "
                                     "--master-port 0 unpins one given before)", minimum=0)
    auto_restart: bool = option(False, "flag", "when an engine dies during a cell, start a fresh world of the same "
                                "size at once (default off; on a running cluster this only switches the setting)",
                                given=None)
    on_failure: str = option("stop", "choice", "when an engine dies during a cell: stop (default; the cell fails, "
                             "%dist restart), restart (a fresh world at once, like --auto-restart) or shrink (the "
                             "cell goes on on the survivors at the smaller world: ddp from the last completed step, "
                             "fsdp/tensor from the newest --checkpoint-dir checkpoint), e.g. --on-failure shrink",
                             choices=FAILURE_POLICIES, given=None)
    launcher: str | None = _where("local", "choice", "ipyparallel engine launcher: local (default; with --profile, "
                                  "the profile's), mpi (mpiexec), ssh, or a batch system "
                                  f"({', '.join(BATCH_LAUNCHERS)})", choices=LAUNCHERS, given=None,
                                  nullable=True)
    hosts: tuple = _where((), "hosts", "ssh/mpi: hosts to start engines on, comma-separated without spaces or "
                          "quotes ([user@]host[:sshport]); rank 0 runs on the first", given=None)
    engines_per_node: int | None = _where(None, "int", "engines on each host or node (default: -n spread evenly; "
                                          "one per GPU on GPU hosts is usual)", minimum=1)
    nodes: int | None = _where(None, "int", "slurm: nodes to ask the scheduler for", minimum=1)
    queue: str | None = _where(None, "word", "batch queue (slurm partition)", flags=("--queue", "--partition"))
    time_limit: str | None = _where(None, "word", "slurm: wall-clock limit (e.g. 01:00:00)", flags=("--time",))
    account: str | None = _where(None, "word", "slurm: account to charge")
    profile: str | None = _where(None, "word", "ipyparallel profile (name or directory) whose ipcluster_config.py "
                                 "configures the launcher; options given here override it")
    interface: str | None = _where(None, "word", "network interface the ranks rendezvous and communicate over (e.g. "
                                   "eth0, ib0), by its name on the hosts; the controller listens on it too when this "
                                   "machine has it; default: the one that reaches rank 0 (loopback on one host)")
    master_addr: str | None = _where(None, "word", "rendezvous address for the torch.distributed store: an address "
                                     "of rank 0's host (the first of --hosts); default: rank 0's address that the "
                                     "other ranks reach (127.0.0.1 on one host)")

    def __post_init__(self):
        options.check_fields(self)
        _check_placement(self)
        if self.master_port is not None and self.master_port > 65535:
            raise PlanError(f"--master-port must be a TCP port (1-65535, or 0: a free one), got {self.master_port}")
        if self.master_port == 0:  # as for bind(): any free port, chosen at start
            object.__setattr__(self, "master_port", None)
        if self.backend == "nccl" and self.device_type != "cuda":
            raise PlanError("--backend nccl needs GPU engines; this machine has none (use --backend gloo)")
        if not 1 <= self.timeout <= MAX_TIMEOUT:
            raise PlanError(f"--timeout must be between 1 and {MAX_TIMEOUT} seconds (a week), got {self.timeout}")
        if self.hang_after is not None and self.hang_after > self.timeout:
            raise PlanError(f"--hang-after {self.hang_after:g} is longer than --timeout {self.timeout:g}: a hang would "
                            "end with gloo's timeout first; give a --hang-after of at most the --timeout")


def hang_seconds(spec: ClusterSpec) -> float:
    """Seconds after which ranks waiting for others in a collective are a hang (``--hang-after``)."""
    return spec.hang_after if spec.hang_after is not None else min(10.0, spec.timeout / 2)


#: Fields of ClusterSpec that say where engines run (the placement options).
PLACEMENT_OPTIONS = tuple(f.name for f, opt in options.declared(ClusterSpec) if opt.group == "placement")

for _cls in (TrainPlan, RunOptions, ClusterSpec):
    _cls.__doc__ = _cls.__doc__.rstrip() + "\n\n    Parameters\n    ----------\n" + "\n".join(
        "    " + line for line in options.doc(_cls, internal=True).splitlines()) + "\n"
__all__ = ["TrainPlan", "RunOptions", "ClusterSpec", "STRATEGIES", "SCHEDULES", "DEFAULT_LR", "BACKENDS", "LAUNCHERS",
           "BATCH_LAUNCHERS", "MAX_TIMEOUT", "PRECISIONS", "LR_SCHEDULES", "CPU_BINDS", "PROGRESS_MODES", "PLACEMENT_OPTIONS", "redistribution", "check_int",
           "mesh_shape"]
