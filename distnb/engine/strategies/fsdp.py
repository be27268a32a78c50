"""Sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Fully Sharded Data Parallel (Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully
Sharded Data Parallel", VLDB 2023), in its second, per-parameter form (FSDP2): every
parameter becomes a ``DTensor`` sharded on dim 0 over a 1-D device mesh of all
``world_size`` ranks (``Shard(0)``; an uneven dim 0 gives the first ranks one row more), so
each rank stores 1/world_size of the parameters, of their gradients and of the optimizer
state (the optimizer is built over the sharded parameters). This is ZeRO stage 3
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020).

Each *FSDP unit* all-gathers its parameters just before its forward (and again before its
backward) and frees them afterwards; gradients are reduce-scattered, averaged over the
ranks, so that after ``backward()`` each rank holds the mean gradient of its own shard. A
step therefore equals one process training on the union of the ranks' batches.

Units: ``--fsdp-units NAME,...`` (submodule names as in ``model.named_modules()``), or by
default every direct child of the model that holds parameters (the elements of an
``nn.ModuleList`` or ``nn.ModuleDict`` child, which is never called itself); the root is always a unit
(it takes the parameters no other unit holds). Units are sharded innermost first.

Tied weights (one ``Parameter`` used by two modules, ``out.weight = emb.weight``): FSDP2
refuses a parameter held by two units. The units that share one are sharded together, as
one group (``fully_shard([emb, out])``, the form torch's own error suggests), and a unit
that shares a parameter with the root, or with a unit around it, is not a unit of its own:
its parameters go to that outer unit (:func:`unit_groups`).

Buffers (BatchNorm running statistics) are not sharded: each rank keeps its own, updated
from its own batches, and rank 0's are loaded back into the kernel.

Errors (kernel side, :class:`~distnb.engine.strategies.StrategyError`): a unit name that is
not a submodule (the message lists the valid names), a unit without parameters, a model
without parameters, units whose tied parameters no order of grouped units can shard.
"""

from __future__ import annotations

import contextlib
import linecache
import re
import sys
import weakref

from distnb.engine.process import runtime
from distnb.engine.strategies import (
    Strategy,
    StrategyError,
    compiling,
    finetune,
    gathered_state,
    is_container,
    levers,
    tensor_bytes,
)

#: Device meshes made by the fsdp and tensor strategies on this rank, by id (meshes of one
#: shape compare equal, so no set). DTensor's caches keep them (and so the process group)
#: alive after their model is gone: released at teardown.
_MESHES: dict[int, weakref.ref] = {}
#: Meshes of two or more dimensions by (device type, shape, names, group generation): made
#: once per process group and reused (see :func:`make_mesh`); dropped at teardown.
_GRIDS: dict[tuple, object] = {}


def _has_params(module) -> bool:
    return any(True for _ in module.parameters())


def module_names(module, limit: int = 30) -> str:
    """The submodule names of ``module`` as one line (the first ``limit``), for error messages."""
    names = [n for n, _ in module.named_modules() if n]
    text = ", ".join(names[:limit])
    return text + (f", ... ({len(names) - limit} more)" if len(names) > limit else "") if names else "(none)"


def default_units(module, prefix: str = "") -> list[str]:
    """Names of the direct children of ``module`` that hold parameters.

    A container child (``nn.ModuleList``, ``nn.ModuleDict``: never called itself, see
    :func:`~distnb.engine.strategies.is_container`) is replaced by its own children with
    parameters (``blocks.0``, ``blocks.1``, ...), repeatedly; a ``ParameterList`` or
    ``ParameterDict`` child is none (its parameters go to the unit around it, the root).

    A Hugging Face model (plain or under ``peft``) has its decoder blocks as units instead
    (:func:`~distnb.engine.strategies.finetune.block_units`: the classes of its ``_no_split_modules``).
    """
    blocks = [] if prefix else finetune.block_units(module)
    if blocks:
        return blocks
    units = []
    for name, child in module.named_children():
        if not _has_params(child):
            continue
        if is_container(child):
            units += default_units(child, f"{prefix}{name}.")
        else:
            units.append(prefix + name)
    return units


