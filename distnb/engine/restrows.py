"""Rank side of the rest of an epoch a resize left in the middle (:mod:`distnb.engine.train.epochrest`): what the
kernel asks of it, and the tensor rows it sends for it (:mod:`distnb.elastic.midepoch`)."""

from __future__ import annotations

from distnb.engine.train import epochrest, loop
from distnb.engine.transport import wire


def trails() -> dict:
    """{model: trail} of this rank's models whose position is in an epoch's rest (a JSON-able dict each)."""
    return {name: epochrest.active(run) for name, run in loop.RUNS.items() if epochrest.active(run) is not None}


def install_rest(name: str, key: list, descs, *buffers) -> int:
    """Receive this rank's rows of the rest of an epoch of tensor data ``name``, laid out as ``key`` says
    (:func:`distnb.engine.train.epochrest.rows_key`); returns how many rows."""
    columns = wire.receive(descs, buffers)  # copied: a rest is read once, the kernel's segment goes back to its pool
    epochrest.keep_rows(name, key, columns)
    return len(columns[0]) if columns else 0
