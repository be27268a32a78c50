"""Each option is declared once (a TrainPlan / RunOptions / ClusterSpec field): the magics' parsers, the
Python keywords and the help are derived from it, so they hold the same set of options."""

import dataclasses
import inspect

import pytest

from distnb.core import options
from distnb import session
from distnb.core.errors import PlanError
from distnb.magics import DistMagics, _distrain, _start
from distnb.core.plan import ClusterSpec, RunOptions, TrainPlan


def _dests(magic_fn):
    return {a.dest for a in magic_fn.parser._actions if a.dest != "help"}


def _fields(*classes, where):
    return {opt.keyword or f.name for cls in classes for f, opt in options.declared(cls) if getattr(opt, where)}


def test_distrain_magic_train_keywords_and_plan_fields_are_one_set():
    magic = _dests(_distrain) - {"output"}  # -o binds the result to a notebook name: the magic's own
    params = set(inspect.signature(session.Session.train).parameters) - {"self", "code"}
    declared = {f.name for cls in (TrainPlan, RunOptions) for f in dataclasses.fields(cls)}
    assert magic == _fields(TrainPlan, RunOptions, where="cli")
    assert params == _fields(TrainPlan, RunOptions, where="api")
    internal = declared - params
    assert internal == {"lr_if_new", "resume"}, "only the kernel's own bookkeeping is not a keyword"
    assert params - magic == {"report_interval", "quiet", "relay_above"}, \
        "Python-only options (set by --progress / no printing / the relay threshold, a tuning knob)"


def test_dist_start_magic_start_keywords_and_spec_fields_are_one_set():
    magic = _dests(_start)
    params = set(inspect.signature(session.start).parameters) - {"ns", "spec", "quiet"}
    assert magic == params == _fields(ClusterSpec, where="cli") == set(session.START_OPTIONS)
    assert {f.name for f in dataclasses.fields(ClusterSpec)} - set(session.START_OPTIONS.values()) == \
        {"device_type", "num_threads"}, "decided from the machine, not options"


@pytest.mark.parametrize("cls", [TrainPlan, RunOptions, ClusterSpec])
def test_every_option_has_help_in_the_magic_and_the_docstring(cls):
    for f, opt in options.declared(cls):
        assert opt.help, f"{cls.__name__}.{f.name} has no help text"
        assert f"{f.name} :" in cls.__doc__
    text = DistMagics.distrain.__doc__ + DistMagics.dist.__doc__
    for f, opt in options.declared(cls):
        if opt.cli:
            assert options.flags_of(f, opt)[-1] in text, f"{f.name} is missing from the magics' help"
    train_doc = session.Session.train.__doc__
    for name in options.keywords(TrainPlan):
        if name not in ("model", "data"):
            assert f"{name} :" in train_doc


def test_an_option_declared_with_a_strategy_is_checked_and_part_of_the_distribution():
    fields = options.distribution_fields(TrainPlan)
    assert fields[0] == "strategy" and "find_unused_parameters" in fields and "microbatches" in fields
    assert "epochs" not in fields and "lr" not in fields
    with pytest.raises(PlanError, match=r"--tp-plan is a --strategy tensor or fsdp\+tensor option \(this cell uses "
                                        r"--strategy ddp\)"):
        TrainPlan(model="m", data="d", tp_plan="plan")


def test_the_magic_and_the_python_api_give_the_same_error_for_a_bad_choice():
    with pytest.raises(PlanError, match="--nan must be one of stop, skip, got 'maybe'"):
        TrainPlan(model="m", data="d", nan="maybe")
    args = _distrain.parser.parse_args(["--model", "m", "--data", "d", "--nan", "maybe"])
    assert args.nan == "maybe"  # the parser passes it on; TrainPlan names the option and the choices


