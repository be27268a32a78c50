"""How many inductor compile workers a rank may start (``--compile``; GPU review, finding 6).

torch decides ``torch._inductor.config.compile_threads`` once, when ``torch._inductor.config``
is imported: ``TORCHINDUCTOR_COMPILE_THREADS`` if set, else ``min(32, cores the process may run
on)`` (``torch/_inductor/config.py``, ``decide_compile_threads``), and its first compilation
starts a subprocess pool of that many workers, each importing torch
(``torch/_inductor/async_compile.py``). GPU engines are not bound to cores, so on a 16-core host
each of 8 GPU engines started 16 workers: 128 processes, an oversubscribed CPU, and compile times
that differ between ranks by more than a collective's timeout.

:func:`limit` gives the rank its share of the host's cores instead (the same share as its
``OMP_NUM_THREADS``): it sets the config value itself, at the compile, rather than the variable
at start. That holds for fresh GPU engines and for CPU engines forked from the engine template
alike: a fork keeps the template's ``TORCHINDUCTOR_*`` variables and whatever the template's
imports decided (docs/guides/starting.md, "the engine template"). A ``TORCHINDUCTOR_COMPILE_THREADS`` the user set
(before ``%dist start``) is theirs and stays.
"""

from __future__ import annotations

import os

VARIABLE = "TORCHINDUCTOR_COMPILE_THREADS"
_OURS: list = [None]  # the value limit() last set (a later cell after a scale sets it again)


def share(num_threads: int | None = None) -> int:
    """This rank's compile workers: ``num_threads`` (default: its ``OMP_NUM_THREADS``), at least 1."""
    if num_threads is None:
        num_threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
    return max(1, int(num_threads))


def limit(num_threads: int | None = None) -> int:
    """Set inductor's compile workers to this rank's share of cores, before its first compile; returns it.

    Parameters
    ----------
    num_threads : int, optional
        The rank's share of its host's cores (default: ``OMP_NUM_THREADS``, which distnb sets per
        engine to the host's cores over its ranks).

    Returns
    -------
    int
        The number of compile workers inductor will use (1: it compiles in the rank's own process).
    """
    import torch._inductor.config as inductor_config  # heavy: --compile only

    if os.environ.get(VARIABLE) not in (None, _OURS[0]):  # the user's choice (and torch has read it already)
        return int(inductor_config.compile_threads or os.environ[VARIABLE])
    n = share(num_threads)
    inductor_config.compile_threads = n
    os.environ[VARIABLE] = _OURS[0] = str(n)  # subprocesses the rank starts (and torch's later lookups) agree
    return n
