"""How a model is distributed over the ranks: one module per strategy.

Each module defines a :class:`Strategy` subclass; :func:`build` picks it by
``plan.strategy``. The training loop (``engine/loop.py``) only talks to this interface:

- ``model``: what the step body calls (the DDP wrapper, the sharded module, ...);
- ``parameters()``: what this rank's optimizer updates;
- ``wrap_optimizer(opt)``: a hook for strategies that own the update (parameter server);
- ``step(ns, code, ctx)``: one forward (under ``ctx.autocast()``) and backward (``ctx.backward``:
  scaled for accumulation and fp16) on ``ns["batch"]``, returning the loss;
- ``no_sync()``: a context in which backward skips the gradient reduction (the first
  micro-steps of ``--accumulate``);
- ``compile()``: ``torch.compile`` what the body calls, after the wrapping (``--compile``; DDP: the module it
  wraps, in place, as torch advises: see :mod:`distnb.engine.strategies.compiling`);
- ``full_state()``: the whole model's state dict, assembled on rank 0 (a collective: called
  on every rank);
- ``checkpoint_state(opt)`` / ``load_checkpoint_state(...)``: what torch.distributed.checkpoint
  saves and restores for this rank;
- ``holdings()``: what this rank holds (parameter bytes, stage, ...);
- ``mesh_coordinates()``: where this rank sits in a named device mesh (``%dist status``).

Every ``step`` validates the body's ``loss`` with :func:`check_loss`.

Kernel side, before anything runs, :func:`check` validates a plan against the model and
the world size with the strategy's ``check`` classmethod (no process group needed), and
:func:`data_parallel_size` tells how many shards the data set is cut into.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers

import torch

from distnb.core.plan import STRATEGIES
from distnb.engine.process.collectives import group_device
from distnb.engine.strategies import compiling, materialize
from distnb.engine.transport import stateout


class StrategyError(ValueError):
    """A strategy option does not fit the model or the cluster (raised before training)."""

    #: True for a refusal raised alike on every rank before any step that leaves the model as it found it (the
    #: tensor plan's check): the training cell that fails with it keeps the process group when every rank ended
    #: it alike (:mod:`distnb.engine.train.beforestep`).
    before_step = False


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for ``t`` (the local shard of a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class Strategy:
    """Base class: data parallelism without a wrapper (the module itself is ``model``).

    Subclasses set :attr:`name` and override what differs.

    Parameters
    ----------
    module : torch.nn.Module
        The model as received from the kernel, already on ``device``.
    plan : distnb.core.plan.TrainPlan
    device : torch.device
    ns : dict
        The engine namespace (kernel names pushed there, e.g. a ``--tp-plan`` dict).
    """

    name = "base"
    #: True: every rank sees different samples (the data is cut into world_size shards).
    #: False: every rank trains on the same batches (model parallelism).
    data_parallel = True
    #: True: the body may drive its own loop (--loop) with ``model`` like a module.
    supports_loop = True
    #: True: ``model`` is a wrapper that must be called (calling the bare module skips the sync).
    wraps_model = False
    #: True: after backward every rank holds the same whole gradients (ddp): no rank can overflow alone.
    replicated_grads = False
    #: True: the trained weights go back to the kernel in bounded parts after the cell
    #: (:mod:`distnb.engine.train.stateparts`), not whole in the training result.
    streams_state = True
    #: True: plain (non-DTensor) parameters and buffers are whole on every rank and must stay equal there
    #: (ddp; tensor parallelism's unsharded ones): ``--check-replicas`` compares them (engine/replicas.py).
    replicas = False
    #: True: plain (non-DTensor) gradients of different ranks belong to different parameters
    #: (pipeline stages): the total gradient norm adds them over the ranks.
    grads_partitioned = False
    #: True: the strategy can split a meta-device module, and this rank then materialises only its part
    #: (:mod:`distnb.engine.strategies.materialize`); False: every rank holds the whole model (ddp, ps).
    shards_first = False
    #: With --compile: dynamo's figures when the model was compiled (:func:`distnb.engine.strategies.compiling.snapshot`).
    compiled_since = None

    def __init__(self, module, plan, device, ns):
        self.module, self.plan, self.device = module, plan, device
        self.model = module
        self._optimizer = None

    # kernel side ---------------------------------------------------------------
    @classmethod
    def check(cls, plan, module, world_size: int) -> None:
        """Raise :class:`StrategyError` if ``plan`` cannot run ``module`` on ``world_size`` ranks."""
        if plan.loop and not cls.supports_loop:
            raise StrategyError(f"--loop is not available with --strategy {plan.strategy}: the strategy drives "
                                "each step; write one step that sets `loss`")

    @classmethod
    def check_names(cls, plan, module, world_size: int, ns) -> None:
        """Kernel side: validate the kernel objects the plan names (a ``--tp-plan`` dict) in ``ns``.

        A name missing from ``ns`` is left to the session, which reports it.
        """

    @classmethod
    def data_parallel_size(cls, plan, world_size: int) -> int:
        """Number of data shards (ranks that see different samples); it divides ``world_size``.

        With fewer shards than ranks, the ranks of one shard are consecutive
        (:func:`distnb.engine.transport.shard.shard_index`): a strategy on a mesh puts its
        data-parallel dimension outermost.
        """
        return world_size if cls.data_parallel else 1

    # rank side -------------------------------------------------------------------
    def keeps(self, name: str) -> bool:
        """Whether this rank holds (part of) the parameter or buffer ``name`` (all of them by default)."""
        return True

    def param_device(self):
        """Where this rank's parameters of a model split on the meta device are materialised (its device)."""
        return self.device

    def placed(self) -> None:
        """Called once a module split on the meta device has this rank's tensors (materialised in place)."""

    def parameters(self):
        """The parameters this rank's optimizer updates."""
        return self.module.parameters()

    def wrap_optimizer(self, optimizer):
        """The optimizer the loop steps (the parameter server replaces ``step``); kept as ``_optimizer``."""
        self._optimizer = optimizer
        return optimizer

    def step(self, ns, code, ctx):
        """Run the body once on ``ns["batch"]`` and back-propagate; return (loss, float or None)."""
        ns.pop("loss", None)
        with ctx.autocast():
            exec(code, ns)
        loss = ns.get("loss")
        value = check_loss(loss, ctx)
        ctx.backward(loss)
        return loss, value

    def no_sync(self):
        """A context whose backward passes skip the gradient reduction (default: nothing to skip)."""

        return contextlib.nullcontext()

    def compile(self) -> None:
        """``--compile``: the forward of what the body calls is compiled in place, after any wrapping
        (:func:`distnb.engine.strategies.compiling.compile_in_place`; ``close`` undoes it).

        The ranks of one host share inductor's cache folder (:func:`distnb.engine.strategies.compiling.set_cache_dir`).
        What dynamo made of it is reported per cell (:func:`distnb.engine.strategies.compiling.report`).
        """
        compiling.compile_in_place(self.model)

    def eval_model(self):
        """What validation calls: the model in this rank's distributed form (``model`` by default)."""
        return self.model

    def check_grads(self) -> None:
        """Before a cell's first optimizer step: raise if the step would be wrong (nothing by default)."""

    def sync_buffers(self) -> None:
        """Every rank's module buffers (BatchNorm's running statistics) set to rank 0's, when the data is sharded.

        Each rank updates its buffers from its own shard (DDP copies rank 0's to the others only at
        the start of each training forward), and the notebook receives rank 0's. Validation calls
        this first (every rank), so that it evaluates the model the notebook gets. One broadcast per
        buffer; nothing when every rank trained on the same batches (tensor, pipeline), for one
        rank, or for a model without buffers.
        """
        import torch.distributed as dist

        if not self.data_parallel or dist.get_world_size() == 1:
            return
        for buf in self.module.buffers():
            if buf.device.type != "meta" and not hasattr(buf, "to_local"):  # a DTensor buffer is the mesh's
                dist.broadcast(buf, src=0)  # group device: the module's buffers, on the rank's device

    def full_state(self, keys=None):
        """The whole model's state as :func:`~distnb.engine.transport.stateout.flatten_state` on rank 0, None elsewhere.

        Called on every rank (strategies that shard the model gather with collectives). ``keys``: only
        these ``state_dict`` entries (a part of the state streamed to the kernel), None: all.
        """
        import torch.distributed as dist


        if dist.get_rank() != 0:
            return None
        return stateout.flatten_state(stateout.select(self.module.state_dict(), keys))

    def checkpoint_state(self, optimizer):
        """(model state dict, optimizer state dict) as ``torch.distributed.checkpoint`` saves them.

        Uses ``torch.distributed.checkpoint.state_dict.get_state_dict`` (sharded tensors stay
        sharded: each rank saves its part). Every rank calls it. ``optimizer`` None (a model whose
        weights were loaded, ``%dist load``, and not trained yet: no optimizer exists): the model's
        state dict and an empty optimizer state.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is None:
            return get_model_state_dict(self.module), {}
        return get_state_dict(self.module, optimizer)

    def load_checkpoint_state(self, optimizer, model_state, optimizer_state) -> None:
        """Load what :meth:`checkpoint_state` described (filled in by ``dcp.load``); ``optimizer_state``
        None: the model only (a checkpoint whose optimizer state this strategy cannot read)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if optimizer_state is None:
            set_model_state_dict(self.module, model_state)
            return
        set_state_dict(self.module, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)

    def mesh_coordinates(self) -> dict | None:
        """This rank's coordinates in a named device mesh (``{"dp": 0, "tp": 1, "shape": "2x2"}``), or None.

        Shown by ``%dist status``; strategies on a 1-D mesh over all ranks (where the coordinate
        is the rank) and without one return None.
        """
        return None

    def holdings(self) -> dict:
        """What this rank holds: ``param_bytes`` (bytes of parameters stored here) and more."""
        return dict(param_bytes=sum(tensor_bytes(p) for p in self.module.parameters()))

    def close(self) -> None:
        """Drop references to the process group (called before it is re-formed); undo --compile."""
        compiling.uncompile(self.model)
        compiling.uncompile(self.module)
        self.model = None


