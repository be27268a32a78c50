"""Replicas checked for silent drift: the copies of a parameter that ranks must hold equal, compared by digest.

Under ddp every rank holds the whole model and every optimizer step must leave the copies equal;
tensor parallelism keeps the parameters it does not shard (and those it places ``Replicate``) on
every rank of its group; FSDP2 with a replicate mesh dimension (HSDP) keeps one copy per replica
group. Nothing in torch checks that these copies stay equal: a body that writes a parameter on one
rank, a non-deterministic kernel or a ``torch.compile`` difference between ranks makes them drift
apart without a word, and the run goes on training several different models. None of Accelerate,
Lightning or torchtitan checks it either.

The check (``--check-replicas``, :func:`check`): each rank digests each replicated tensor with
``torch.hash_tensor`` (an xor of its elements' 64-bit patterns: any changed element changes it, at
about 0.4 ms per MiB on a CPU core here and no copy), the digests' maximum and minimum over the group
that must agree are taken in one all-reduce (two int64 per tensor), and only when they differ are
the differing tensors (up to four) looked at closely: which ranks hold which copy (the majority's
copy is the reference) and the largest element-wise difference from it; the tensor that differs
most is named first (the likely cause: a tensor written on one rank makes others drift after it). Every rank then raises the same
error, so the cell fails on all of them at once and the group stays usable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distnb.engine.process import runtime

#: ``--check-replicas`` choices: never, at the start of each cell and each epoch's end, also after each optimizer step.
MODES = ("off", "epoch", "step")


def _digest(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 that changes when any element of ``t`` does (bit patterns, not values: -0.0 != 0.0, NaN == NaN)."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if hasattr(torch, "hash_tensor"):  # torch >= 2.9
        return torch.hash_tensor(t).view(torch.int64)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    flat = t.contiguous().view(-1).view(bits)
    weights = torch.arange(1, 65, device=t.device, dtype=torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for chunk in flat.split(1 << 22):  # int64 wraps: equal tensors give equal sums, a changed element another
        total += (chunk.to(torch.int64) * weights.repeat(-(-chunk.numel() // 64))[:chunk.numel()]).sum()
    return total


def replicated(strategy) -> list:
    """``(group, [(name, local tensor), ...])`` for every set of copies that ``strategy``'s ranks must hold equal.

    DTensor parameters: one entry per ``Replicate`` dimension of their mesh (its process group).
    Plain parameters: the world, where the strategy keeps them whole on every rank
    (:attr:`~distnb.engine.strategies.Strategy.replicas`); their buffers too, except under ddp, which
    broadcasts the buffers from rank 0 before each forward by design (a forward may then update them
    from its own rank's batch: a BatchNorm's running statistics, an observer's range).
    """
    from torch.distributed.tensor import DTensor, Replicate  # torch's DTensor: imported once a group exists

    module = strategy.module
    by_group, plain = {}, []
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            for dim, placement in enumerate(p.placements):
                if isinstance(placement, Replicate) and p.device_mesh.size(dim) > 1:
                    group = p.device_mesh.get_group(dim)
                    by_group.setdefault(group, []).append((name, p.to_local()))
        elif getattr(strategy, "replicas", False):
            plain.append((name, p))
    if getattr(strategy, "replicas", False) and not getattr(strategy, "replicated_grads", False):
        plain += [(name, b) for name, b in module.named_buffers() if b is not None and not isinstance(b, DTensor)]
    out = [(group, tensors) for group, tensors in by_group.items()]
    if plain and dist.get_world_size() > 1:
        out.insert(0, (None, plain))
    return out


def check(strategy, when: str) -> None:
    """Raise on every rank if the copies that must be equal differ (a collective: every rank calls it).

    Parameters
    ----------
    strategy : distnb.engine.strategies.Strategy
        The model's strategy on this rank.
    when : str
        Where in the run, for the message (``"at the end of epoch 3"``).

    Raises
    ------
    RuntimeError
        Naming the first tensor that differs (in module order), the ranks whose copy differs
        from the majority's and the largest element-wise difference, and how many tensors differ.
    """
    if not dist.is_initialized():
        return
    for group, tensors in replicated(strategy):
        device = tensors[0][1].device
        digests = torch.stack([_digest(t) for _, t in tensors]).to(device)
        both = torch.cat([digests, ~digests])  # max(~d) = ~min(d): the min and the max in one all-reduce
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)  # group device: the parameters' (the rank's)
        high, low = both[:len(tensors)], ~both[len(tensors):]
        differ = (low != high).nonzero().flatten().tolist()
        if differ:  # the same list on every rank (from the all-reduce): the collectives below match
            looked = [_compare(group, *tensors[i], digests[i]) for i in differ[:LOOKED]]
            raise RuntimeError(_message(looked, len(differ), when))


#: Differing tensors looked at closely (each costs a broadcast of the tensor); the one that differs most is named first.
LOOKED = 4


def _compare(group, name, local, digest) -> tuple:
    """``(largest difference, name, who)`` of one differing tensor: which ranks' copies differ from the majority's,
    and by how much (collectives on ``group``: every rank calls it for the same tensors in the same order)."""
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    gathered = [torch.empty_like(digest.reshape(1)) for _ in members]
    dist.all_gather(gathered, digest.reshape(1), group=group)  # group device: the parameters' (the rank's)
    copies = {}
    for rank, d in zip(members, gathered):
        copies.setdefault(int(d.item()), []).append(rank)
    # the majority's copy is the reference; without a strict majority, the copy of the group's lowest rank (rank 0's
    # under ddp: the one whose weights come back to the notebook)
    reference = max(copies.values(), key=lambda ranks: (len(ranks), -min(ranks)))
    majority = 2 * len(reference) > len(members)
    source = torch.empty_like(local)
    source.copy_(local)
    dist.broadcast(source, src=min(reference), group=group)  # group device: the parameter's own
    diff = (local.detach().double() - source.double()).abs().max().reshape(1) if local.numel() else \
        torch.zeros(1, dtype=torch.float64, device=local.device)
    diffs = [torch.empty_like(diff) for _ in members]
    dist.all_gather(diffs, diff, group=group)  # group device: the parameter's own
    largest = max(float(d.item()) for d in diffs)
    odd = sorted(r for ranks in copies.values() if ranks is not reference for r in ranks)
    who = (f"rank {odd[0]}'s copy differs" if len(odd) == 1 else
           f"ranks {', '.join(map(str, odd))} hold copies that differ") + \
        f" from rank {min(reference)}'s" + (f" (and {len(reference) - 1} more)" if len(reference) > 1 else "")
    return largest, name, who, not majority


def _message(looked: list, num_differ: int, when: str) -> str:
    """The error: the tensor that differs most first (the likely cause; the others often drifted after it), its
    ranks and largest difference within the first line's reach, then the other tensors and the advice."""
    looked = sorted(looked, key=lambda item: -item[0])
    largest, name, who, ambiguous = looked[0]
    others = [f"{n} ({d:.3g})" for d, n, _, _ in looked[1:]] + \
        ([f"{num_differ - len(looked)} more"] if num_differ > len(looked) else [])
    also = f"; also {', '.join(others)}" if others else ""
    either = " (no majority of equal copies: either may be the one that changed)" if ambiguous else ""
    return (f"rank {runtime.STATE.rank}: replicas drifted apart {when}: {name}: {who}, largest difference "
            f"{largest:.3g}{either}{also}. Copies that every "
            "rank of the group must hold equal are no longer equal, so the ranks now train different models. Usual "
            "causes: the body writes a parameter (or buffer) on some ranks only, a non-deterministic kernel, a "
            "torch.compile difference between ranks. Fix the cause, then %%distrain --reset sends the notebook's "
            "model again (--check-replicas off skips this check)")
