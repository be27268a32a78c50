"""Kernel-side checks of meta-device models (distnb/train/bigmodels.py): no cluster needed."""

import pytest
import torch
import torch.nn as nn

from distnb.train import bigmodels
from distnb.core.errors import PlanError
from distnb.core.plan import TrainPlan


class MyNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = MyNorm(4)


def blocks():
    with torch.device("meta"):
        net = nn.Module()
        net.blocks = nn.ModuleList(Block() for _ in range(4))
    return net


def test_a_meta_module_without_reset_parameters_is_named_with_its_class():
    plan = TrainPlan(model="net", data="d", strategy="fsdp")
    with pytest.raises(PlanError, match=r"net is on the meta device and its module blocks\.0\.norm \(MyNorm\) has no "
                                        r"reset_parameters\(\).*pass --init FN"):
        bigmodels.check_init(blocks(), plan)
    bigmodels.check_init(blocks(), TrainPlan(model="net", data="d", strategy="fsdp", init="init_weights"))


def test_a_model_with_data_is_not_on_meta_and_needs_no_init():
    assert not bigmodels.on_meta(nn.Linear(2, 2))
    assert bigmodels.on_meta(blocks())
    with torch.device("meta"):
        bigmodels.check_init(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), TrainPlan(model="n", data="d"))


def test_what_a_rank_needs_per_strategy():
    with torch.device("meta"):
        net = nn.Sequential(*(nn.Linear(100, 100, bias=False) for _ in range(4)))  # 4 x 40000 bytes
    assert bigmodels.model_bytes(net) == bigmodels.trainable_bytes(net) == 160_000
    need, how = bigmodels.rank_need(net, TrainPlan(model="n", data="d", strategy="ddp"), 4)
    assert need == 160_000 * 2 and "full replica" in how  # the weights and their gradients (DDP's buckets)
    need, how = bigmodels.rank_need(net, TrainPlan(model="n", data="d", strategy="ddp", optimizer="adam"), 4)
    assert need == 160_000 * 4 and "adam's state" in how  # and Adam's two moments
    need, how = bigmodels.rank_need(net, TrainPlan(model="n", data="d", strategy="fsdp"), 4)
    assert need == 80_000 + 80_000 and "largest FSDP unit" in how  # a quarter with gradients, one layer and its gradient
    need, how = bigmodels.rank_need(net, TrainPlan(model="n", data="d", strategy="tensor", optimizer="adamw"), 4)
    assert need == 160_000 and how.startswith("1/4 of")
    need, how = bigmodels.rank_need(net, TrainPlan(model="n", data="d", strategy="ddp", optimizer="my_opt"), 4)
    assert need == 320_000 and "my_opt is not counted" in how


def test_frozen_parameters_need_no_gradient_nor_optimizer_state():
    with torch.device("meta"):
        net = nn.Sequential(*(nn.Linear(100, 100, bias=False) for _ in range(4)))
    for layer in list(net)[:3]:  # a fine-tune that trains the last layer only
        layer.weight.requires_grad_(False)
    assert bigmodels.trainable_bytes(net) == 40_000
    need, _ = bigmodels.rank_need(net, TrainPlan(model="n", data="d", strategy="ddp", optimizer="adam"), 4)
    assert need == 160_000 + 3 * 40_000
