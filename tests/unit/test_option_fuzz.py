"""Every magic and option, fuzzed with hypothesis, without a cluster (issue 4, behaviour 7).

The real magics (``DistMagics.dist`` / ``DistMagics.distrain``) run against a real
:class:`~distnb.session.Session` whose cluster is a stand-in that raises ``Reached``
the moment anything would be sent to a rank, started or stopped. So every line and cell
goes through the whole kernel-side path (IPython's argument parsing, the session's checks,
ClusterSpec / TrainPlan validation, the strategy's kernel-side check, name lookups), and
the property is: the call either raises a clear error (IPython's UsageError, or a distnb
error naming the problem) or gets as far as the ranks; never any other exception (a
TypeError, KeyError or AttributeError from deep inside). The same options against the
live cluster are in tests/magics/test_bad_input.py.
"""

from __future__ import annotations

import contextlib
import shlex

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from distnb import session as session_mod
from distnb.core.errors import DistnbError
from distnb.magics import VERBS, DistMagics, _cell, _distrain
from distnb.core.plan import ClusterSpec, TrainPlan


class Reached(Exception):
    """The call passed every kernel-side check and would now reach the ranks."""


class StandInCluster:
    """Enough of distnb.cluster.cluster.Cluster for the kernel-side checks; anything real raises Reached."""

    def __init__(self):
        self.spec = ClusterSpec(num_engines=2, timeout=30.0)
        self.client = object()
        self.engine_ids = [0, 1]
        self.ranks = [dict(rank=r, pid=10_000 + r, host="host", device="cpu", backend="gloo", num_threads=1)
                      for r in range(2)]
        self.master_port = 29_500
        self.pids = {"controller": 9_999, "engines": [10_000, 10_001]}
        self.world_size = 2
        self.num_nodes = 1

    def host_of(self, rank):
        return "host"

    def check_sendable(self, ranks=None):
        """Every rank alive (it reads only the kernel's own records: reaches no rank)."""

    def _reached(self, *args, **kwargs):
        raise Reached()

    apply = apply_all = wait_all = stop = start = reform = signal = dead_ranks = check_alive = _reached


def _namespace():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return {"net": net, "train_ds": torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))),
            "xs": torch.arange(10.0), "empty": torch.empty(0, 4), "number": 3, "text": "abc",
            "lossfn": lambda out, y: out.sum(), "plan_dict": {}, "make_opt": lambda p: torch.optim.SGD(p, lr=0.1)}


@contextlib.contextmanager
def stand_in_session():
    """The magics with a stand-in session as the running one (the real one, if any, is put back)."""
    from IPython.core.interactiveshell import InteractiveShell

    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False  # as the shared shell fixture (tests/conftest.py) makes it
    shell = InteractiveShell.instance(config=config)
    magics = DistMagics(shell=shell)
    saved = session_mod._CURRENT
    fake = session_mod.Session(StandInCluster(), ns=_namespace())
    session_mod._CURRENT = fake
    try:
        yield magics, fake
    finally:
        session_mod._CURRENT = saved


@contextlib.contextmanager
def exporting_from(fake):
    """For ``%dist export``: a training cell of the stand-in session as the last one, a scratch folder as the cwd.

    So that every line is checked against a cell to export (not only "no training cell yet"), and the
    folders the valid ones write land in the scratch folder. The kernel's own last cell is put back.
    """
    import os
    import tempfile

    from distnb.train import record

    saved, cwd = record._LAST[0], os.getcwd()
    cell = record.capture(fake, TrainPlan(model="net", data="train_ds"), BODIES[0], fake.ns["net"],
                          fake.ns["train_ds"])
    cell.start = dict(epoch=0, epoch_samples=0, steps=0, epoch_step=0, exact=True, why="")
    record._LAST[0] = cell
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(cwd)
            record._LAST[0] = saved