#: What DTensor says when an op gets a unit's sharded parameter (a DTensor) next to a plain tensor.
MIXED = "got mixed torch.Tensor and DTensor"


def used_outside(exc: BaseException, units, named_only: bool = False) -> StrategyError | None:
    """The StrategyError for ``exc`` when it is a unit's parameter used outside that unit's forward, else None.

    FSDP2 gathers a unit's parameters only while its forward runs; anywhere else (an output layer
    tied to an embedding as ``h @ self.wte.weight.T`` in the model's forward) they are this rank's
    shard, a DTensor, and torch's error names neither the parameter nor the fix. The lines of the
    notebook's code in the traceback that name a unit (``self.wte``) say which; leaving those out
    of the units gives their parameters to the root unit, gathered for the whole forward.
    ``named_only``: None unless such a line names a unit (fsdp+tensor, where a tensor plan can mix
    them too).
    """

    if not isinstance(exc, RuntimeError) or MIXED not in str(exc):
        return None
    units = [u for group in units for u in group.split("+")]
    lines, tb = [], exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if "site-packages" not in code.co_filename and "/distnb/" not in code.co_filename:
            lines.append(linecache.getline(code.co_filename, tb.tb_lineno).strip())
        tb = tb.tb_next
    named = [u for u in units if any(re.search(rf"\bself\.{re.escape(u)}\b", line) for line in lines)]
    rest = [u for u in units if u not in named and not any(u.startswith(n + ".") for n in named)]
    if named_only and not named:
        return None
    if named:
        fix = (f"--fsdp-units {','.join(rest)} (not {', '.join(named)}: its parameters then go to the root unit, "
               "gathered for the whole forward)" if rest else f"--fsdp-units without {', '.join(named)}")
        what = f"{', '.join(named)} (`{next(line for line in lines if any('self.' + u in line for u in named))}`)"
    else:
        fix = "--fsdp-units without the module whose parameter the forward uses directly (it then goes to the root unit)"
        what = "one of the units " + ", ".join(units)
    return StrategyError(f"the model's forward uses a parameter of FSDP unit {what} outside that unit's own forward; "
                         f"FSDP2 gathers a unit's parameters only while its forward runs (elsewhere they are this "
                         f"rank's shard: torch says '{str(exc).splitlines()[0]}'). Fix: {fix}")


