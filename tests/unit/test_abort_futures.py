"""The futures distnb's DDP comm hook hands DDP (distnb/engine/process/abort.py): each settled once, by whoever takes it."""

import pytest
import torch

from distnb.engine.process import abort


@pytest.fixture
def pending():
    saved = set(abort._PENDING)
    abort._PENDING.clear()
    yield abort._PENDING
    abort._PENDING.clear()
    abort._PENDING.update(saved)


def test_end_pending_fails_every_future_still_pending_with_the_failure_named(pending, monkeypatch):
    monkeypatch.setattr(abort.ARMED, "by", 3)
    future_class, _ = abort._hook_types()
    waiting, settled = future_class([]), future_class([])
    pending.update({waiting, settled})
    assert abort._take(settled)  # its all-reduce finished first: it is the callback's to settle
    settled.set_result(torch.ones(1))
    assert abort.end_pending() == 1 and not pending
    with pytest.raises(RuntimeError, match="Connection closed by peer: distnb ended this rank's pending all-reduce "
                                           r"\(rank 3 failed\)"):
        waiting.wait()
    assert torch.equal(settled.wait(), torch.ones(1))  # left alone
    assert abort.end_pending() == 0


def test_a_future_is_taken_once():
    fut = abort._hook_types()[0]([])
    abort._PENDING.add(fut)
    assert abort._take(fut) and not abort._take(fut)
