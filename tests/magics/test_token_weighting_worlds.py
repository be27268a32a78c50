"""Token-weighted losses on worlds of 1 and 4 ranks (issue 36, item 8), each its own small cluster.

The shared cluster's tests (tests/cluster/test_token_weighting.py) cover 2 ranks; here 1 rank x
accumulate 4 and 4 ranks x accumulate 1 train the same padded sequences, and each must equal one
process on its global batches (16 sequences per optimizer step) to 1e-6, so that the three worlds
agree with each other through the reference.
"""

import pytest
import torch
import torch.nn.functional as F

from distnb.cluster.cluster import Cluster
from distnb.cluster.defaults import default_spec
from distnb.session import Session
from support.reference import reference
from support.tokens import SUMMED, padded_tokens, token_mean, token_model


@pytest.mark.parametrize("world_size,accumulate", [(1, 4), (4, 1)])
def test_token_weighted_loss_on_one_and_four_ranks_equals_one_process(world_size, accumulate):
    ns = {"F": F, "net": token_model(), "tokens": padded_tokens()}
    ref = token_model()
    session = Session(Cluster(default_spec(n=world_size, timeout=30)).start(), ns=ns)
    try:
        result = session.train(SUMMED, model="net", data="tokens", epochs=2, batch_size=4, accumulate=accumulate,
                               optimizer="sgd", lr=0.5, seed=4, progress="none", quiet=True)
    finally:
        session.stop(quiet=True)
    assert result.token_weighted and result.optimizer_steps == 2 * 96 // 16
    reference(ref, ns["tokens"], num_shards=world_size, batch_size=4, epochs=2, seed=4, optimizer=torch.optim.SGD,
              lr=0.5, accumulate=accumulate, loss_fn=token_mean)
    for (name, p), q in zip(ns["net"].named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")
