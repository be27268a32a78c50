"""Rank side of an expiring lease: save what the ranks trained, the way ``%dist save`` does.

When a world's kernel died and no new kernel claimed it within ``--linger``, its keeper
(:mod:`distnb.cluster.keeper`) calls :func:`save_trained` on every rank: each model the ranks trained
is checkpointed with :func:`distnb.engine.train.saves.checkpoint_model` (DCP: model, optimizer and
position, a ``step_<steps>`` folder with ``distnb.json``), into the ``--checkpoint-dir`` of the
cell that last trained it, else into the world's default folder (a subfolder per model when
there are several).
"""

from __future__ import annotations

import os

from distnb.engine.train import loop, saves


def save_trained(ns, default_dir):
    """Checkpoint every trained model of this rank's world; every rank must call it (collectives).

    Parameters
    ----------
    ns : dict
        The engine namespace.
    default_dir : str
        The world's default folder, for a model whose last cell named no ``--checkpoint-dir``.

    Returns
    -------
    list of dict
        One per model, in name order: ``model``, ``path`` (the ``step_*`` folder), ``steps``,
        ``epoch``, ``epoch_step``.

    Raises
    ------
    RuntimeError
        What :func:`distnb.engine.train.saves.checkpoint_model` raises (a model whose copy was lost with a failed
        cell); the models before it in name order are saved.
    """
    names = sorted(name for name, run in loop.RUNS.items() if run.plan_dict is not None)  # the same order on every rank
    saved = []
    for name in names:
        directory = loop.RUNS[name].plan_dict.get("checkpoint_dir")
        if not directory:
            directory = default_dir if len(names) == 1 else os.path.join(default_dir, name)
        meta = saves.checkpoint_model(ns, name, directory)
        saved.append(dict(model=name, path=meta["path"], steps=meta["steps"], epoch=meta["epoch"],
                          epoch_step=meta["epoch_step"]))
    return saved