def is_container(module) -> bool:
    """Whether ``module`` only holds others and is never called itself.

    ``nn.ModuleList``, ``nn.ModuleDict``, ``nn.ParameterList`` and ``nn.ParameterDict`` that
    keep ``nn.Module``'s forward: the model's forward indexes or iterates them and calls their
    elements, so a hook on the container itself (an FSDP unit's all-gather, a pipeline split
    point) never runs. FSDP2 refuses such a module as a unit.
    """
    from torch import nn

    kinds = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
    return isinstance(module, kinds) and type(module).forward is nn.Module.forward


def check_loss(loss, ctx):
    """Validate the body's ``loss``; returns ``float(loss)``, read on every device.

    ``--nan stop`` (the default) stops *before* the update, so the value must be known before
    ``optimizer.step()``: on a GPU rank this read is one host synchronisation per step (the same
    one ``torch.amp.GradScaler`` makes for fp16). The value then serves the progress report and
    the epoch mean, which read nothing more. It once returned None for a non-CPU loss, and NaN
    losses trained on silently on GPUs (GPU review, finding 4).

    Raises
    ------
    FloatingPointError
        ``--nan stop`` and a NaN or infinite loss, naming the rank, epoch and step.
    ValueError
        No ``loss``, not a scalar tensor, or one that does not require grad.
    """
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
        value = loss.item()
        if ctx.plan.nan == "stop" and not math.isfinite(value):
            raise FloatingPointError(f"the loss is {value} at rank {ctx.rank}, epoch {ctx.epoch}, step {ctx.step}; "
                                     "training stopped before the update (lower --lr, check the data, or pass "
                                     "--nan skip to drop such steps)")
        return value
    where = f"epoch {ctx.epoch}, step {ctx.step}"  # the same on every rank: the RankError names the ranks
    if loss is None:
        raise ValueError(f"the %%distrain body left no `loss` ({where}); its last line should be "
                         "like `loss = F.cross_entropy(model(x), y)`")
    if isinstance(loss, numbers.Number) or (hasattr(loss, "dtype") and not isinstance(loss, torch.Tensor)
                                             and getattr(loss, "ndim", None) == 0):  # a float, a numpy scalar
        raise ValueError(f"`loss` is a Python {type(loss).__name__}, not a scalar tensor ({where}): `.item()` (or "
                         "float()) turns the loss into a number that backward cannot run through; drop `.item()` and "
                         "leave the tensor, e.g. `loss = F.cross_entropy(model(x), y)` (distnb logs its value)")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"`loss` must be a scalar tensor, got {shape} ({where}); reduce it, e.g. `.mean()`")
    raise ValueError(f"`loss` does not require grad ({where}); compute it from `model(...)` outputs (a `.item()`, "
                     "`.detach()` or `torch.tensor(...)` on the way cuts it from the graph: drop it)")


