"""What a traced pipeline stage holds, takes and returns (:mod:`distnb.engine.strategies.pipeline`).

- the ``meta`` copy that is traced (:func:`meta_copy`) and the tensors outside the model's
  ``state_dict`` that ``torch.export`` lifts into a stage (:func:`plain_tensors`);
- the model's output structure (:func:`output_structure`), put back on the last stage's
  flattened output (:func:`restructure`);
- the first stage's inputs: every argument of ``model(...)`` must be one (:func:`check_first_stage_inputs`).
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn


def plain_tensors(module) -> dict:
    """Name -> tensor of what a stage may hold that is not in ``module.state_dict()``.

    Non-persistent buffers (``register_buffer(..., persistent=False)``) and tensors set as plain
    attributes (``self.mask = torch.tril(...)``): ``torch.export`` lifts both into the traced stage
    as buffers under these names.

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    dict
        Dotted name (as in ``named_modules``) -> tensor.
    """
    found = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for key in getattr(mod, "_non_persistent_buffers_set", ()):
            if mod._buffers.get(key) is not None:
                found[prefix + key] = mod._buffers[key]
        for key, value in vars(mod).items():
            if isinstance(value, torch.Tensor):
                found[prefix + key] = value
    return found


def meta_copy(module):
    """A copy of ``module`` with every parameter, buffer and plain tensor attribute on ``meta`` (no data copied).

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    torch.nn.Module
        The copy; parameters stay ``nn.Parameter`` with their ``requires_grad``, shared tensors stay shared.
    """
    memo = {}
    for t in itertools.chain(module.parameters(), module.buffers(), plain_tensors(module).values()):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def output_structure(module, mb_args):
    """``(leaves, spec)``: the pytree of what ``module`` returns for ``mb_args`` (a meta forward), or None.

    None when the output is one tensor (the last stage gives it as it is) or the meta forward fails.
    A traced last stage returns the output's tensors flattened (a dict comes out as a tuple, a dict
    of one tensor as that tensor): :func:`restructure` puts them back into this structure.

    Parameters
    ----------
    module : torch.nn.Module
        The whole model (its tensors may be meta already).
    mb_args : tuple of torch.Tensor
        Meta tensors of one microbatch's arguments.

    Returns
    -------
    tuple or None
        ``(leaves, spec)`` of ``torch.utils._pytree.tree_flatten`` of the output.
    """
    from torch.utils import _pytree

    try:
        with torch.no_grad():
            out = meta_copy(module)(*mb_args)
    except Exception:
        return None
    leaves, spec = _pytree.tree_flatten(out)
    return None if spec.is_leaf() else (leaves, spec)


def restructure(output, structure, where: str):
    """The last stage's ``output`` (a tensor or a tuple of them) as the model returns it.

    Parameters
    ----------
    output : torch.Tensor or tuple of torch.Tensor
        What the last stage returned for one microbatch.
    structure : tuple or None
        :func:`output_structure`'s result (None: ``output`` as it is).
    where : str
        The stage and rank, for the error.

    Raises
    ------
    RuntimeError
        When the stage computes other tensors than the output holds (one returned from an earlier stage).
    """
    if structure is None:
        return output
    from torch.utils import _pytree

    leaves, spec = structure
    got = list(output) if isinstance(output, (tuple, list)) else [output]
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if len(got) != len(slots) or any(not isinstance(t, torch.Tensor) or t.shape != leaves[i].shape
                                     for i, t in zip(slots, got)):
        shapes = ", ".join(str(tuple(leaves[i].shape)) for i in slots)
        kind = type(_pytree.tree_unflatten(leaves, spec)).__name__
        raise RuntimeError(f"{where}: the model returns {len(slots)} tensors (a {kind} of shapes {shapes} per "
                           f"microbatch) but the last stage computes {len(got)}: a tensor the "
                           "forward returns from an earlier stage does not reach the last one; return only what the "
                           "last stage computes, or move the split (--split)")
    filled = list(leaves)
    for i, t in zip(slots, got):
        filled[i] = t
    return _pytree.tree_unflatten(filled, spec)


def check_first_stage_inputs(graph, first_split: str) -> None:
    """Raise when an argument of ``model(...)`` is not an input of the first stage (the split graph's first call).

    torch's pipeline feeds the arguments to the first stage only: one used from a later stage on
    (``forward(x, labels)`` computing its loss at the end) made the first stage's forward fail with
    ``takes 2 positional arguments but 3 were given``.

    Parameters
    ----------
    graph : torch.fx.Graph
        The split graph of ``torch.distributed.pipelining.pipeline`` (``pipe.split_gm.graph``).
    first_split : str
        The module the second stage starts at, for the message.

    Raises
    ------
    TypeError
        Naming each argument the first stage does not take, and the fix.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first = next((n for n in graph.nodes if n.op == "call_module"), None)
    late = [f"{i} ({p.name})" for i, p in enumerate(placeholders) if first is not None and p not in first.args]
    if late:
        which = f"argument {late[0]}" if len(late) == 1 else f"arguments {', '.join(late)}"
        raise TypeError(f"{which} of model(...) is not used by the first stage (the layers before {first_split!r}): "
                        "the pipeline feeds model(...)'s arguments to the first stage only, so a later stage cannot "
                        "get it. Use it in the body instead (e.g. loss = F.cross_entropy(model(x), y) rather than "
                        "model(x, y) computing the loss), or move --split after the layer that uses it")
