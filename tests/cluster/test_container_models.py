"""Models that keep their layers in an nn.ModuleList / nn.ModuleDict train with fsdp and pipeline.

Such containers are never called (the forward iterates or indexes them), so FSDP2 refuses them as
units and no pipeline stage can begin at one: the defaults take their elements. Each run must
equal one process training on the same batches (1e-5).
"""

import pytest
import torch
import torch.nn.functional as F

from support.data import parity_data
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"

CELL = """
import torch, torch.nn as nn
class ListNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 10)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(10, 14), nn.Tanh(), nn.Linear(14, 10)) for _ in range(2)])
        self.heads = nn.ModuleDict({"cls": nn.Linear(10, 3)})
    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.heads["cls"](h)
def make_list_net():
    torch.manual_seed(3)
    return ListNet()
"""


@pytest.mark.parametrize("strategy,shards", [("fsdp", 2), ("pipeline", 1)])
def test_module_list_model_matches_one_process(dist_session, shell, strategy, shards):
    shell.run_cell(CELL)
    ns = shell.user_ns
    name = f"list_net_{strategy}"
    ns[name], ns["list_data"], ns["F"] = ns["make_list_net"](), parity_data(n=64), F
    ref = ns["make_list_net"]()
    result = dist_session.train(BODY, model=name, data="list_data", epochs=2, batch_size=8, optimizer="adam",
                                lr=0.01, seed=2, strategy=strategy, progress="none", quiet=True)
    reference(ref, ns["list_data"], num_shards=shards, batch_size=8, epochs=2, seed=2, optimizer=torch.optim.Adam,
              lr=0.01)
    for (k, p_dist), p_ref in zip(ns[name].state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5, msg=k)
    if strategy == "fsdp":
        assert result.rows[0]["param_bytes"] < sum(p.numel() * 4 for p in ref.parameters())


PARAMETRIZED = """
import torch, torch.nn as nn
from torch.nn.utils import parametrizations
class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = parametrizations.weight_norm(nn.Linear(12, 10))
        self.out = parametrizations.spectral_norm(nn.Linear(10, 3))
    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))
def make_normed():
    torch.manual_seed(4)
    return Normed()
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_parametrized_model_travels_and_matches_one_process(dist_session, shell, strategy):
    # torch refuses to pickle parametrized modules ("only supported through state_dict()"): such a model
    # could not be sent at all
    shell.run_cell(PARAMETRIZED)
    ns = shell.user_ns
    name = f"normed_{strategy}"
    ns[name], ns["normed_data"], ns["F"] = ns["make_normed"](), parity_data(n=64), F
    ref = ns["make_normed"]()
    dist_session.train(BODY, model=name, data="normed_data", epochs=2, batch_size=8, optimizer="sgd", lr=0.1,
                       seed=2, strategy=strategy, progress="none", quiet=True)
    reference(ref, ns["normed_data"], num_shards=2, batch_size=8, epochs=2, seed=2, optimizer=torch.optim.SGD,
              lr=0.1)
    assert type(ns[name].inp).__name__ == "ParametrizedLinear"
    for (k, p_dist), p_ref in zip(ns[name].state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5, msg=k)
