import pytest

from distnb.errors import PlanError
from distnb.plan import DEFAULT_LR, ClusterSpec, TrainPlan


def test_defaults_and_normalisation():
    p = TrainPlan(model="net", data="train", optimizer="Adam")
    assert p.optimizer == "adam" and p.lr is None  # None: keep the live rate, or DEFAULT_LR for a new one
    assert set(DEFAULT_LR) == {"sgd", "adam", "adamw"}
    default = TrainPlan(model="net", data="train")
    assert default.optimizer is None and default.builtin_optimizer  # keep the live optimizer
    assert p.strategy == "ddp" and p.epochs == 1 and not p.drop_last and p.nan == "stop"
    assert TrainPlan.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("field,value,needle", [
    ("epochs", 0, "--epochs"), ("epochs", -3, "--epochs"), ("epochs", 2.5, "--epochs"),
    ("batch_size", 0, "--batch-size"), ("lr", -1.0, "--lr"), ("lr", float("nan"), "--lr"),
    ("seed", -1, "--seed"), ("strategy", "horovod", "--strategy"), ("target_loss", float("inf"), "--target-loss"),
    ("optimizer", "not a name", "--optimizer"), ("nan", "skip", "--nan"), ("model", "1net", "--model"), ("data", "", "--data"),
])
def test_bad_values_name_the_option(field, value, needle):
    with pytest.raises(PlanError, match=needle):
        TrainPlan(**{"model": "net", "data": "train", field: value})


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline", "tensor", "ps"])
def test_later_strategies_are_rejected_with_the_fix(strategy):
    with pytest.raises(PlanError, match="not available yet; use --strategy ddp"):
        TrainPlan(model="net", data="train", strategy=strategy)


def test_custom_optimizer_name_keeps_lr_none():
    p = TrainPlan(model="net", data="train", optimizer="make_opt")
    assert not p.builtin_optimizer and p.lr is None


def test_cluster_spec_validation():
    assert ClusterSpec(num_engines=2).backend == "gloo"
    with pytest.raises(PlanError, match="-n"):
        ClusterSpec(num_engines=0)
    with pytest.raises(PlanError, match="nccl needs GPU"):
        ClusterSpec(num_engines=2, backend="nccl")
    with pytest.raises(PlanError, match="--backend"):
        ClusterSpec(num_engines=2, backend="mpi")
    with pytest.raises(PlanError, match="--timeout"):
        ClusterSpec(num_engines=2, timeout=0)
