"""Notebook cells shared by the tests of ``%dist debug`` (tests/magics and tests/jupyter)."""


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
