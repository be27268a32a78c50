"""A training cell that failed before any step: whether its failure may keep the process group.

A training cell's failure used to tear the process group down on every rank and have the kernel re-form
it (:func:`distnb.engine.process.runtime.mark_broken`). A model sharded in place went with the group: a
model built on the meta device in the notebook, whose trained weights live on the ranks only, was then
initialised afresh by its next cell. A ``%%dist`` cell and a ``%dist save`` keep the group when every rank
ended them alike (:mod:`distnb.engine.process.health`); a training cell now does the same when its failure
left nothing half-done on this rank:

- the failure was raised by the step body before any module's forward began on this rank (a typo, a
  bad name on the body's first lines: :class:`FirstForward` watches for the first call), or it is a
  refusal that leaves the model as it found it (:attr:`distnb.engine.strategies.StrategyError.before_step`:
  the tensor plan's check, raised from a hook before the model's own forward), and
- no micro-step of the cell finished on this rank.

Then the rank asks the others, as a failed ``%%dist`` cell does (:func:`distnb.engine.process.health.cell_ended`):
the group is kept only when every rank ended the cell with such a failure and the same collectives issued.
The model the ranks hold stays live as it was before the cell: its weights (for a meta model sent again
for another strategy, the trained weights carried into the new placement, :mod:`distnb.engine.train.carry`),
placed as this cell placed them. Any other failure re-forms the group as before.
"""

from __future__ import annotations

from torch.nn.modules.module import register_module_forward_pre_hook


class FirstForward:
    """Context around a cell's body: :attr:`began` turns True at the first forward of any module, on any thread.

    One global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``) that removes
    itself at its first call: the steps after it run with no hook.
    """

    def __init__(self):
        self.began = False
        self._handle = None

    def __enter__(self):
        self._handle = register_module_forward_pre_hook(self._seen)
        return self

    def _seen(self, module, args):
        self.began = True
        self._off()

    def _off(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __exit__(self, *exc):
        self._off()


def may_keep(exc: BaseException, first: FirstForward | None, micro_steps: int) -> bool:
    """Whether the body's failure ``exc`` left nothing half-done on this rank (see the module docstring).

    Parameters
    ----------
    exc : BaseException
        The cell's failure on this rank.
    first : FirstForward or None
        The watch around the body; None when the cell failed before its body ran (preparing the strategy, the
        optimizer, the data: not judged here, the group is re-formed).
    micro_steps : int
        Micro-steps the cell finished on this rank.
    """
    if first is None or micro_steps or not isinstance(exc, Exception):
        return False
    return not first.began or bool(getattr(exc, "before_step", False))