def _options(parser):
    return sorted({s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")})


NAMES = ["net", "train_ds", "xs", "empty", "number", "text", "lossfn", "plan_dict", "make_opt", "nosuch", "_x", "1bad",
         "a.b", "x y", "é", ""]
WORDS = ["ddp", "fsdp", "pipeline", "tensor", "ps", "horovod", "DDP", "gpipe", "1f1b", "stop", "ignore", "sgd", "adam",
         "ADAM", "adamw", "auto", "widgets", "text", "none", "gloo", "nccl", "mpi", "fc", "0", "0.fc", "fc.0,,",
         "a,b", ",", "--", "-", "nan", "inf", "-inf", "1e400", "-0", "0x10", "1e-9", "None", "True", "[]", "{}", "'",
         '"', "\\", "~/ckpt", "/dev/null/x"]
VALUES = st.one_of(st.integers(-3, 3).map(str), st.integers(-2**70, 2**70).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(NAMES + WORDS),
                   st.text(max_size=6))
BODIES = ["x, y = batch\nloss = F.cross_entropy(model(x), y)", "", "   ", "x = (", "loss = 1", "pass",
          "for epoch in ctx.epochs():\n    pass", "import torch\nloss = model(batch[0]).sum()", "lossfn(1, 2)"]
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _value_for(draw, action):
    """Mostly a plausible value for an option (of its type, one of its choices, a notebook name), else junk."""
    if not draw(st.integers(0, 4)):
        return draw(VALUES)
    if action.choices and draw(st.booleans()):
        return draw(st.sampled_from(list(action.choices)))
    if action.type is int:
        return str(draw(st.one_of(st.integers(-2, 4), st.integers(-3, 70_000))))
    if action.type is float:
        return repr(draw(st.one_of(st.sampled_from([0.0, -1.0, 1e-3, 0.1, float("nan"), float("inf")]),
                                   st.floats(-1e3, 1e3))))
    return draw(st.sampled_from(NAMES + WORDS))


@st.composite
def _tokens(draw, parser, junk=True):
    """A command line for ``parser``: a few of its options with mostly plausible values, and its positionals.

    Now and then a value or a positional is missing, or a junk token is slipped in.
    """
    options = [a for a in parser._actions if a.option_strings and "-h" not in a.option_strings]
    chosen = draw(st.lists(st.sampled_from(options), max_size=4, unique_by=id)) if options else []
    tokens = []
    for action in parser._actions:
        if action.option_strings:
            continue
        count = {"+": draw(st.integers(1, 3)), "?": draw(st.integers(0, 1))}.get(action.nargs, 1)
        if not draw(st.integers(0, 9)):
            count = 0  # sometimes missing
        tokens += [draw(st.sampled_from(NAMES)) for _ in range(count)]
    for action in chosen:
        tokens.append(draw(st.sampled_from(action.option_strings)))
        if action.nargs != 0 and draw(st.integers(0, 9)):  # sometimes the value is missing
            tokens.append(_value_for(draw, action))
    if junk and not draw(st.integers(0, 5)):
        junk_token = draw(st.one_of(st.sampled_from(["--bogus", "-z", "---", "-"]), VALUES))
        tokens.insert(draw(st.integers(0, len(tokens))), junk_token)
    return tokens


def _call(fn, *args):
    """Run a magic; return what it raised (None, Reached, a UsageError or a distnb error) or fail."""
    try:
        fn(*args)
    except Reached:
        return Reached
    except (UsageError, DistnbError) as exc:
        assert str(exc).strip(), f"an empty error message from {args!r}"
        assert "Traceback" not in str(exc)
        return type(exc)
    except SystemExit as exc:  # argparse's own exit (e.g. on an empty -h)
        pytest.fail(f"SystemExit({exc.code}) from {args!r}")
    return None


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_dist_verb_gives_a_clear_error_or_reaches_the_ranks(verb):
    parser = VERBS[verb].parser

    @SETTINGS
    @given(tokens=_tokens(parser))
    def check(tokens):
        if verb in ("stop", "restart", "status") and not tokens:
            tokens = ["--bogus"]
        with stand_in_session() as (magics, fake):
            with exporting_from(fake) if verb == "export" else contextlib.nullcontext():
                _call(magics.dist, f"{verb} {shlex.join(tokens)}")

    check()


@SETTINGS
@given(tokens=_tokens(_cell.parser), body=st.sampled_from(BODIES))
def test_dist_cell_gives_a_clear_error_or_reaches_the_ranks(tokens, body):
    with stand_in_session() as (magics, _):
        _call(magics.dist, shlex.join(tokens), body)


@settings(SETTINGS, max_examples=300)
@given(tokens=_tokens(_distrain.parser), model=st.sampled_from(["net"] * 4 + NAMES),
       data=st.sampled_from(["train_ds"] * 4 + NAMES), body=st.sampled_from(BODIES[:1] * 4 + BODIES))
def test_distrain_gives_a_clear_error_or_reaches_the_ranks(tokens, model, data, body):
    if "--background" in tokens:  # runs the same checks in a thread; the foreground path is what is fuzzed
        tokens = [t for t in tokens if t != "--background"]
    if "--model" not in tokens and "--data" not in tokens:
        tokens = ["--model", model, "--data", data, *tokens]
    with stand_in_session() as (magics, _):
        _call(magics.distrain, shlex.join(tokens), body)


def test_a_valid_training_line_reaches_the_ranks():
    # the property above is not vacuous: a good line passes every kernel-side check
    with stand_in_session() as (magics, _):
        assert _call(magics.distrain, "--model net --data train_ds --epochs 2 --lr 0.1 --optimizer adam",
                     BODIES[0]) is Reached
        assert _call(magics.dist, "pull xs --rank 1") is Reached
        assert _call(magics.dist, "", "print(rank)") is Reached


integers = st.one_of(st.integers(-5, 5), st.integers(-2**64, 2**64), st.none(), st.booleans(), st.floats(),
                     st.text(max_size=3))
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10), st.none(), st.booleans(),
                    st.text(max_size=3))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(num_engines=integers, backend=st.one_of(st.sampled_from(["gloo", "nccl", "mpi", ""]), st.none(), integers),
       timeout=numbers, master_port=integers)
