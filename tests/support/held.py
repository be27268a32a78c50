"""What the ranks hold of a live model, read whole: a DTensor gathered, a pipeline stage's own tensors."""

import torch

# every rank: its tensors as full ones (a collective for DTensors), leaving out those it does not hold
PULL = """
import torch
from torch.distributed.tensor import DTensor
_held = {{n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
          for n, t in {name}.state_dict(keep_vars=True).items()}}
_held = {{n: t for n, t in _held.items() if not t.is_meta}}
"""


def ranks_weights(session, name: str) -> dict:
    """Model ``name``'s full weights as the ranks hold them (a pipeline stage gives its own), checked equal across
    ranks."""
    session.run(PULL.format(name=name))
    merged = {}
    for held in session.pull("_held"):
        for key, t in held.items():
            assert key not in merged or torch.equal(merged[key], t), f"{key} differs between ranks"
            merged[key] = t
    return merged


def assert_bit_exact(got: dict, want: dict, what: str) -> None:
    """``got`` holds exactly ``want``'s tensors, bit for bit."""
    assert sorted(got) == sorted(want), what
    for key, t in want.items():
        assert torch.equal(got[key], t), f"{what}: {key} differs"
