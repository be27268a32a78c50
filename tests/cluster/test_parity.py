"""A 2-rank DDP run must match one process trained on the global batch (real engines, real gloo group)."""

import pytest
import torch
import torch.nn.functional as F

from support.data import parity_data, parity_model
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"


@pytest.mark.parametrize("optimizer,opt_cls,lr", [("sgd", torch.optim.SGD, 0.1), ("adam", torch.optim.Adam, 0.01)])
def test_ddp_matches_single_process_with_global_batch(dist_session, shell, optimizer, opt_cls, lr):
    ns = shell.user_ns
    name = f"parity_{optimizer}"
    ns[name], ns["parity_data"], ns["F"] = parity_model(), parity_data(), F
    ref = parity_model()
    assert torch.equal(ref[0].weight, ns[name][0].weight)

    result = dist_session.train(BODY, model=name, data="parity_data", epochs=2, batch_size=16,
                                optimizer=optimizer, lr=lr, seed=4, progress="none", quiet=True)
    opt = reference(ref, ns["parity_data"], num_shards=2, batch_size=16, epochs=2, seed=4, optimizer=opt_cls,
                    lr=lr).optimizer
    assert result.rows[0]["steps"] == result.rows[1]["steps"] == 2 * 7  # ceil(ceil(203 / 2) / 16) = 7 steps per epoch
    for p_dist, p_ref in zip(ns[name].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)

    # every rank holds identical parameters
    dist_session.run(f"import torch\n_flat = torch.cat([p.detach().flatten() for p in {name}.parameters()])")
    flats = dist_session.pull("_flat")
    assert torch.equal(flats[0], flats[1])
    torch.testing.assert_close(flats[0], torch.cat([p.detach().flatten() for p in ref.parameters()]),
                               atol=1e-5, rtol=1e-5)

    # a second cell continues (same optimizer state, next epochs) and still matches
    result2 = dist_session.train(BODY, model=name, data="parity_data", epochs=1, batch_size=16,
                                 optimizer=optimizer, lr=lr, seed=4, progress="none", quiet=True)
    assert result2.epochs == [2]
    reference(ref, ns["parity_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=opt, first_epoch=2)
    for p_dist, p_ref in zip(ns[name].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)


def test_drop_last_uses_full_batches_only(dist_session, shell):
    ns = shell.user_ns
    ns["drop_model"], ns["drop_data"] = parity_model(), parity_data(n=101)
    r = dist_session.train(BODY, model="drop_model", data="drop_data", epochs=1, batch_size=16, drop_last=True,
                           progress="none", quiet=True)
    assert [row["steps"] for row in r.rows] == [3, 3]  # floor(floor(101/2)/16)
    assert [row["samples"] for row in r.rows] == [48, 48]
