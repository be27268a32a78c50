"""Where a pipeline cuts the model into stages, checked before anything runs (kernel and ranks).

:func:`split_points` names the submodules that begin stages 1, 2, ...: by default the
model's top-level blocks (:func:`default_blocks`) balanced by parameter count into
contiguous groups (:func:`balance`), else the ``--split`` names, validated (count, names,
order, no empty first stage). :func:`module_stages` and :func:`tensor_owners` give the stage
of every submodule and every tensor (tied weights across stages are refused);
:func:`num_microbatches` how many microbatches a batch of a given size uses. The strategy
itself is :mod:`distnb.engine.strategies.pipeline`.
"""

from __future__ import annotations

import bisect
import itertools

from torch import nn

from distnb.engine.strategies import StrategyError, is_container


def is_plain_sequential(module) -> bool:
    """An ``nn.Sequential`` that keeps Sequential's forward: cut at its children, it needs no trace."""
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _num_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def default_blocks(module) -> list:
    """The blocks a default split groups: ``[(name, submodule)]`` in registration order.

    The top-level children, or, for a wrapper with a single child (``self.net =
    nn.Sequential(...)``), that child's children (repeatedly), named as in ``named_modules()``.
    Tensors the wrapper holds itself go to the stage the trace puts them in. A container
    (``nn.ModuleList``, ``nn.ModuleDict``: never called itself, so no stage can begin at it)
    stands for its elements (``blocks.0``, ``blocks.1``, ...), repeatedly.
    """
    prefix, base = "", module
    while True:
        kids = _expand(list(base.named_children()))
        if len(kids) == 1 and any(True for _ in kids[0][1].children()):
            prefix, base = prefix + kids[0][0] + ".", kids[0][1]
            continue
        return [(prefix + name, child) for name, child in kids]


def _expand(kids) -> list:
    """``[(name, child)]`` with each container child replaced by its elements (dotted names)."""
    out = []
    for name, child in kids:
        if is_container(child):
            out += _expand([(f"{name}.{n}", c) for n, c in child.named_children()])
        else:
            out.append((name, child))
    return out


def balance(sizes, num_groups: int) -> list[int]:
    """Start indices of ``num_groups`` contiguous non-empty groups of ``sizes``.

    The largest group sum is as small as possible (ties: later cuts, so parameter-free
    blocks such as activations stay with the block before them).
    """
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(num_groups + 1)]
    best[0][0] = 0
    for g in range(1, num_groups + 1):
        for i in range(g, n + 1):
            for s in range(g - 1, i):
                cost = max(best[g - 1][s], prefix[i] - prefix[s])
                if cost <= best[g][i]:
                    best[g][i], cut[g][i] = cost, s
    starts, i = [], n
    for g in range(num_groups, 0, -1):
        i = cut[g][i]
        starts.append(i)
    return starts[::-1]


def _some_names(module, limit: int = 12) -> str:
    names = [n for n, _ in module.named_modules() if n]
    text = ", ".join(names[:limit])
    return (text + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")) if names else "(none)"


def split_points(module, world_size: int, split=None) -> list[str]:
    """The ``world_size - 1`` submodule names that begin stages 1, 2, ...

    Raises
    ------
    StrategyError
        Too few blocks for the stages, or a ``split`` that does not fit (count, names, order).
    """
    if split is None:
        blocks = default_blocks(module)
        if len(blocks) < world_size:
            what = ", ".join(n for n, _ in blocks) or "none"
            raise StrategyError(
                f"{world_size} stages on {world_size} ranks (one stage per rank) need at least {world_size} blocks to "
                f"split, but {type(module).__name__} has {len(blocks)} ({what}); give --split NAME,... with "
                f"{world_size - 1} submodule name{'s' if world_size != 2 else ''} that "
                f"begin{'' if world_size != 2 else 's'} a stage (from: {_some_names(module)}), or use fewer ranks")
        starts = balance([_num_params(child) for _, child in blocks], world_size)
        return [blocks[i][0] for i in starts[1:]]
    split = list(split)
    if len(split) != world_size - 1:
        raise StrategyError(
            f"--split gives {len(split)} name{'s' if len(split) != 1 else ''}, i.e. {len(split) + 1} stages, on "
            f"{world_size} rank{'s' if world_size != 1 else ''}; the pipeline runs one stage per rank: give "
            f"{world_size - 1} name{'s' if world_size != 2 else ''} (each begins a stage)")
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    missing = [n for n in split if n not in order or n == ""]
    if missing:
        raise StrategyError(f"--split: {type(module).__name__} has no submodule named {missing[0]!r}; its submodules "
                            f"are: {_some_names(module)}")
    containers = [n for n in split if is_container(module.get_submodule(n))]
    if containers:
        name = containers[0]
        sub = module.get_submodule(name)
        first = next((f"{name}.{n}" for n, _ in sub.named_children()), None)
        raise StrategyError(f"--split: {name} is an {type(sub).__name__}, which the forward never calls (it calls "
                            f"its elements), so no stage can begin at it; name an element"
                            + (f", e.g. --split {first}" if first else ""))
    if len(set(split)) != len(split):
        raise StrategyError(f"--split names a submodule twice ({', '.join(split)})")
    for a in split:
        for b in split:
            if b.startswith(a + "."):
                raise StrategyError(f"--split: {b!r} is inside {a!r}; give submodules that follow one another")
    if [order[n] for n in split] != sorted(order[n] for n in split):
        raise StrategyError(f"--split names must be in model order (as in named_modules()): "
                            f"{', '.join(sorted(split, key=order.get))}")
    owners = module_stages(module, split)
    if not any(stage == 0 for stage in owners.values()):
        raise StrategyError(f"--split {split[0]} leaves stage 0 empty: the first name must begin the second stage")
    return split


def module_stages(module, points) -> dict:
    """Stage of every submodule name (``None``: an ancestor of a split point, spanning stages)."""
    names = [n for n, _ in module.named_modules(remove_duplicate=False)]
    index = {n: i for i, n in enumerate(names)}
    starts = [index[p] for p in points]
    ancestors = {""}
    for p in points:
        parts = p.split(".")
        ancestors.update(".".join(parts[:k]) for k in range(1, len(parts)))
    return {n: None if n in ancestors else bisect.bisect_right(starts, index[n]) for n in names}


def tensor_owners(module, points) -> dict:
    """Stage of every parameter and buffer name (``None``: held directly by a module spanning stages).

    Raises
    ------
    StrategyError
        A tensor shared by modules of different stages (tied weights).
    """
    stages = module_stages(module, points)
    owners, by_id = {}, {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for pname, t in itertools.chain(mod.named_parameters(recurse=False), mod.named_buffers(recurse=False)):
            name = f"{mod_name}.{pname}" if mod_name else pname
            stage = stages[mod_name]
            owners[name] = stage
            first = by_id.setdefault(id(t), (name, stage))
            if first[1] != stage:
                raise StrategyError(f"{first[0]} and {name} are the same tensor in different stages (tied weights); "
                                    "pipeline stages cannot share parameters: choose --split so both are in one stage")
    return owners


def num_microbatches(batch_size: int, microbatches: int) -> int:
    """Microbatches for a batch of ``batch_size``: ``microbatches`` if it divides, else its largest divisor below."""
    return max(d for d in range(1, min(microbatches, batch_size) + 1) if batch_size % d == 0)
