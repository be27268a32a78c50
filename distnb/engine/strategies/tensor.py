"""Tensor (intra-layer model) parallelism with DTensor: ``parallelize_module``.

Megatron-LM style tensor parallelism (Shoeybi et al., "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", 2019) as implemented by
``torch.distributed.tensor.parallel``: in a pair of linear layers ``y = B(f(A(x)))`` with
an elementwise ``f``, ``A`` is split by output features (``ColwiseParallel``: each rank
holds ``out_features / world_size`` rows of ``A.weight`` and of ``A.bias`` and computes
that slice of the activation, shape ``(..., out_features / world_size)``) and ``B`` by
input features (``RowwiseParallel``: each rank holds ``in_features / world_size`` columns
of ``B.weight``; the partial products are summed with one all-reduce, and ``B.bias`` is
replicated). One all-reduce in the forward and one in the backward per pair; the output
is an ordinary (replicated) tensor, identical on every rank.

Every rank trains on the same batches (``data_parallel = False``: the data set is not
cut into shards), so replicated parameters (biases of row-wise layers, layers left
unsplit) get identical gradients on every rank without any extra all-reduce: their
inputs are the all-reduced, identical activations.

Plan
----
``--tp-plan NAME``: a kernel dict ``{submodule name: ParallelStyle}`` passed to
``parallelize_module`` as is (names may use its ``fnmatch`` patterns, e.g. ``blocks.*.fc1``).

Default: within each module, its direct children in registration order; two ``nn.Linear``
children with only elementwise, parameter-free modules (activations, dropout) between them
and ``A.out_features == B.in_features`` become ``A: ColwiseParallel``,
``B: RowwiseParallel``. This assumes registration order is the order of the forward (as in
``nn.Sequential``) and that whatever the forward does between ``A`` and ``B`` (functional
code included, which no module list shows) is elementwise over ``A``'s output features; an
``nn.Linear`` without such a partner stays replicated (rank 0 says so when the strategy is
built). For models whose forward differs, pass ``--tp-plan``.

Verified: whichever plan, the first forward after the strategy is built compares the split
model with the whole one on that real input (:mod:`.tensor_check`); a mean, softmax,
normalization or reshape across the split features is a ``StrategyError`` on every rank
before any step, naming the pair.

Errors (kernel side, :class:`~distnb.engine.strategies.StrategyError`): a plan key that
matches no submodule (the message lists the valid names), a value that is not a
``ParallelStyle``, column/row-wise styles on a module that is not ``nn.Linear`` or
``nn.Embedding``, a split dimension not divisible by ``world_size`` (the message names the
layer), no linear pair for the default plan.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch.nn as nn

from distnb.engine.strategies import Strategy, StrategyError, compiling, gathered_state, levers, tensor_bytes
from distnb.engine.strategies.fsdp import make_mesh, module_names, optimizer_state_bytes, release_group
from distnb.engine.strategies.tensor_check import VerifiedPlan

#: Parameter-free modules that act elementwise on the last dimension, allowed between the
#: two linear layers of a default pair (a sharded activation passes through them unchanged).
ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Mish, nn.LeakyReLU, nn.ELU, nn.SELU,
               nn.CELU, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Tanhshrink, nn.Softsign,
               nn.Dropout, nn.Identity)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def default_pairs(module) -> tuple[list[tuple[str, str]], list[str]]:
    """Consecutive ``nn.Linear`` pairs of ``module`` and the linear layers left unpaired.

    Returns
    -------
    pairs : list of (str, str)
        (column-wise name, row-wise name), in registration order.
    leftovers : list of str
        Names of ``nn.Linear`` modules in no pair (they stay replicated).
    """
    pairs, leftovers = [], []
    for prefix, parent in module.named_modules():
        pending = None  # (name, layer) of a Linear still looking for its partner
        for name, child in parent.named_children():
            full = _join(prefix, name)
            if isinstance(child, nn.Linear):
                if pending is not None and pending[1].out_features == child.in_features:
                    pairs.append((pending[0], full))
                    pending = None
                else:
                    if pending is not None:
                        leftovers.append(pending[0])
                    pending = (full, child)
            elif isinstance(child, ELEMENTWISE):
                continue
            elif pending is not None:
                leftovers.append(pending[0])
                pending = None
        if pending is not None:
            leftovers.append(pending[0])
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    return (sorted(pairs, key=lambda pair: order.get(pair[0], len(order))),
            sorted(leftovers, key=lambda name: order.get(name, len(order))))


def default_plan(module) -> dict:
    """``{name: ColwiseParallel() / RowwiseParallel()}`` for :func:`default_pairs`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for col, row in default_pairs(module)[0]:
        plan[col], plan[row] = ColwiseParallel(), RowwiseParallel()
    return plan


