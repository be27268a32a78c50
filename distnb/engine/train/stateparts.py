"""Rank side of weights back in parts: the kernel asks for a model's state one bounded part at a time.

A training cell's reply no longer carries the trained state. The kernel then asks every rank for
one part of it after the other (:func:`pull_part`, driven by :func:`distnb.transfer.weights_back.stream_into`):
a list of ``state_dict`` keys of at most :data:`distnb.transfer.weights_back.PART_BYTES` together (or one larger
tensor alone). Every rank takes part in each part's collectives (a DTensor's all-gather, a pipeline
stage's ``send``), and rank 0 writes the part into its outbox (:mod:`distnb.engine.transport.stateout`), which the
kernel reads into its own tensors before it asks for the next. So rank 0 holds its share of the model
plus one part, never a model-sized outbox: that outbox made rank 0's peak 1.2-1.7x torchrun's in
issue 34's benchmark (``benchmarks/memory.py``).

Idea: torch.distributed.checkpoint's ``_gather_state_dict`` and FSDP's ``StateDictType`` with
``offload_to_cpu``/``rank0_only`` gather tensor by tensor; this bounds what rank 0 keeps of them too.
"""

from __future__ import annotations

import torch

from distnb.engine.process import runtime
from distnb.engine.train import loop
from distnb.engine.transport import stateout


def _check_keys(name: str, state: dict, all_keys) -> None:
    """Raise (on every rank alike, before any collective) when the ranks' keys are not the kernel's."""
    missing, unexpected = sorted(set(all_keys) - set(state)), sorted(set(state) - set(all_keys))
    if missing or unexpected:
        raise RuntimeError(f"the weights of {name} on the ranks do not match the notebook's model (missing on the "
                           f"ranks: {', '.join(missing[:5]) or 'none'}; not in the notebook's model: "
                           f"{', '.join(unexpected[:5]) or 'none'}): the cell changed the model's structure; "
                           f"pull single tensors with %dist pull {name}.KEY, or save with %dist save DIR")


def pull_part(name: str, keys, reserve: int = 0, all_keys=None):
    """The part ``keys`` of model ``name``'s state on rank 0, as :func:`distnb.engine.transport.stateout.write_state` gives it.

    Parameters
    ----------
    name : str
        The model's name.
    keys : list of str
        ``state_dict`` keys of this part, the same list on every rank.
    reserve : int
        Bytes: the size of the outbox segment to take (the largest part of this pull), so that every part
        reuses one segment of the rank's pool.
    all_keys : list of str or None
        With the first part: every key of the notebook's model, checked against the ranks' first.

    Returns
    -------
    tuple or None
        ``(keys, descs, sizes, bytes)`` on rank 0, None on the others. A strategy that does not stream
        (``ps``: its exchange is drained once) gives its whole state at the first part.

    Raises
    ------
    RuntimeError
        The ranks' keys are not the notebook model's (``all_keys``), or a sharded model's group was re-formed.
    """
    run = loop.RUNS[name]
    if all_keys is not None:
        _check_keys(name, run.module.state_dict(keep_vars=True), all_keys)
    stateout._FLOOR[0] = int(reserve)
    try:
        strategy = run.strategy
        if strategy is not None and not strategy.streams_state:
            return strategy.full_state() if all_keys is not None else None
        # a replicated model (ddp) whose group is gone (a peer died): rank 0's replica alone holds the whole state
        if strategy is not None and (torch.distributed.is_initialized() or not strategy.replicated_grads):
            return strategy.full_state(keys)
        if runtime.STATE.rank != 0:
            return None
        if any(hasattr(p, "to_local") for p in run.module.parameters()):
            raise RuntimeError(f"{name} is sharded over a process group that was re-formed; its weights are "
                               "only in the kernel now")
        return stateout.flatten_state(stateout.select(run.module.state_dict(), keys))
    finally:
        stateout._FLOOR[0] = 0
