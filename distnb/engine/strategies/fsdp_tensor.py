"""2-D parallelism: tensor parallel within one dimension of a device mesh, FSDP2 across the other.

``--strategy fsdp+tensor --mesh DPxTP`` lays the ``world_size = DP * TP`` ranks out as a 2-D
``DeviceMesh`` with dimensions ``("dp", "tp")`` (``init_device_mesh``; the last dimension varies
fastest, so ranks ``d*TP .. d*TP+TP-1`` form tensor-parallel group ``d``), then composes the two
strategies the way torchtitan does (``torchtitan/models/llama3/infra/parallelize.py``:
``parallelize_module`` on the ``tp`` sub-mesh first, ``fully_shard`` on the ``dp`` sub-mesh
after), which is the 2-D recipe of PyTorch's "Large Scale Transformer model training with Tensor
Parallel" tutorial and of Megatron-LM (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021): the tensor-parallel all-reduces, one per
forward and one per backward for each column/row-wise pair, stay within a group of consecutive
ranks (one host's GPUs on a real cluster), and only FSDP's all-gathers and reduce-scatters cross
the groups.

1. **Tensor parallel** (:mod:`.tensor`): ``--tp-plan NAME`` or the default plan (consecutive
   ``nn.Linear`` pairs split column- then row-wise) over the ``tp`` sub-mesh: each rank of a
   group holds ``1/TP`` of each split layer and computes that slice of its activations.
2. **FSDP2** (:mod:`.fsdp`): ``--fsdp-units`` (default: each child with parameters, then the
   root) sharded over the ``dp`` sub-mesh: every parameter, split or not, is further cut on
   dim 0 into ``DP`` shards (a split layer's weight becomes a DTensor on the 2-D mesh with
   placements ``(_StridedShard(0), Shard(0))`` or ``(Shard(0), Shard(1))``; a layer the plan
   leaves whole is a DTensor on the ``dp`` sub-mesh). Each rank stores ``1 / world_size`` of a
   split layer and ``1 / DP`` of a whole one, and the same of their gradients and optimizer
   state.

Data: the ``TP`` ranks of one group train on the same batches (their inputs must agree for the
split layers' partial results to add up); the data set is cut into ``DP`` shards, shard ``d`` for
group ``d`` (:func:`distnb.engine.transport.shard.shard_index`). FSDP averages the gradients over the DP
groups, so one optimizer step equals one process training on the union of the DP groups'
batches (``DP * --batch-size`` samples).

``--mesh 1xN`` is pure tensor parallel (FSDP over a mesh of one), ``--mesh Nx1`` pure FSDP
(every "split" is over one rank). The weights come back to the notebook whole
(:func:`~distnb.engine.strategies.gathered_state`) and ``%dist save``/``load`` checkpoint each
rank's shards with torch.distributed.checkpoint, as for fsdp and tensor.

Errors (kernel side, before anything is sent): a ``--mesh`` that is not ``DPxTP`` with
``DP * TP = world_size`` (a :class:`~distnb.core.errors.PlanError` naming the world size and the
shapes that fit), a split dimension not divisible by ``TP`` (naming the layer and the mesh),
and the errors of ``--fsdp-units`` and ``--tp-plan`` (see :mod:`.fsdp`, :mod:`.tensor`).
"""

from __future__ import annotations

import logging

from distnb.core.plan import mesh_shape
from distnb.engine.strategies import Strategy, compiling, gathered_state, tensor_bytes
from distnb.engine.strategies.fsdp import (
    FSDP,
    default_units,
    make_mesh,
    optimizer_state_bytes,
    release_group,
    shard,
    unit_groups,
)
from distnb.engine.strategies.fsdp_tp_views import copy_view_outputs
from distnb.engine.strategies.tensor import (
    DefaultPlanHint,
    check_default,
    check_plan,
    default_pairs,
    describe,
    plan_label,
    resolve_plan,
)
from distnb.engine.strategies.tensor_check import VerifiedPlan

#: The mesh's dimension names, outer (FSDP, data parallel) first, as torchtitan names them.
DIMS = ("dp", "tp")
#: How the default plan's message says what becomes of a layer it does not split.
WHOLE = "whole within each tensor-parallel group (FSDP shards it across them)"


def _degree(plan, tp: int) -> str:
    """How a split-size error names the tensor-parallel size and its fix."""
    return (f"the tensor-parallel size {tp} (--mesh {plan.mesh or 'default'}); resize the layer, pick a --mesh "
            "whose TP divides it")


