"""engine/stepping.py's pieces without processes: histories, schedules, the norm; the dashboard's step figures."""

import math

import pytest
import torch

from distnb.display import ProgressState
from distnb.display import render
from distnb.engine.train import stepping
from distnb.core.plan import TrainPlan
from distnb.core.errors import PlanError


def test_history_is_bounded_and_keeps_the_mean():
    h = stepping.History(cap=10)
    for s in range(1, 1001):
        h.add(s, float(s))
    pts = h.points()
    assert len(pts) <= 20 + 1
    assert math.isclose(sum(v for _, v in pts[:-1]) / len(pts[:-1]), sum(range(1, 1001)) / 1000, rel_tol=0.05)
    assert pts[0][0] == 1 or pts[0][0] < 100


def test_a_low_precision_loss_history_is_averaged_in_fp32():
    # a GPU rank's bf16 losses were kept as bf16 tensors and their pairs averaged in bf16 (36.875 became 36.75)
    history = stepping.History(cap=1)
    for step, value in enumerate((36.75, 37.0, 36.75, 36.75, 37.0)):
        history.add(step, torch.tensor(value, dtype=torch.bfloat16))
    assert [v for _, v in history.points()] == [36.875, 36.875]  # pairs averaged: both 36.75 in bf16
    assert all(v.dtype == torch.float32 for v in history.values)
    assert stepping.upcast(torch.tensor(1.0, dtype=torch.float16)).dtype == torch.float32
    assert stepping.upcast(torch.tensor(1.0, dtype=torch.float64)).dtype == torch.float64
    assert stepping.upcast(2.5) == 2.5


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedules_warm_up_then_follow_their_shape(kind):
    lrs = stepping.lr_sequence(kind, 1.0, 4, 20)
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8]) and lrs[4] == pytest.approx(1.0)
    if kind == "constant":
        assert lrs[4:] == pytest.approx([1.0] * 16)
    else:
        assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] < 0.2
    f = stepping.Schedule(kind, 4, 20)
    assert f(100) == (1.0 if kind == "constant" else pytest.approx(0.0, abs=1e-12))


def test_total_norm_equals_torch_clip_grad_norm_on_one_process():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    net(torch.randn(3, 5)).sum().backward()
    mine = float(stepping.total_norm(list(net.parameters()), False, torch.device("cpu")))
    assert mine == pytest.approx(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)), rel=1e-6)


def test_stepper_groups_micro_steps_per_epoch():
    plan = TrainPlan(model="m", data="d", accumulate=4)

    class Run:
        strategy = optimizer = scaler = scheduler = None
        optimizer_steps = 0

    st = stepping.Stepper(plan, Run(), 10, torch.device("cpu"))
    assert [st.position(i, 10) for i in (0, 3, 4, 8, 9)] == [(True, False, 4), (False, True, 4), (True, False, 4),
                                                             (True, False, 2), (False, True, 2)]
    assert st.position(2, 3) == (False, True, 3)  # an epoch resumed with 3 batches left: one group of 3
    assert stepping.Stepper.groups_per_epoch(10, 4) == 3
    assert [st.at_boundary(n, 10) for n in (1, 4, 9, 10)] == [False, True, False, True]


def test_stepper_weights_each_micro_step_by_its_share_of_the_group_s_samples():
    plan = TrainPlan(model="m", data="d", accumulate=2, batch_size=8)

    class Run:
        strategy = optimizer = scaler = scheduler = None
        optimizer_steps = 0

    st = stepping.Stepper(plan, Run(), 4, torch.device("cpu"))
    assert [st.share(i, 4, 32) for i in range(4)] == [0.5] * 4  # full batches: 1 / group size
    assert [st.share(i, 4, 27) for i in range(4)] == [0.5, 0.5, 8 / 11, 3 / 11]  # the last batch holds 3
    assert st.share(2, 3, 19) == 1.0  # the short batch alone in its group
    assert [st.share(i, 4, None) for i in range(4)] == [0.5] * 4  # a stream: sizes not known ahead


def test_plan_rules_of_the_step_options():
    with pytest.raises(PlanError, match="--restore-best needs validation"):
        TrainPlan(model="m", data="d", restore_best=True)
    with pytest.raises(PlanError, match="is the training set"):
        TrainPlan(model="m", data="d", val_data="d")
    with pytest.raises(PlanError, match="--warmup-steps is for the built-in schedules"):
        TrainPlan(model="m", data="d", lr_schedule="mine", warmup_steps=3)
    with pytest.raises(PlanError, match="--clip-grad-norm is not available with --strategy ps"):
        TrainPlan(model="m", data="d", clip_grad_norm=1.0, strategy="ps")
    assert TrainPlan(model="m", data="d", lr_schedule="COSINE").lr_schedule == "cosine"


def test_dashboard_shows_lr_optimizer_steps_and_a_validation_curve():
    st = ProgressState(2, 20, 2)
    for rank in (0, 1):
        st.update(rank, dict(rank=rank, status="running", step=8, total=20, loss=0.5, points=[(8, 0.5)], opt_step=2,
                             lr=0.01, grad_norm=1.5, epoch_losses=[(0, 0.6)], val_points=[(8, 0.7, 0.8)],
                             metric_name="accuracy"))
    html = render.dashboard_html(st)
    assert "class='distnb-validation'" in html and "distnb-val-loss" in html
    assert "optimizer step 2 (8 micro-steps)" in html and "lr 0.01" in html and "accuracy 0.8000" in html
