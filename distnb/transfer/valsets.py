"""``--val-data`` of every shape: what the kernel scatters, and what the ranks build themselves.

- Tensors, a tuple or dict of them, a ``TensorDataset``, a map-style ``Dataset`` or a list of
  samples: collated in the kernel and scattered like the training set (:func:`distnb.transfer.data.scatter`).
- An ``IterableDataset`` (or a Dataset without a length): read once in the kernel into its list of
  samples, then the same (a validation set is evaluated whole, so it must end).
- ``make(rank, world_size)``: a notebook function each rank calls, as ``--data`` takes it; the
  parts may differ in length (:mod:`distnb.engine.valparts`).

A set with fewer samples than ranks is fine for validation: a rank whose shard is empty still
runs every forward on a masked pad sample and joins the reductions with a count of zero
(:class:`distnb.engine.train.validation.Validator`), so the figures are those of the whole set and
nothing waits for it.
"""

from __future__ import annotations

from distnb.core import calls
from distnb.core.errors import PlanError
from distnb.core.tables import count

WHAT = ("a tensor, a tuple or dict of tensors, a TensorDataset, a torch Dataset or IterableDataset, or a function "
        "make(rank, world_size) that returns this rank's part")


def accepted(obj) -> bool:
    """Whether ``obj`` is a validation set distnb can take (beyond what ``--data`` takes as tensors)."""
    import torch

    return isinstance(obj, torch.utils.data.IterableDataset) or _is_maker(obj)


def _is_maker(obj) -> bool:
    import torch

    return callable(obj) and not isinstance(obj, (torch.utils.data.Dataset, torch.Tensor, type))


def kernel_form(name: str, obj):
    """``obj`` as the kernel scatters it: an IterableDataset read into its list of samples, else ``obj``.

    Raises
    ------
    PlanError
        When the stream yields nothing.
    """
    import torch

    if not isinstance(obj, torch.utils.data.IterableDataset):
        return obj
    from distnb.engine.train.datasets import SampleList  # imports torch: the kernel loads it at first use

    samples = list(obj)
    if not samples:
        raise PlanError(f"--val-data {name}: the IterableDataset yielded no sample")
    return SampleList(samples)


def is_made_on_ranks(obj) -> bool:
    """Whether the ranks build the set themselves (``make(rank, world_size)``)."""
    return _is_maker(obj)


def build_on_ranks(session, plan, fn, num_shards: int, quiet: bool) -> None:
    """Have every rank call ``fn(shard, num_shards)`` (``plan.val_data``) and hold its part for validation.

    Built again at each cell (``make`` may read files that changed); one line says the parts' sizes.

    Raises
    ------
    RankError
        A rank's ``make`` raised, returned something that is not a data set, or the parts differ in layout.
    """
    name = plan.val_data
    session.push(name)
    cluster = session.cluster
    ars = cluster.apply_all(calls.build_val_part, name, num_shards, plan.seed)
    sizes = cluster.wait_all(ars, timeout=cluster.spec.timeout + 60, what=f"building --val-data {name}")
    session.holdings.data[name] = dict(kind="val-part", num_samples=sum(sizes[::len(sizes) // num_shards]),
                                       num_shards=num_shards, sizes=sizes)
    if not quiet:
        empty = [r for r, n in enumerate(sizes) if n == 0]
        note = (f"; {count(len(empty), 'rank')} with none ({', '.join(map(str, empty))}) join the reductions with a "
                "count of zero" if empty else "")
        print(f"distnb: validation set {name}: make(rank, world_size) on every rank, parts of "
              f"{', '.join(map(str, sizes))} samples, each counted once{note}")