def resolve(module, key: str) -> list[tuple[str, nn.Module]]:
    """Submodules a plan key names, matched as ``parallelize_module`` does (``fnmatch`` per atom)."""
    found = [("", module)]
    for token in key.split("."):
        found = [(_join(prefix, name), child) for prefix, parent in found
                 for name, child in parent.named_children() if fnmatch(name, token)]
    return found


def _kind(style) -> str | None:
    """``"column"``, ``"row"`` or None: how a ``ParallelStyle`` splits a layer (None: not a col/row split)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return "column" if isinstance(style, ColwiseParallel) else "row" if isinstance(style, RowwiseParallel) else None


def _split_dims(kind, layer, style_name: str):
    """(what, dimension, size) that a ``kind`` split (``"column"``/``"row"``) divides across ranks, or None."""
    if kind == "column":
        if isinstance(layer, nn.Linear):
            return "column-wise", "out_features", layer.out_features
        if isinstance(layer, nn.Embedding):
            return "column-wise", "embedding_dim", layer.embedding_dim
    elif kind == "row":
        if isinstance(layer, nn.Linear):
            return "row-wise", "in_features", layer.in_features
        if isinstance(layer, nn.Embedding):
            return "row-wise", "num_embeddings", layer.num_embeddings
    else:
        return None
    raise StrategyError(f"is a {type(layer).__name__}; {style_name} ({kind}-wise split) supports only "
                        "nn.Linear and nn.Embedding")


def check_plan(tp_plan, module, world_size: int, where: str, degree: str = "") -> None:
    """Raise :class:`StrategyError` unless ``tp_plan`` fits ``module`` split over ``world_size`` ranks.

    ``degree``: how the message names that number and its fix (default: the world size, fixed
    with ``-n``); fsdp+tensor passes its mesh's tensor-parallel size.
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(tp_plan, dict) or not tp_plan:
        raise StrategyError(f"{where} must be a non-empty dict {{submodule name: ParallelStyle}}, e.g. "
                            "{'fc1': ColwiseParallel(), 'fc2': RowwiseParallel()}; got "
                            f"{type(tp_plan).__name__}")
    for key, style in tp_plan.items():
        if not isinstance(key, str):
            raise StrategyError(f"{where}: keys must be submodule names (str), got {key!r}")
        if not isinstance(style, ParallelStyle):
            raise StrategyError(f"{where}[{key!r}] is a {type(style).__name__}, not a ParallelStyle "
                                "(ColwiseParallel(), RowwiseParallel(), ... from torch.distributed.tensor.parallel)")
    _check_splits([(key, _kind(style), type(style).__name__) for key, style in tp_plan.items()], module, world_size,
                  where, degree)