class FSDP(Strategy):
    """Each rank holds 1/world_size of every parameter, its gradient and its optimizer state.

    Attributes
    ----------
    units : list of str
        Submodules sharded as their own FSDP unit (the root is one too), innermost first;
        units sharded together because they share a parameter are joined by ``+``.
    mesh : torch.distributed.device_mesh.DeviceMesh
        1-D mesh over all ranks (the default process group).
    """

    name = "fsdp"
    data_parallel = True
    wraps_model = False  # fully_shard changes the module in place: calling it directly is right
    shards_first = True  # split on the meta device, then this rank materialises its part

    def __init__(self, module, plan, device, ns):
        import torch.distributed as dist

        super().__init__(module, plan, device, ns)
        self.mesh = make_mesh(device.type, (dist.get_world_size(),))
        self.units = shard(module, plan, self.mesh)
        self.model = module
        self._optimizer = None

    @classmethod
    def check(cls, plan, module, world_size: int) -> None:
        super().check(plan, module, world_size)
        if not _has_params(module):
            raise StrategyError(f"{type(module).__name__} has no parameters to shard")
        for unit in plan.fsdp_units or ():
            try:
                sub = module.get_submodule(unit)
            except AttributeError:
                raise StrategyError(f"--fsdp-units: {type(module).__name__} has no submodule {unit!r}; valid "
                                    f"names: {module_names(module)}") from None
            if not _has_params(sub):
                raise StrategyError(f"--fsdp-units: {unit} ({type(sub).__name__}) holds no parameters; an FSDP "
                                    f"unit shards parameters, so name a module that has some")
            if is_container(sub):
                inner = ",".join(default_units(sub, f"{unit}."))
                fix = (f"name its elements instead: --fsdp-units {inner}" if inner else
                       "leave it out: its parameters go to the unit around it")
                raise StrategyError(f"--fsdp-units: {unit} is an {type(sub).__name__}, which the forward never "
                                    f"calls (it uses its elements), so FSDP could not gather its parameters before "
                                    f"they are used; {fix}")
        unit_groups(module, plan.fsdp_units or default_units(module))

    def step(self, ns, code, ctx):
        try:
            return super().step(ns, code, ctx)
        except RuntimeError as exc:
            error = used_outside(exc, self.units)
            if error is None:
                raise
            raise error from None

    def no_sync(self):
        """FSDP2's equivalent of ``no_sync``: no reduce-scatter; unsharded gradients accumulate until
        the next micro-step with gradient sync on."""

        @contextlib.contextmanager
        def unsynced():
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)

        return unsynced()

    def full_state(self, keys=None):
        """Gather the full (unsharded) state dict on rank 0, on CPU; a collective (``keys``: only these entries)."""
        return gathered_state(self.module, keys)

    def compile(self) -> None:
        """Compile the forward of each innermost FSDP unit, in place (the root's when it is the only unit).

        As torchtitan does (blocks compiled, each its own FSDP unit): a unit's all-gather and reshard are
        FSDP2's module hooks, which dynamo does not trace (a graph break); a forward that calls another unit
        breaks at that call (inside ``nn.Sequential``'s loop, dynamo then gives up on the whole frame:
        measured, 0 graphs). The code between units (the root's own, an activation between two units) runs
        eagerly. What compiled is reported per cell (:mod:`distnb.engine.strategies.compiling`).
        """
        units = [self.module.get_submodule(name) for group in self.units for name in group.split("+")]
        self._compiled = compiling.innermost(units) or [self.module]
        for unit in self._compiled:
            compiling.compile_in_place(unit)

    def holdings(self) -> dict:
        """Bytes of this rank's parameter shards and of its optimizer state (0 before a step)."""
        return dict(param_bytes=sum(tensor_bytes(p) for p in self.module.parameters()),
                    optimizer_state_bytes=optimizer_state_bytes(self._optimizer))

    def param_device(self):
        """``--offload cpu``: host memory, where FSDP2's ``CPUOffloadPolicy`` requires the shards ("FSDP parameters
        should be materialized on CPU when enabling CPU offloading"); a GPU rank never holds them all. Else the
        rank's device."""
        import torch

        return torch.device("cpu") if getattr(self.plan, "offload", None) == "cpu" else self.device

    def close(self) -> None:
        release_group(self.mesh, self.module)
        for unit in getattr(self, "_compiled", ()):
            compiling.uncompile(unit)
        self.model = None
        self.mesh = None
        self._optimizer = None


def shard(module, plan, mesh) -> list[str]:
    """``fully_shard`` the ``plan``'s units of ``module`` over ``mesh``, innermost first, then the root.

    Units are ``plan.fsdp_units`` or :func:`default_units`; with ``--precision bf16/fp16`` or
    ``--param-dtype bf16`` the forward computes in that dtype and gradients are reduced in fp32
    (``MixedPrecisionPolicy``); ``--offload cpu`` keeps the shards in host memory (``CPUOffloadPolicy``):
    :func:`~distnb.engine.strategies.levers.fsdp_policies`.
    ``mesh``: the 1-D mesh FSDP shards over (all ranks for fsdp, the ``dp`` dimension of a
    2-D mesh for fsdp+tensor). A collective: every rank of the group calls it.

    Returns
    -------
    list of str
        The units sharded, innermost first (the root, ``""``, not listed); a group of units
        sharded together (tied weights, :func:`unit_groups`) as their names joined by ``+``.
    """
    from torch.distributed.fsdp import fully_shard

    groups = unit_groups(module, plan.fsdp_units or default_units(module))
    kwargs = levers.fsdp_policies(plan, mesh.device_type)  # --precision, --param-dtype, --offload
    levers.checkpoint_blocks(module, plan, [unit for group in groups for unit in group])  # before fully_shard
    for group in groups:
        subs = [module.get_submodule(unit) for unit in group]
        fully_shard(subs[0] if len(subs) == 1 else subs, mesh=mesh, **kwargs)
    fully_shard(module, mesh=mesh, **kwargs)
    return ["+".join(group) for group in groups]