def test_an_unknown_keyword_to_start_or_train_is_a_plan_error_listing_the_options():
    with pytest.raises(PlanError, match=r"unknown start option\(s\) bogus; known: account, auto_restart, backend, .*, n, nodes, "):
        session.start(bogus=1, quiet=True)
    with pytest.raises(PlanError, match=r"unknown start option\(s\) bogus, cpubind \(cpubind: did you mean cpu_bind\?\); "):
        session.start(bogus=1, cpubind="cores", quiet=True)
    assert session.OBJECT_OPTIONS >= {"val_data", "metric", "loss", "collate", "optimizer", "lr_schedule"}
    assert not session.OBJECT_OPTIONS & {"model", "data", "epochs", "checkpoint_dir"}


def test_a_name_option_given_an_object_says_its_type_not_its_whole_repr():
    with pytest.raises(PlanError, match=r"^--val-data must name a variable in the notebook, got a Tensor$"):
        TrainPlan(model="m", data="d", val_data=__import__("torch").zeros(10_000))


def test_paths_are_normalised_once_by_the_declaration(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert TrainPlan(model="m", data="d", checkpoint_dir="ck").checkpoint_dir == str(tmp_path / "ck")
    assert RunOptions(progress="text").progress == "text"
    with pytest.raises(PlanError, match="progress must be one of"):
        RunOptions(progress="fancy")


def test_strategies_are_declared_once_and_each_has_its_engine_module():
    from distnb.engine import strategies
    from distnb.core.plan import STRATEGIES

    for name in STRATEGIES:
        assert strategies.strategy_class(name).name == name
    assert _distrain.parser._option_string_actions["--strategy"].metavar == "{" + ",".join(STRATEGIES) + "}"


@pytest.mark.parametrize("last,key,generation,verdict", [
    (None, ("ddp", False), 0, "rebuild"),  # never distributed: build it
    ((("ddp", False), 0), ("ddp", False), 0, "keep"),
    ((("ddp", False), 0), ("ddp", True), 0, "rebuild"),  # DDP wraps the module: wrap it again
    ((("ddp", False), 0), ("ddp", False), 1, "rebuild"),  # a re-formed group: wrap again on the new one
    ((("ddp", False), 0), ("fsdp", False), 0, "resend"),  # another strategy: sent again
    ((("fsdp", False), 0), ("fsdp", False), 0, "keep"),
    ((("fsdp", False), 0), ("fsdp", False), 1, "resend"),  # sharded in place: cannot survive a new group
    ((("pipeline", False, 4), 0), ("pipeline", False, 2), 0, "resend"),
])
def test_one_rule_decides_what_a_live_model_needs(last, key, generation, verdict):
    from distnb.core.plan import redistribution

    assert redistribution(last, key, generation) == verdict


def test_the_train_signature_shows_none_for_every_option_that_carries_over():
    """help(Session.train) showed strategy='ddp' while a left-out --strategy keeps the model's last one."""
    from distnb.core.carryover import CARRIED

    params = inspect.signature(session.Session.train).parameters
    assert params["strategy"].default is None and params["precision"].default is None
    assert all(params[name].default is None for name in CARRIED), [name for name in CARRIED
                                                                   if params[name].default is not None]
    assert params["epochs"].default == 1 and params["nan"].default == "stop"  # settings of one cell: their default
    doc = session.Session.train.__doc__
    assert "strategy : {'ddp', 'fsdp', 'pipeline', 'tensor', 'fsdp+tensor', 'ps'}, optional" in doc
    assert "the model's\n            last one, ddp at first" in doc
    assert "compile : bool, optional" in doc and "the model's last cell's value, 'fp32' at" in doc
    assert options.without_left_out(TrainPlan, {"strategy": None, "lr": None, "epochs": 2}) == {"lr": None,
                                                                                              "epochs": 2}


def test_a_negative_zero_learning_rate_is_zero():
    """lr=-0.0 passes ">= 0" and printed "lr set to -0"."""
    import math

    from distnb.core.plan import TrainPlan

    lr = TrainPlan(model="m", data="d", lr=-0.0).lr
    assert lr == 0.0 and math.copysign(1.0, lr) == 1.0
