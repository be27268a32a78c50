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
    ("optimizer", "not a name", "--optimizer"), ("nan", "ignore", "--nan"), ("model", "1net", "--model"), ("data", "", "--data"),
])
def test_bad_values_name_the_option(field, value, needle):
    with pytest.raises(PlanError, match=needle):
        TrainPlan(**{"model": "net", "data": "train", field: value})


@pytest.mark.parametrize("options,needle", [
    (dict(strategy="ddp", split="a"), "--split is a --strategy pipeline option"),
    (dict(strategy="fsdp", tp_plan="plan"), "--tp-plan is a --strategy tensor option"),
    (dict(strategy="pipeline", servers=2), r"--servers is a --strategy ps option \(this cell uses --strategy pipeline\)"),
    (dict(strategy="ddp", servers=2, staleness=1), "--servers and --staleness are --strategy ps options"),
    (dict(strategy="tensor", schedule="1f1b"), "--schedule is a --strategy pipeline option"),
    (dict(strategy="pipeline", microbatches=3, batch_size=32), "--microbatches 3 does not divide --batch-size 32"),
    (dict(strategy="pipeline", microbatches=0), "--microbatches"),
    (dict(strategy="pipeline", schedule="zb"), "--schedule"),
    (dict(strategy="pipeline", split="1abc"), "--split"),
    (dict(strategy="ps", servers=0), "--servers"),
    (dict(strategy="ps", staleness=-1), "--staleness"),
    (dict(strategy="pipeline", loss="not a name"), "--loss"),
])
def test_strategy_options_are_checked(options, needle):
    with pytest.raises(PlanError, match=needle):
        TrainPlan(model="net", data="train", **options)


def test_strategy_options_normalise_and_round_trip():
    p = TrainPlan(model="net", data="train", strategy="pipeline", split="layers.2, head", microbatches=4,
                  batch_size=32, schedule="1f1b")
    assert p.split == ("layers.2", "head")
    assert TrainPlan.from_dict(p.to_dict()) == p
    assert TrainPlan(model="net", data="train", strategy="fsdp", fsdp_units=["a", "b"]).fsdp_units == ("a", "b")


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