class FsdpTensor(VerifiedPlan, DefaultPlanHint, FSDP):
    """FSDP2 over the mesh's ``dp`` dimension, tensor parallel over its ``tp`` dimension.

    Attributes
    ----------
    mesh : torch.distributed.device_mesh.DeviceMesh
        The 2-D mesh ``(dp, tp)`` over all ranks.
    shape : tuple of int
        ``(DP, TP)``.
    tp_plan : dict
        ``{submodule name: ParallelStyle}`` applied over ``mesh["tp"]``.
    replicated : list of str
        Default plan: ``nn.Linear`` layers left whole within a tensor-parallel group.
    units : list of str
        FSDP units sharded over ``mesh["dp"]`` (the root too), innermost first.
    """

    name = "fsdp+tensor"
    data_parallel = True
    wraps_model = False  # parallelize_module and fully_shard change the module in place

    def __init__(self, module, plan, device, ns):
        import torch.distributed as dist
        from torch.distributed.tensor.parallel import parallelize_module

        Strategy.__init__(self, module, plan, device, ns)  # not FSDP's: that one shards over a 1-D mesh
        self.mesh = None
        self.shape = mesh_shape(plan.mesh, dist.get_world_size())
        self.tp_plan, self.replicated = resolve_plan(module, plan, ns)
        check_plan(self.tp_plan, module, self.shape[1], plan_label(plan), _degree(plan, self.shape[1]))
        self.mesh = make_mesh(device.type, self.shape, DIMS)
        self.arm(module, plan_label(plan), describe(self.tp_plan), default_pairs(module)[0] if plan.tp_plan is None
                 else ())  # the whole model, to verify the plan on the first forward (tensor_check.py)
        parallelize_module(module, self.mesh["tp"], self.tp_plan)  # tensor parallel first, then FSDP
        self._view_hooks = copy_view_outputs(module, self.tp_plan,  # FSDP2 is given no view (fsdp_tp_views.py)
                                             unit_groups(module, plan.fsdp_units or default_units(module)))
        self.units = shard(module, plan, self.mesh["dp"])
        self.watch()
        if dist.get_rank() == 0:
            groups = [list(range(d * self.shape[1], (d + 1) * self.shape[1])) for d in range(self.shape[0])]
            split = (describe(self.tp_plan, self.replicated, WHOLE) if plan.tp_plan is None
                     else f"--tp-plan {plan.tp_plan}")
            print(f"distnb: mesh {self.shape[0]}x{self.shape[1]} (dp x tp): tensor-parallel groups "
                  f"{', '.join(map(str, groups))}, FSDP across them; {split}", flush=True)

    # kernel side ---------------------------------------------------------------------
    @classmethod
    def check(cls, plan, module, world_size: int) -> None:
        super().check(plan, module, world_size)  # --loop, --fsdp-units
        dp, tp = mesh_shape(plan.mesh, world_size)
        check_default(plan, module, tp, _degree(plan, tp))

    @classmethod
    def check_names(cls, plan, module, world_size: int, ns) -> None:
        """Kernel side: the ``--tp-plan`` dict in ``ns`` must split evenly over the mesh's TP ranks."""
        if plan.tp_plan is not None and plan.tp_plan in ns:
            tp = mesh_shape(plan.mesh, world_size)[1]
            check_plan(ns[plan.tp_plan], module, tp, f"--tp-plan {plan.tp_plan}", _degree(plan, tp))

    @classmethod
    def data_parallel_size(cls, plan, world_size: int) -> int:
        """DP shards: the ranks of one tensor-parallel group share one."""
        return mesh_shape(plan.mesh, world_size)[0]

    # rank side -----------------------------------------------------------------------
    def full_state(self, keys=None):
        """The whole state on rank 0 (CPU), every shard all-gathered over both dimensions; a collective
        (``keys``: only these entries).

        DTensor warns that a split layer's ``(_StridedShard, Shard)`` layout takes two
        all-gathers; that is the price of the composition, said here once, not on every cell.
        """

        log = logging.getLogger("torch.distributed.tensor._redistribute")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            return gathered_state(self.module, keys)
        finally:
            log.setLevel(level)

    def mesh_coordinates(self) -> dict | None:
        """This rank's place in the mesh: ``{"dp": d, "tp": t, "shape": "DPxTP"}`` (None once closed)."""
        if self.mesh is None:
            return None
        d, t = self.mesh.get_coordinate()
        return dict(dp=d, tp=t, shape=f"{self.shape[0]}x{self.shape[1]}")

    def holdings(self) -> dict:
        """Bytes of this rank's shards and its mesh coordinates.

        ``param_bytes`` = ``split_param_bytes`` (layers the tensor plan splits, on the 2-D mesh)
        + ``whole_param_bytes`` (layers it leaves whole, FSDP-sharded over ``dp`` only);
        ``optimizer_state_bytes``; ``mesh``: ``"dp=D,tp=T"``.
        """
        split = whole = 0
        for p in self.module.parameters():
            if "tp" in (p.device_mesh.mesh_dim_names or ()):
                split += tensor_bytes(p)
            else:
                whole += tensor_bytes(p)
        where = self.mesh_coordinates() or {}
        return dict(param_bytes=split + whole, split_param_bytes=split, whole_param_bytes=whole,
                    optimizer_state_bytes=optimizer_state_bytes(self._optimizer),
                    mesh=f"dp={where.get('dp')},tp={where.get('tp')}")

    def close(self) -> None:
        """Drop the module's references to the process group; the mesh stays for the next build.

        The mesh is reused (see :func:`~distnb.engine.strategies.fsdp.make_mesh`) and let go
        with the process group at teardown, when the release hooks clear it.
        """
        self._disarm()
        release_group(None, self.module, meshes=False)
        for unit in getattr(self, "_compiled", ()):
            compiling.uncompile(unit)
        for handle in getattr(self, "_view_hooks", ()):
            handle.remove()
        self.model = None
        self.mesh = None
        self._optimizer = None


STRATEGY = FsdpTensor