def gathered_state(module, keys=None):
    """``module``'s full (unsharded) state on rank 0 as :func:`~distnb.engine.transport.stateout.flatten_state`, None elsewhere.

    One tensor at a time: each DTensor (FSDP2, tensor parallel) comes to rank 0 shard by shard, each
    rank's piece placed straight into rank 0's outbox (:mod:`distnb.engine.transport.gather`; a placement
    it does not place is all-gathered whole), every rank calling this in the state_dict's order
    (:func:`distnb.engine.transport.stateout.write_state`). Rank 0 holds the outbox plus one message, not
    the whole state first and its copy after (``get_model_state_dict(full_state_dict=True)``).
    ``keys``: only these entries (the same on every rank), None: all.
    """
    import torch.distributed as dist


    return stateout.write_state(list(stateout.select(module.state_dict(), keys).items()), writer=dist.get_rank() == 0,
                                device=group_device())


def strategy_class(name: str) -> type:
    """The :class:`Strategy` subclass for ``name`` (imports its module, named as the strategy).

    Which strategies exist, and whether distributing one changes the module in place, is
    declared once in :data:`distnb.core.plan.STRATEGIES`; a composed strategy's module replaces ``+``
    by ``_`` (``fsdp+tensor``: ``fsdp_tensor.py``).
    """
    if name not in STRATEGIES:
        raise StrategyError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    module = importlib.import_module(f"{__name__}.{name.replace('+', '_')}")  # fsdp+tensor: fsdp_tensor.py
    return module.STRATEGY