def _check_splits(splits, module, world_size: int, where: str, degree: str) -> None:
    """Each ``(plan key, kind, style name)`` of ``splits`` names submodules whose split dimension divides evenly."""
    for key, kind, style_name in splits:
        matches = resolve(module, key) if key else [("", module)]
        if not matches:
            raise StrategyError(f"{where}: {type(module).__name__} has no submodule {key!r}; valid names: "
                                f"{module_names(module)}")
        for name, layer in matches:
            try:
                split = _split_dims(kind, layer, style_name)
            except StrategyError as exc:
                raise StrategyError(f"{where}[{key!r}]: {name or 'the model'} {exc}") from None
            if split is not None and split[2] % world_size:
                how, dim, size = split
                what = degree or f"world_size {world_size}; resize the layer, use -n dividing {size}"
                raise StrategyError(f"{where}: {name} is split {how} but its {dim} ({size}) is not divisible by "
                                    f"{what}, or leave it out of the plan (--tp-plan)")


def resolve_plan(module, plan, ns) -> tuple[dict, list[str]]:
    """Rank side: (``{submodule name: ParallelStyle}``, names left replicated) for ``plan``.

    ``--tp-plan NAME``: the dict ``NAME`` in the engine namespace ``ns``; else
    :func:`default_plan` and the ``nn.Linear`` layers it leaves whole.

    Raises
    ------
    NameError
        If ``--tp-plan`` names nothing on this rank.
    """
    import torch.distributed as dist

    if plan.tp_plan is not None:
        if plan.tp_plan not in ns:
            raise NameError(f"--tp-plan {plan.tp_plan!r} is not defined on rank {dist.get_rank()}")
        return ns[plan.tp_plan], []
    return default_plan(module), default_pairs(module)[1]


def plan_label(plan) -> str:
    """How errors name the plan: ``--tp-plan NAME``, or ``tensor plan`` for the default one."""
    return f"--tp-plan {plan.tp_plan}" if plan.tp_plan else "tensor plan"


class DefaultPlanHint:
    """Mixin for strategies that split layers with a tensor plan (``plan``, ``tp_plan``, ``replicated``):
    an error of the step under the default plan says what that plan split (:func:`explain_default_plan`)."""

    def step(self, ns, code, ctx):
        try:
            return super().step(ns, code, ctx)
        except StrategyError:  # the plan's check (tensor_check.py) says it all
            raise
        except (RuntimeError, IndexError, ValueError) as exc:
            explain_default_plan(exc, self.plan, self.tp_plan, self.replicated)
            raise


class Tensor(VerifiedPlan, DefaultPlanHint, Strategy):
    """Linear layers split across ranks (column- then row-wise); every rank sees the same batches.

    Attributes
    ----------
    tp_plan : dict
        ``{submodule name: ParallelStyle}`` as passed to ``parallelize_module``.
    replicated : list of str
        Default plan: ``nn.Linear`` layers left whole on every rank.
    mesh : torch.distributed.device_mesh.DeviceMesh
        1-D mesh over all ranks (the default process group).
    """

    name = "tensor"
    shards_first = True  # split on the meta device, then this rank materialises its part
    data_parallel = False
    replicas = True  # the layers it leaves whole (and Replicate parameters) are copies every rank must keep equal
    wraps_model = False  # parallelize_module changes the module in place

    def __init__(self, module, plan, device, ns):
        import torch.distributed as dist
        from torch.distributed.tensor.parallel import parallelize_module

        super().__init__(module, plan, device, ns)
        levers.checkpoint_blocks(module, plan)  # --activation-checkpointing, before wrapping
        world_size = dist.get_world_size()
        self.tp_plan, self.replicated = resolve_plan(module, plan, ns)
        check_plan(self.tp_plan, module, world_size, plan_label(plan))
        self.mesh = make_mesh(device.type, (world_size,))
        self.arm(module, plan_label(plan), describe(self.tp_plan), default_pairs(module)[0] if plan.tp_plan is None
                 else ())  # the whole model, to verify the plan on the first forward (tensor_check.py)
        parallelize_module(module, self.mesh, self.tp_plan)
        self.model = module
        self.watch()
        self._optimizer = None
        if dist.get_rank() == 0 and plan.tp_plan is None:
            print(f"distnb: {describe(self.tp_plan, self.replicated)}", flush=True)

    @classmethod
    def check(cls, plan, module, world_size: int) -> None:
        super().check(plan, module, world_size)
        check_default(plan, module, world_size)

    @classmethod
    def check_names(cls, plan, module, world_size: int, ns) -> None:
        """Kernel side: validate the ``--tp-plan`` dict in the kernel namespace ``ns``."""
        if plan.tp_plan is not None and plan.tp_plan in ns:
            check_plan(ns[plan.tp_plan], module, world_size, f"--tp-plan {plan.tp_plan}")

    def full_state(self, keys=None):
        """Full tensors on rank 0 (CPU), assembled with ``DTensor.full_tensor``; a collective (``keys``: only these entries)."""
        return gathered_state(self.module, keys)

    def holdings(self) -> dict:
        """Bytes of parameters stored here (local shards, whole replicated ones) and of optimizer state."""
        sharded = replicated = 0
        for p in self.module.parameters():
            placements = getattr(p, "placements", ())
            if any(pl.is_shard() for pl in placements):
                sharded += tensor_bytes(p)
            else:
                replicated += tensor_bytes(p)
        return dict(param_bytes=sharded + replicated, sharded_param_bytes=sharded,
                    replicated_param_bytes=replicated, optimizer_state_bytes=optimizer_state_bytes(self._optimizer))

    def close(self) -> None:
        self._disarm()
        release_group(self.mesh, None)  # the mesh outlives us in DTensor's caches: drop its group
        compiling.uncompile(self.module)
        self.model = None
        self.mesh = None
        self._optimizer = None


