"""What the kernel knows the ranks hold (:class:`Holdings`), so a training cell sends only what changed.

A session keeps one :class:`Holdings` (``session.holdings``): the models, data sets and pushed names on
the ranks, which go when the ranks go (:meth:`Holdings.forget`), and the options a model's cells carry
over, which survive ``%dist restart`` (:meth:`Holdings.keep_across_restart`). :mod:`distnb.train.training`
reads and fills it for each cell.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from distnb.core.carryover import CARRIED
from distnb.train import bigmodels


@dataclass
class Holdings:
    """What the kernel knows the ranks hold, so a cell sends only what changed.

    Attributes
    ----------
    models : dict
        Model name -> fingerprint of the kernel object the ranks hold.
    distributed : dict
        Model name -> (strategy key, generation) it was last distributed with.
    data : dict
        Data set name -> dict(fingerprint, seed, num_samples, shards, structure, num_shards, layout).
    pushed : dict
        Name -> fingerprint of what an automatic push sent.
    carried : dict
        Model name -> the values of its last cell's options that carry over
        (:func:`distnb.core.carryover.carry_over`); survives restarts.
    lr_of : dict
        Model name -> the lr its carried optimizer was chosen with, for one made new; survives restarts.
    trained_steps : dict
        Model name -> the ranks' global optimizer step count the notebook's weights come from (the
        last cell that ended well); survives restarts, so a resume never goes backwards.
    objects : dict
        Model name -> weak reference to the notebook object its carried options belong to: a new
        object bound to the name (``net = Net()`` run again) starts from the defaults.
    names : set
        Notebook names pushed to the ranks (``%dist push``, a training body's names): ``%dist scale``
        hands them to added ranks.
    batch_world : dict
        After ``%dist scale --keep-global-batch``: model name -> (the world size its cells' ``--batch-size``
        and ``--accumulate`` are written for, a weak reference to the notebook object that was live then),
        for the models live at the scale (:func:`distnb.elastic.scaling.batch_for_world`); the pending rewrite of
        the cell running now is under ``None`` (for ``%dist export``).
    generation : int
        Bumps whenever the process group is re-formed.
    """

    models: dict = field(default_factory=dict)
    distributed: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    pushed: dict = field(default_factory=dict)
    carried: dict = field(default_factory=dict)
    lr_of: dict = field(default_factory=dict)
    trained_steps: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)
    names: set = field(default_factory=set)
    batch_world: dict = field(default_factory=dict)
    last_plans: dict = field(default_factory=dict)  # model -> (its last cell's plan, whether it failed): lostshards.py
    settings: dict = field(default_factory=dict)  # model name -> its last cell's words on carried options (carried.py)
    resume_steps: tuple = (None, None, None)  # the notebook's and the newest checkpoint's steps, its optimizer
    generation: int = 0
    loaded: str | None = None  # the model %dist load filled after the last training cell (save's default model)
    gone: dict = field(default_factory=dict)  # model -> (fingerprint the ranks held, why no more): bigmodels.RESTARTED

    def forget(self) -> None:
        """Drop what the ranks held (they are gone); the user's optimizer choices stay."""
        self.gone.update({name: (fp, bigmodels.RESTARTED) for name, fp in self.models.items()})
        for held in (self.models, self.distributed, self.data, self.pushed, self.names):
            held.clear()
        self.loaded = None

    def remember(self, plan, model_obj=None) -> None:
        """What of ``plan`` carries over to the model's next cell (the ranks accepted it), for the
        notebook object ``model_obj``.

        ``--optimizer`` left out keeps the one chosen before, and its lr (for an optimizer made
        new later) is the last one given with it.
        """


        if model_obj is not None:
            self.objects[plan.model] = weakref.ref(model_obj)

        last = self.carried.get(plan.model, {})
        values = {name: getattr(plan, name) for name in CARRIED}
        if plan.optimizer is None:
            values["optimizer"] = last.get("optimizer")
            if plan.lr is not None:  # the optimizer kept (or the default one): a new one takes this lr too
                self.lr_of[plan.model] = plan.lr
        elif plan.lr is not None or last.get("optimizer") != plan.optimizer:
            self.lr_of[plan.model] = plan.lr
        self.carried[plan.model] = values

    def steps_of(self, name: str, model_obj):
        """The global step count of ``model_obj``'s weights (:attr:`trained_steps`), or None when ``model_obj``
        is not the object the name's count belongs to (``net = Net()`` run again: new weights, no steps)."""
        ref = self.objects.get(name)
        return self.trained_steps.get(name) if ref is not None and ref() is model_obj else None

    def keep_across_restart(self, new: "Holdings") -> None:
        """Copy into ``new`` what survives ``%dist restart``: the carried options, lrs and step counts."""
        new.carried.update(self.carried)
        new.lr_of.update(self.lr_of)
        new.trained_steps.update(self.trained_steps)
        new.objects.update(self.objects)
        new.gone.update(self.gone)

    def replaced(self, name: str, model_obj) -> dict:
        """If ``name`` is bound to another object than the one its options were carried for, forget
        them (and their lr) and return them; else {}."""
        ref = self.objects.get(name)
        if ref is None or ref() is model_obj:
            return {}
        del self.objects[name]
        self.lr_of.pop(name, None)
        self.trained_steps.pop(name, None)  # new weights: no steps trained on them yet
        return self.carried.pop(name, None) or {}
