"""Whether every rank can create and write a folder, asked before anything runs that writes there.

``%dist save DIR`` (:mod:`distnb.train.hfsaving`) and a training cell's ``--checkpoint-dir`` and ``--log-dir``
(:func:`check_folders`) ask each rank (:func:`distnb.engine.train.savefolder.writable`, not a
collective: nothing fails on the ranks, so the process group and what it holds stay). The ranks' answer is the
one that counts: a rank sees its own working folder, user and file systems, which the kernel's may not be.
"""

from __future__ import annotations

from distnb.core import calls
from distnb.core.errors import PlanError, ranks_named
from distnb.execute.execute import run_on_ranks


def not_writable(session, directory: str) -> str:
    """'' when every rank can create ``directory`` and write in it; else the clause that names each rank that
    cannot, with its host and reason, and the fix: ``not every rank can write it (rank 1 on HOST: ...); give a
    folder every rank can create and write``."""
    rows = run_on_ranks(session, calls.writable, directory, what=f"checking {directory} on the ranks")
    bad = {}
    for row in rows:
        if row["why"]:
            bad.setdefault((row["host"], row["why"]), []).append(row["rank"])
    if not bad:
        return ""
    who = "; ".join(f"{ranks_named(ranks)} on {host}: {why}" for (host, why), ranks in bad.items())
    several = len({row["host"] for row in rows}) > 1
    return (f"not every rank can write it ({who}); give a folder every rank can create and write"
            + (" (on a file system every host shares)" if several else ""))


def check_folders(session, plan) -> None:
    """PlanError naming the first of ``--checkpoint-dir`` and ``--log-dir`` that some rank cannot create and write,
    with those ranks, their hosts and the fix, asked of every rank before anything is sent (:func:`not_writable`):
    such a folder failed on that rank only at its first write, after an epoch's training (and the kernel, which
    checked alone, may see another folder than a rank does)."""
    for flag, path in (("--checkpoint-dir", plan.checkpoint_dir), ("--log-dir", plan.log_dir)):
        why = not_writable(session, path) if path else ""
        if why:
            raise PlanError(f"{flag} {path}: {why}. Nothing was sent or trained")
