"""A meta model sent again keeps the weights the ranks trained (issue 34, item 3).

A model the notebook holds on the meta device has its trained weights on the ranks only. When a cell
distributes it anew (another ``--strategy``, other distribution options), the kernel has no weights to
send, and the ranks used to initialise it afresh: the training was lost. Now the kernel asks for the old
weights to be carried (:func:`carry_weights`, before it sends the structure), and
:func:`distnb.engine.train.install.place_model` fills the new placement from the old one instead of initialising
it: tensor by tensor, every rank takes the old tensor whole (a DTensor's ``full_tensor()``, a pipeline
stage's tensor broadcast from the stage that trained it, a replica as it is) and keeps its new slice
(:func:`distnb.engine.strategies.materialize._copy_into`). A rank holds its old share, its new share and one whole
tensor at a time. This needs the process group the old placement was made on: the kernel does not ask for
it after the group was re-formed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distnb.engine.process import runtime
from distnb.engine.process.collectives import group_device
from distnb.engine.strategies.materialize import _copy_into
from distnb.engine.train.pulltensor import _tensors

#: Model names whose next placement carries the old run's weights (set by the kernel, taken by place_model).
_WANTED: set = set()


def carry_weights(name: str, on: bool) -> None:
    """Kernel call before a meta model is sent again: carry the ranks' trained weights of ``name`` (``on``)."""
    (_WANTED.add if on else _WANTED.discard)(name)


def take(name: str) -> bool:
    """Whether the placement of ``name`` now carries the old weights (once)."""
    wanted = name in _WANTED
    _WANTED.discard(name)
    return wanted


def _kind(t) -> str:
    if hasattr(t, "full_tensor"):
        return "dtensor"
    return "meta" if t.is_meta else "held"


class Carry:
    """The old run's tensors, whole on request (collectives: every rank asks for the same names in order).

    Parameters
    ----------
    old : distnb.engine.train.loop.Run
        The run the model was trained in (its strategy not yet closed: DTensors need its mesh).
    """

    def __init__(self, old):
        self.tensors = _tensors(old.module, old.strategy)
        kinds = {name: _kind(t) for name, t in self.tensors.items()}
        self.table = [None] * dist.get_world_size()
        dist.all_gather_object(self.table, kinds)  # every rank sees who holds what

    def missing(self, names) -> list:
        """Names no rank holds a value of (the same list on every rank)."""
        return [n for n in names if not any(k.get(n) in ("dtensor", "held") for k in self.table)]

    def full(self, name: str) -> torch.Tensor:
        """The old tensor ``name`` whole, detached (a collective on every rank)."""
        kinds = [k.get(name) for k in self.table]
        mine = self.tensors.get(name)
        if kinds[dist.get_rank()] == "dtensor":
            return mine.full_tensor().detach()
        holders = [r for r, k in enumerate(kinds) if k == "held"]
        if len(holders) == len(kinds):
            return mine.detach()
        src = holders[-1]  # a tensor several stages hold (a root's): the last stage's, as trained
        if dist.get_rank() == src:
            buf = mine.detach().contiguous().to(group_device())
        else:
            shape, dtype = self._shape(name, src)
            buf = torch.empty(shape, dtype=dtype, device=group_device())
        dist.broadcast(buf, src=src)
        return buf

    def _shape(self, name, src):
        t = self.tensors.get(name)  # a meta placeholder of the same shape on this rank
        if t is None:
            raise RuntimeError(f"rank {runtime.STATE.rank}: {name} is not in the trained model's structure")
        return tuple(t.shape), t.dtype

    def fill(self, pending, by_index: dict) -> frozenset:
        """Each tensor that came without data and that some rank held: the old value, this rank's slice of it
        (``by_index``). Returns the source indices filled; the others (non-persistent buffers, in no
        ``state_dict``: a rotary embedding's ``inv_freq``) are left to the model's own initialisation."""

        done = set()
        for name, index in sorted(pending.names.items(), key=lambda item: (item[1], item[0])):
            if index in done or pending.source.has_data(index) or self.missing([name]):
                continue
            done.add(index)
            full = self.full(name)
            for live in by_index.get(index, ()):
                _copy_into(live, full)
            del full
        return frozenset(done)
