"""Whether this rank can write the folder of a save, asked before anything is written.

``%dist save`` and a training cell with ``--checkpoint-dir`` or ``--log-dir`` ask every rank first
(:func:`writable`, no collective: a rank that cannot write leaves no other waiting), and the kernel
names each rank that cannot, with its host and the fix, before the save or the cell starts
(:mod:`distnb.train.rankfolders`): nothing fails on the ranks, so the process group and the model it
holds stay. A save made on the ranks alone (an expiring lease's, a training cell's checkpoint, whose
folder may have changed since the cell began) checks the same together (:func:`check_writable`), so
that every rank raises alike.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

from distnb.core.folders import unwritable
from distnb.engine.process import runtime


def _host() -> str:
    return runtime.STATE.host or socket.gethostname()


def writable(directory: str) -> dict:
    """``{"rank", "host", "why"}``: whether this rank can create ``directory`` and write in it ('' when it can).

    Not a collective, and it never raises: the kernel gathers every rank's answer. Nothing is left
    behind (:func:`distnb.core.folders.unwritable`).
    """
    try:
        why = unwritable(directory)
    except Exception as exc:  # an odd file system: said, never raised (no rank's failure tears the group down)
        why = f"{type(exc).__name__}: {exc}"
    return dict(rank=runtime.STATE.rank, host=_host(), why=why)


def check_writable(directory: str) -> None:
    """Every rank checks ``directory`` and raises alike, naming each rank that cannot write it.

    Collective (an all-gather of each rank's reason), so a rank's failure never leaves the others
    waiting in a collective of the save.

    Raises
    ------
    RuntimeError
        On every rank, when any rank cannot create ``directory`` or write in it.
    """
    mine = writable(directory)
    every = [None] * runtime.STATE.world_size
    dist.all_gather_object(every, (mine["rank"], mine["host"], mine["why"]))
    bad = [f"rank {r} on {host} ({why})" for r, host, why in every if why]
    if bad:
        raise RuntimeError(f"rank {runtime.STATE.rank}: {directory} cannot be written on " + "; ".join(bad)
                           + ": give a folder every rank can create and write (a shared file system for ranks "
                           "on several hosts)")
