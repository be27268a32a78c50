"""Save, wander off, load, continue: for every strategy the result equals an uninterrupted run.

The checkpoint holds each rank's part (a shard, a stage, a replica) of the model and of the
optimizer state, and the position in the data; restoring it and training on must give the
same parameters as never having stopped (Adam, so optimizer state matters).
"""

import pytest
import torch
import torch.nn.functional as F

from support.data import blobs, mlp

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
OPTIONS = {"ddp": {}, "fsdp": {}, "tensor": {}, "pipeline": {"microbatches": 2}, "ps": {}}


def make_data():
    return blobs(64, num_features=8, num_classes=2, num_summed=3)


def make_model():
    return mlp(8, 16, 8, 2, seed=7)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("strategy", list(OPTIONS))
def test_save_load_continue_equals_uninterrupted(dist_session, shell, tmp_path, strategy):
    ns = shell.user_ns
    ns["sc_data"], ns["F"] = make_data(), F
    name_ref, name = f"sc_ref_{strategy}", f"sc_{strategy}"
    ns[name_ref], ns[name] = make_model(), make_model()

    def train(model, epochs, **kw):
        return dist_session.train(BODY, model=model, data="sc_data", epochs=epochs, batch_size=8, seed=2,
                                  strategy=strategy, progress="none", quiet=True, **OPTIONS[strategy], **kw)

    train(name_ref, 1, optimizer="adam", lr=0.01)
    train(name_ref, 1)
    want = params(ns[name_ref])

    train(name, 1, optimizer="adam", lr=0.01)
    meta = dist_session.save(str(tmp_path), model=name, quiet=True)
    assert meta["plan"]["strategy"] == strategy
    saved = params(ns[name]).clone()
    train(name, 1, lr=0.5)  # wander off
    dist_session.load(str(tmp_path), model=name, quiet=True)
    torch.testing.assert_close(params(ns[name]), saved)
    result = train(name, 1)
    assert result.epochs == [1]
    torch.testing.assert_close(params(ns[name]), want, atol=1e-5, rtol=1e-5)