def _inside(inner: str, outer: str) -> bool:
    """Whether submodule name ``inner`` is strictly inside ``outer`` (``""``: the root holds all)."""
    return inner != outer and (outer == "" or inner.startswith(outer + "."))


def _components(module, units: list[str]) -> list[list[str]]:
    """``units`` and the root (``""``) partitioned so that units sharing a parameter are in one part.

    A parameter belongs to the innermost unit around the module that uses it (the root if
    none); every use counts (``named_modules(remove_duplicate=False)``), so a tied weight, or
    a module reachable under two names, links the units of all its uses (union-find).
    """
    parent = {u: u for u in [*units, ""]}

    def find(u):
        while parent[u] != u:
            u = parent[u]
        return u

    first = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        owner = max((u for u in units if mod_name == u or _inside(mod_name, u)), key=len, default="")
        for p in mod.parameters(recurse=False):
            parent[find(first.setdefault(id(p), owner))] = find(owner)
    parts: dict[str, list[str]] = {}
    for u in [*units, ""]:
        parts.setdefault(find(u), []).append(u)
    return list(parts.values())


def unit_groups(module, units) -> list[list[str]]:
    """The FSDP units of ``module`` as groups sharded together, in an order ``fully_shard`` accepts.

    FSDP2 lets one parameter belong to one group only, so units sharing a parameter (tied
    weights) become one group, ``fully_shard([a, b])``; a unit sharing one with the root, or
    with a unit around it, is dropped (the outer unit takes its parameters), and grouping is
    repeated until no part changes. Groups are ordered so that no group comes after one
    whose modules contain it (innermost first).

    Parameters
    ----------
    module : torch.nn.Module
        The model (not yet sharded).
    units : sequence of str
        Submodule names (``--fsdp-units`` or :func:`default_units`), each holding parameters.

    Returns
    -------
    list of list of str
        Groups of unit names, innermost first; the root is not listed (always sharded last).

    Raises
    ------
    StrategyError
        Tied parameters that make two groups each contain a unit of the other (no order can
        shard them); the message names the groups and asks for other ``--fsdp-units``.
    """
    units = list(dict.fromkeys(units))
    while True:
        parts = _components(module, units)
        drop = {u for part in parts for u in part
                if u and ("" in part or any(_inside(u, v) for v in part))}
        if not drop:
            break
        units = [u for u in units if u not in drop]
    groups = [part for part in parts if "" not in part]
    ordered = []
    while groups:
        ready = [g for g in groups if not any(_inside(u, v) for h in groups if h is not g for u in h for v in g)]
        if not ready:
            names = " and ".join("+".join(g) for g in groups)
            raise StrategyError(f"--fsdp-units: tied (shared) parameters make {names} FSDP groups (sharded "
                                f"together), and each group contains a unit of another, so none can be sharded "
                                f"first; choose --fsdp-units so that no unit sharing a parameter is nested in a "
                                f"unit of another group (fewer, outer units always work)")
        ordered += ready
        groups = [g for g in groups if all(g is not r for r in ready)]
    return ordered