def test_cluster_spec_is_valid_or_a_plan_error(num_engines, backend, timeout, master_port):
    from distnb.core.errors import PlanError

    try:
        spec = ClusterSpec(num_engines=num_engines, backend=backend, timeout=timeout, master_port=master_port)
    except PlanError as exc:
        assert str(exc)
        return
    assert isinstance(spec.num_engines, int) and spec.num_engines >= 1 and spec.backend in ("gloo", "nccl")
    assert spec.master_port is None or 1 <= spec.master_port <= 65535
    from distnb.core.plan import MAX_TIMEOUT

    assert 1 <= spec.timeout <= MAX_TIMEOUT


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(fields=st.dictionaries(st.sampled_from(["epochs", "batch_size", "optimizer", "lr", "seed", "strategy", "reset",
                                               "target_loss", "loop", "drop_last", "nan", "fsdp_units", "split",
                                               "microbatches", "schedule", "loss", "tp_plan", "servers", "staleness",
                                               "report_interval"]),
                              st.one_of(integers, numbers, st.sampled_from(WORDS + NAMES), st.lists(st.text(max_size=3),
                                                                                                   max_size=3))))
def test_train_plan_is_valid_or_a_plan_error(fields):
    from distnb.core.errors import PlanError

    try:
        plan = TrainPlan(model="net", data="train_ds", **fields)
    except PlanError as exc:
        assert str(exc)
        return
    assert TrainPlan.from_dict(plan.to_dict()) == plan  # what travels to the ranks is the same plan


def test_master_port_0_is_a_free_port_and_unpins_one_given_before():
    # %dist restart keeps the running options not given: --master-port 0 is how a pinned port is let go
    from distnb.cluster.defaults import default_spec

    pinned = default_spec(n=2, master_port=29_511)
    assert pinned.master_port == 29_511
    kept = dict(n=2, master_port=pinned.master_port)
    assert default_spec(**dict(kept, master_port=0)).master_port is None  # as Session.restart merges them
    assert ClusterSpec(num_engines=2, master_port=0).master_port is None
