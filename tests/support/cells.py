"""Notebook cells and calls shared by the tests (``%dist debug``'s failing cell; a training the interrupt stops)."""

import contextlib
import dataclasses

from distnb import session as session_mod


@contextlib.contextmanager
def hang_after(seconds):
    """The running cluster's ``--hang-after`` set to ``seconds`` for the block."""
    cluster = session_mod.current().cluster
    spec = cluster.spec
    cluster.spec = dataclasses.replace(spec, hang_after=seconds)
    try:
        yield
    finally:
        cluster.spec = spec


def failing_cell(result: str) -> str:
    """A ``%%dist`` cell whose rank 1 raises inside ``step`` (locals ``x``, ``scale``); ``result`` is never bound."""
    return f"""%%dist
import torch, torch.distributed as dist
def step(scale):
    x = torch.arange(6.).reshape(2, 3) * scale
    if rank == 1:
        raise ValueError(f"bad batch on rank {{rank}}")
    return x
{result} = step(2.0)
dist.all_reduce(torch.ones(1))
"""


def interrupted(train, *args, **kwargs):
    """``train(*args, **kwargs)`` (a ``Session.train``) that the kernel's interrupt stops: the Interrupted it raises,
    whose ``.result`` holds what was trained (the interrupt stops what comes after the cell too)."""
    import pytest

    from distnb.core.errors import Interrupted

    with pytest.raises(Interrupted) as stop:
        train(*args, **kwargs)
    assert stop.value.result is not None, stop.value  # every rank stopped after the same step
    return stop.value