def make_mesh(device_type: str, shape: tuple, names: tuple | None = None):
    """A device mesh of ``shape`` over all ranks of the default process group (remembered for teardown).

    ``shape``: ``(world_size,)`` for a 1-D mesh, ``(dp, tp)`` with ``names`` ``("dp", "tp")``
    for a 2-D one (``init_device_mesh``: the last dimension varies fastest, so ranks
    ``d * tp .. d * tp + tp - 1`` share ``dp`` coordinate ``d``).

    A mesh of two or more dimensions makes a new process group per dimension on every rank
    (a collective), so it is made once per process group and shape and then reused: a model
    sent again gets the same mesh, and no groups pile up. Reusing it is also what keeps it
    working: DTensor caches sharding decisions by mesh *equality*, so a new but equal mesh
    can meet the groups of the old one, which must therefore stay alive until the whole
    group is torn down (:func:`_release_meshes`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(shape)
    key = (device_type, shape, names, runtime.STATE.generation)
    if len(shape) > 1 and key in _GRIDS:
        return _GRIDS[key]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    for old in [k for k, ref in _MESHES.items() if ref() is None]:
        del _MESHES[old]
    _MESHES[id(mesh)] = weakref.ref(mesh)
    if len(shape) > 1:
        _GRIDS[key] = mesh
    return mesh


def _release_meshes(ns) -> None:
    """Release hook (the group is about to be destroyed): every mesh made here drops its group.

    DTensor's sharding decisions are forgotten too (:func:`forget_sharding_decisions`).
    """
    for ref in list(_MESHES.values()):
        release_group(ref(), None)
    _MESHES.clear()
    _GRIDS.clear()
    forget_sharding_decisions()


def forget_sharding_decisions() -> None:
    """Empty DTensor's sharding-propagation caches (C++ and Python), so no decision outlives its process group.

    DTensor caches each op's output layout keyed by the input layouts, and a layout's device
    mesh compares by its ranks and shape, not by this process's rank in it; the cached output
    layout holds the mesh object of the op's first call. After the group is formed again with
    this process at another rank (``--on-failure shrink`` renumbers the survivors), a new mesh
    over the same ranks equals the old one, so an op such as Adam's ``zeros_like`` of a
    sharded parameter returned a DTensor on the *old* mesh, whose coordinate is this process's
    old rank: its local chunk claimed another rank's offset, DCP's save de-duplicated the two
    and failed its plan check (``invalid fill``: chunks volume 120 of 192). Found by
    ``tests/magics/test_scale.py`` (shrink renumbering 3 ranks to 2, then 3 again, then a
    checkpointing fsdp cell). Private torch 2.13 entry points, hence best effort.
    """

    if "torch.distributed.tensor" not in sys.modules:  # no DTensor op ran here: nothing cached
        return
    import torch
    from torch.distributed.tensor import DTensor

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    try:
        if clear is not None:
            clear()
        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding.cache_clear()
        cached = getattr(type(propagator), "_propagate_tensor_meta_cached", None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    except Exception:  # a torch without these caches: nothing to forget
        pass


runtime.RELEASE_HOOKS.append(_release_meshes)


def release_group(mesh, module, meshes: bool = True) -> None:
    """Drop what a device mesh and FSDP2 state keep of the process group (best effort).

    Called by ``close()`` just before the group is destroyed (a failed rank, a re-formed
    group). DTensor keeps every mesh alive in its caches (sharding propagation, collective
    topology), a mesh keeps its process groups, and FSDP2 keeps them in each unit's mesh
    info. While anything references the group, ``destroy_process_group`` does not close
    gloo's connections, and a peer blocked in a collective waits for the whole timeout
    instead of failing at once. These are private attributes of torch 2.13 (hence best
    effort): after this, ``module`` can run no collective; the kernel sends the model again.

    ``meshes=False``: drop only ``module``'s own references, not those of the meshes its FSDP
    state names (a reused mesh, see :func:`make_mesh`, keeps them until teardown).
    """
    try:
        found = [mesh] if mesh is not None else []
        if module is not None:
            from torch.distributed.fsdp import FSDPModule

            for sub in module.modules():
                if not isinstance(sub, FSDPModule):
                    continue
                group = getattr(sub._get_fsdp_state(), "_fsdp_param_group", None)
                for info in (getattr(group, "mesh_info", None), getattr(group, "post_forward_mesh_info", None)):
                    if info is None:
                        continue
                    if meshes:
                        found.append(getattr(info, "mesh", None))
                    for attr in ("shard_process_group", "reduce_scatter_process_group", "replicate_process_group"):
                        if getattr(info, attr, None) is not None:
                            setattr(info, attr, None)
        for m in found:
            registry = getattr(m, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
    except Exception:  # never let teardown fail; the peers then wait for the collective timeout
        pass


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` stored on this rank (local shards of DTensors)."""
    import torch

    if optimizer is None:
        return 0
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += tensor_bytes(value)
    return total


STRATEGY = FSDP
