import pytest

from distnb.core.errors import PlanError
from distnb.core.plan import DEFAULT_LR, ClusterSpec, TrainPlan


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
    (dict(strategy="fsdp", tp_plan="plan"), r"--tp-plan is a --strategy tensor or fsdp\+tensor option"),
    (dict(strategy="tensor", mesh="2x2"), r"--mesh is a --strategy fsdp\+tensor option \(this cell uses --strategy tensor\)"),
    (dict(strategy="tensor", fsdp_units="a"), r"--fsdp-units is a --strategy fsdp or fsdp\+tensor option"),
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


# the carry-over rule (carryover.carry_over) ---------------------------------------------------
from distnb.core import options  # noqa: E402
from distnb.core.carryover import CARRIED, carry_over  # noqa: E402
from distnb.core.plan import DISTRIBUTION  # noqa: E402


def _last(**values):
    plan = TrainPlan(model="m", data="d", **values)
    return {name: getattr(plan, name) for name in CARRIED}


def test_the_carried_options_are_the_distribution_ones_and_the_optimizer():
    assert set(CARRIED) == set(DISTRIBUTION) | {"optimizer"}
    assert {"strategy", "find_unused_parameters", "fsdp_units", "split", "microbatches", "tp_plan",
            "servers", "staleness"} <= set(CARRIED)
    assert {"precision", "compile", "sync_bn"} <= set(CARRIED)  # how the model is wrapped on the ranks
    for name in ("epochs", "batch_size", "lr", "lr_schedule", "workers", "checkpoint_dir", "clip_grad_norm", "reset"):
        assert name not in CARRIED  # settings of one cell (lr and the schedule live on in the ranks' objects)


def test_a_cell_that_leaves_out_state_keeps_the_last_cells_values():
    last = _last(strategy="fsdp", fsdp_units=("0", "2"), optimizer="adam")
    assert carry_over(last, {}) == {"strategy": "fsdp", "fsdp_units": ("0", "2"), "optimizer": "adam"}
    assert carry_over(last, {"fsdp_units": "1"}) == {"strategy": "fsdp", "optimizer": "adam"}
    assert carry_over(last, {"strategy": "fsdp"}) == {"fsdp_units": ("0", "2"), "optimizer": "adam"}
    assert carry_over(None, {}) == {} and carry_over({}, {}) == {}


def test_naming_another_strategy_starts_its_options_afresh_but_keeps_the_optimizer():
    last = _last(strategy="pipeline", split=("1",), microbatches=4, optimizer="sgd")
    assert carry_over(last, {"strategy": "ddp"}) == {"optimizer": "sgd"}
    assert carry_over(last, {"strategy": "pipeline"}) == {"split": ("1",), "microbatches": 4, "optimizer": "sgd"}
    last = _last(strategy="tensor", optimizer="sgd", precision="bf16")
    assert carry_over(last, {"strategy": "ddp"}) == {"optimizer": "sgd", "precision": "bf16"}
    flagged = _last(find_unused_parameters=True, compile=True)
    assert carry_over(flagged, {}) == {"find_unused_parameters": True, "compile": True}
    assert carry_over(flagged, {"find_unused_parameters": False, "compile": False}) == {}  # --no-...
    assert carry_over(flagged, {"strategy": "fsdp"}) == {"find_unused_parameters": True, "compile": True}


def test_a_carried_value_the_named_strategy_cannot_take_is_dropped_and_an_explicit_one_is_refused():
    from distnb.core.carryover import not_carried
    from distnb.core.plan import STRATEGY_LIMITS

    last = _last(precision="bf16", compile=True, sync_bn=True, optimizer="adam")
    for strategy, dropped in (("pipeline", {"precision": "bf16", "compile": True, "sync_bn": True}),
                              ("ps", {"compile": True, "sync_bn": True}), ("tensor", {"sync_bn": True}),
                              ("fsdp", {})):
        kept = carry_over(last, {"strategy": strategy})
        assert not_carried(last, {"strategy": strategy}) == dropped
        assert set(kept) | set(dropped) == {"precision", "compile", "sync_bn", "optimizer"}
        TrainPlan(model="m", data="d", strategy=strategy, **kept)  # the cell's plan is valid
    assert not_carried(last, {}) == {} and not_carried(None, {"strategy": "ps"}) == {}
    assert not_carried(_last(precision="fp16"), {"strategy": "ps"}) == {"precision": "fp16"}
    assert not_carried(_last(precision="bf16"), {"strategy": "ps"}) == {}  # ps takes bf16
    assert not_carried(last, {"strategy": "pipeline", "precision": "bf16"}) == {"compile": True, "sync_bn": True}
    with pytest.raises(PlanError, match="--precision bf16 with --strategy pipeline is not supported yet"):
        TrainPlan(model="m", data="d", strategy="pipeline", precision="bf16")  # given in the cell: refused
    from distnb.core.plan import STRATEGIES

    for name, _, strategies, _ in STRATEGY_LIMITS:  # every limit names a strategy and a carried or cell option
        assert set(strategies) <= set(STRATEGIES) and name in {f.name for f, _ in options.declared(TrainPlan)}


def test_defaults_are_not_carried_and_a_none_counts_as_left_out():
    assert carry_over(_last(), {}) == {}  # nothing but defaults: nothing to say or apply
    assert carry_over(_last(optimizer="adamw"), {"optimizer": None}) == {"optimizer": "adamw"}


def test_the_guide_states_the_rule_for_every_carried_option():
    import pathlib

    guide = (pathlib.Path(__file__).parents[2] / "docs" / "guides" / "training_cells.md").read_text()
    section = guide.split("## What carries over between cells", 1)[1].split("\n## ", 1)[0]
    flags = {f.name: options.flags_of(f, opt)[0] for f, opt in options.declared(TrainPlan)}
    missing = [flags[name] for name in CARRIED if f"`{flags[name]}`" not in section]
    assert not missing, f"the training-cells guide's carry-over section does not name {missing}"


def test_a_hang_waits_longer_when_the_ranks_steps_are_slow():
    from types import SimpleNamespace

    from distnb.execute import hangs
    from distnb.core.plan import ClusterSpec

    def watch(timeout, *step_times, hang_after=None):
        spec = ClusterSpec(num_engines=2, timeout=timeout, hang_after=hang_after)
        return SimpleNamespace(cluster=SimpleNamespace(spec=spec),
                               progress={r: dict(step=3, step_time=t) for r, t in enumerate(step_times)})

    assert hangs.limit_for(watch(60, 0.01, 0.02)) == 10.0  # fast steps: --hang-after's default
    assert hangs.limit_for(watch(60, 0.5, 4.0)) == 5 * 4.0  # a slow step: five of them
    assert hangs.limit_for(watch(60, 30.0)) == 60  # never past gloo's --timeout
    assert hangs.limit_for(watch(60, 0.1, hang_after=3)) == 3
    empty = SimpleNamespace(cluster=SimpleNamespace(spec=ClusterSpec(num_engines=2, timeout=60)), progress={})
    assert hangs.limit_for(empty) == 10.0
