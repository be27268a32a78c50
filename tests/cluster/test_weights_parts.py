"""Weights back in bounded parts (issue 34, item 1): rank 0 never holds a model-sized outbox.

After a training cell the kernel asks the ranks for the state one part after the other
(:func:`distnb.transfer.weights_back.stream_into`, :func:`distnb.engine.train.stateparts.pull_part`). A spy on rank 0's
outbox (:func:`distnb.engine.transport.stateout._outbox`) records the size of every outbox it takes: each must be at
most one part, for every strategy, and the kernel's model must then equal the ranks' weights exactly.
Before, rank 0 took one outbox of the whole model (1.2-1.7x torchrun's peak in benchmarks/memory.py).
"""

import pytest
import torch
import torch.nn as nn

from distnb.transfer import weights_back
from support.data import parity_data

PART = 1 << 20  # 1 MiB parts: the model below is 6 tensors of 1 MiB and 6 small ones

SPY = """
import distnb.engine.transport.stateout as _so
_outboxes = []
if not hasattr(_so, "_real_outbox"):
    _so._real_outbox = _so._outbox
def _spy(total):
    _outboxes.append(max(total, _so._FLOOR[0]))
    return _so._real_outbox(total)
_so._outbox = _spy
"""

UNSPY = """
import distnb.engine.transport.stateout as _so
_so._outbox = _so._real_outbox
"""


def make():
    torch.manual_seed(3)
    layers = [nn.Linear(12, 512)] + [nn.Linear(512, 512) for _ in range(6)] + [nn.Linear(512, 3)]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tensor", "pipeline", "fsdp+tensor"])
def test_weights_come_back_in_parts_no_larger_than_one(dist_session, shell, monkeypatch, strategy):
    monkeypatch.setattr(weights_back, "PART_BYTES", PART)
    ns = shell.user_ns
    name = f"parts_{strategy.replace('+', '_')}"
    ns["parts_data"], ns["F"] = parity_data(), torch.nn.functional
    ns[name] = make()
    before = {k: t.clone() for k, t in ns[name].state_dict().items()}
    opts = dict(mesh="1x2") if strategy == "fsdp+tensor" else {}
    dist_session.run(SPY)
    try:
        dist_session.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", model=name,
                           data="parts_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.1, seed=4,
                           strategy=strategy, progress="none", quiet=True, **opts)
        sizes = dist_session.pull("_outboxes")[0]
    finally:
        dist_session.run(UNSPY)
    model_bytes = sum(t.numel() * t.element_size() for t in ns[name].state_dict().values())
    assert model_bytes > 6 * PART
    assert len(sizes) >= 6 and max(sizes) <= PART, sizes  # one outbox per part, none the whole model
    after = ns[name].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in after)  # trained weights came back
    for key, t in after.items():  # each equal to the ranks' own (%dist pull NAME.key gathers it whole)
        torch.testing.assert_close(t, dist_session.pull(f"{name}.{key}"), atol=0, rtol=0, msg=key)
