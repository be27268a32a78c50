"""The running training cell's result, kept on each rank for a kernel that attaches later (issue 38).

A training cell's result goes back to the client that sent it: ipyparallel routes the reply to
that client only, and distnb's controller keeps no results database (``NoDB``, issue 20). A
kernel that attached to the world afterwards (``%dist attach``, :mod:`distnb.attaching`) learns
the cell's end and its figures by asking each rank for what it kept: :func:`kept_result` is queued on
the rank behind the training call itself, so it answers as soon as the training ends.

Only the figures are kept, never the trained state (rank 0's packed weights): an attached kernel
streams the weights from the ranks' live model in parts (``distnb.engine.train.stateparts``), so nothing is held
twice in memory.
"""

from __future__ import annotations

from distnb.engine.train import loop

#: token -> ("ok", this rank's figures without the state) or ("error", the exception); the newest cell only.
_KEPT: dict = {}


def train_kept(ns, token, plan_dict, code_text, outbox=None):
    """:func:`distnb.engine.train.loop.train`, its outcome kept under ``token`` for :func:`kept_result`.

    Parameters
    ----------
    token : str
        The cell's run token (the world record's ``run["token"]``, :mod:`distnb.cluster.worlds`).
    plan_dict, code_text, outbox
        As :func:`distnb.engine.train.loop.train` takes them.

    Returns
    -------
    dict
        This rank's figures, as :func:`distnb.engine.train.loop.train` returns them.
    """
    _KEPT.clear()  # one cell at a time: an older cell's figures are never handed out for this one
    try:
        value = loop.train(ns, plan_dict, code_text, outbox)
    except BaseException as exc:  # noqa: BLE001 - raised again, here and to an attached kernel
        _KEPT[token] = ("error", exc)
        raise
    kept = dict(value) if isinstance(value, dict) else value
    if isinstance(kept, dict) and kept.get("state") is not None:
        kept["state"] = None  # the weights stay in the live model (pulled again), not a second copy
    _KEPT[token] = ("ok", kept)
    return value


def kept_result(token):
    """What the training cell of ``token`` returned on this rank (or raise what it raised).

    Raises
    ------
    LookupError
        When this rank ran no training cell of that token since (a newer cell replaced it, or the
        engine restarted).
    """
    if token not in _KEPT:
        raise LookupError(f"this rank kept no result of the training cell {token} (a newer cell ran since, or the "
                          "engine restarted)")
    kind, value = _KEPT[token]
    if kind == "error":
        raise value
    return dict(value) if isinstance(value, dict) else value