def check_default(plan, module, size: int, degree: str = "") -> None:
    """Kernel side: without ``--tp-plan``, the default plan must exist and split evenly over ``size`` ranks.

    A ``--tp-plan`` dict lives in the kernel namespace and is checked by ``check_names``.
    """
    if plan.tp_plan is not None:
        return
    pairs, _ = default_pairs(module)
    if not pairs:
        raise StrategyError(f"{type(module).__name__} has no two consecutive nn.Linear layers (out_features "
                            "of the first = in_features of the second, only activations between) to split; "
                            "pass --tp-plan NAME, a dict {submodule name: ColwiseParallel() / "
                            "RowwiseParallel()}")
    # the default plan's kinds, without its ParallelStyle objects: the kernel does not import
    # torch.distributed.tensor.parallel for them (41 MiB, 16 % of a 0.25 GiB model's bound, issue 34)
    splits = [(name, kind, style) for col, row in pairs
              for name, kind, style in ((col, "column", "ColwiseParallel"), (row, "row", "RowwiseParallel"))]
    _check_splits(splits, module, size, "tensor plan", degree)


def explain_default_plan(exc: BaseException, plan, tp_plan: dict, replicated) -> None:
    """Add to ``exc`` (an error of the step) what the default plan split, when it was the default."""
    if plan.tp_plan is None and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n[distnb] the default tensor plan splits consecutive nn.Linear layers "
                    f"in the order they are defined ({describe(tp_plan, replicated)}); if the "
                    "forward pass uses them differently (residual blocks, unused layers), give your own "
                    "plan with --tp-plan NAME",) + exc.args[1:]


def describe(tp_plan: dict, replicated=(), whole: str = "replicated on every rank") -> str:
    """One line: which layer is split how, and which linear layers stay ``whole`` (how they are kept)."""
    how = {"ColwiseParallel": "column-wise", "RowwiseParallel": "row-wise"}
    parts = [f"{name!r} {how.get(type(style).__name__, type(style).__name__)}" for name, style in tp_plan.items()]
    text = "tensor plan: " + ", ".join(parts)
    if replicated:
        text += f"; {', '.join(map(repr, replicated))} {whole} (no nn.Linear partner to split with)"
    return text


STRATEGY = Tensor