def build(module, plan, device, ns, pending=None) -> Strategy:
    """Distribute ``module`` for ``plan.strategy`` on this rank (then compile it).

    ``module`` is on ``device``, or, with ``pending`` (:class:`distnb.engine.strategies.materialize.Pending`), its
    structure on the meta device: a strategy that shards (:attr:`Strategy.shards_first`) then splits
    it as it is and only this rank's part is materialised; the others get the whole model first.
    """
    cls = strategy_class(plan.strategy)
    init = materialize.init_function(ns, plan) if pending is not None else None
    if pending is not None and not cls.shards_first:
        materialize.materialize(pending, module, device, None, init)
        pending = None
    strategy = cls(module, plan, device, ns)
    if pending is not None:
        materialize.materialize(pending, module, device, strategy.keeps, init, strategy.param_device())
        strategy.placed()
    if getattr(plan, "compile", False):
        compiling.fresh()
        strategy.compiled_since = compiling.snapshot()  # what dynamo did for this model is counted from here
        strategy.compile()
    return strategy


def check(plan, module, world_size: int, ns=None) -> None:
    """Kernel side: validate ``plan`` for ``module`` on ``world_size`` ranks before training.

    ``ns``: the kernel namespace, for options that name kernel objects (``--tp-plan``).
    """
    cls = strategy_class(plan.strategy)
    cls.check(plan, module, world_size)
    if ns is not None:
        cls.check_names(plan, module, world_size, ns)


def data_parallel_size(plan, world_size: int) -> int:
    """How many shards the data set is cut into for ``plan``."""
    return strategy_class(plan.strategy).data_parallel_size(plan, world_size)
