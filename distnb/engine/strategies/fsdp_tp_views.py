"""fsdp+tensor: a tensor-parallel layer returns a view, and FSDP2 warns about every unit that returns one.

The cause: tensor parallelism's output hook (``parallelize_module``, ``use_local_output=True``) hands on its
DTensor's local tensor through ``DTensor.to_local()``, which autograd returns as a view (``_ToTorchTensor``
ends in ``view_as``). FSDP2 registers the all-gather before a unit's backward as a hook on the unit's
outputs, and warns for a view output that an in-place op on it (``out += y``) would drop that hook, which
"can cause backward to fail or produce wrong gradients". Every unit that is, or returns, a split layer
(the default units of an MLP: its ``nn.Linear`` children) hits it on a correct model.

What is done: the cause is removed, not the warning hidden. A forward hook on each FSDP unit that holds a
tensor-parallel layer, placed after tensor parallelism's hooks and before FSDP2's (``fully_shard`` appends
its own), gives FSDP2 a copy of a view output that requires grad (``clone``: one activation copied per such
unit and forward; autograd saves a linear layer's input, not its output, so the view's memory is free once
copied). An in-place op on the copy keeps FSDP2's hook, so what the warning says cannot happen any more.
A view returned by a unit without split layers is the user's own code and is left alone: FSDP2's warning
about it is true and is shown as torch gives it.
"""

from __future__ import annotations

import fnmatch

import torch
from torch.utils._pytree import tree_map_only


def copy_view_outputs(module, tp_plan: dict, groups) -> list:
    """Put the copying hook on the root and each unit (``groups``: lists of unit names, as
    :func:`~distnb.engine.strategies.fsdp.unit_groups` gives them) that holds a layer of ``tp_plan``
    (``{submodule name or pattern: ParallelStyle}``). Call it after ``parallelize_module`` and before
    ``fully_shard``. Returns the hook handles."""
    split = {id(m) for name, m in module.named_modules() if any(fnmatch.fnmatchcase(name, key) for key in tp_plan)}
    units = [module.get_submodule(name) for group in groups for name in group] + [module]
    return [unit.register_forward_hook(_copy_views) for unit in units
            if any(id(m) in split for m in unit.modules())]


def _copy_views(module, args, output):
    return tree_map_only(torch.Tensor, _copy_if_view, output)


def _copy_if_view(t):
    return t.clone() if t._base is not None and t.requires_grad else t
