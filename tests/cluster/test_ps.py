"""--strategy ps (parameter server) on the real 2-rank cluster.

Synchronous updates must equal one process trained on the global batch (the union of the
ranks' batches) to 1e-5, with SGD and Adam, one or two servers, across two cells (the
servers' optimizer state is kept). With --staleness the updates are asynchronous (Stale
Synchronous Parallel): training must still converge on scikit-learn's digits, every pushed
gradient must be applied, and the weights loaded back must equal every rank's state.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.core.errors import PlanError, RankError
from support.data import digits_split, mlp, parity_data as make_data, parity_model as make_model
from support.cells import interrupted
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"

TOL = dict(atol=1e-5, rtol=1e-5)


def model_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def ranks_params(dist_session, name):
    """Each rank's parameters as one flat tensor."""
    dist_session.run(f"import torch\n_flat = torch.cat([p.detach().flatten() for p in {name}.parameters()])")
    return dist_session.pull("_flat")


def assert_weights_back(dist_session, kernel_model, name):
    """The kernel's model equals every rank's parameters (all ranks hold the servers' values)."""
    kernel = torch.cat([p.detach().flatten() for p in kernel_model.parameters()])
    for flat in ranks_params(dist_session, name):
        assert torch.equal(flat, kernel)


@pytest.mark.parametrize("optimizer,opt_cls,lr,servers", [("sgd", torch.optim.SGD, 0.1, 1),
                                                           ("adam", torch.optim.Adam, 0.01, 1),
                                                           ("adam", torch.optim.Adam, 0.01, 2)])
def test_sync_matches_single_process_with_global_batch(dist_session, shell, optimizer, opt_cls, lr, servers):
    ns = shell.user_ns
    name = f"ps_{optimizer}_{servers}"
    ns[name], ns["ps_data"], ns["F"] = make_model(), make_data(), F
    ref = make_model()
    ref_opt = opt_cls(ref.parameters(), lr=lr)

    result = dist_session.train(BODY, model=name, data="ps_data", epochs=2, batch_size=16, optimizer=optimizer,
                                lr=lr, seed=4, strategy="ps", servers=servers, progress="none", quiet=True)
    reference(ref, ns["ps_data"], num_shards=2, batch_size=16, epochs=2, seed=4, optimizer=ref_opt)
    assert [row["steps"] for row in result.rows] == [14, 14]  # ceil(ceil(203 / 2) / 16) = 7 per epoch
    for p, p_ref in zip(ns[name].parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL)
    assert_weights_back(dist_session, ns[name], name)

    rows = result.rows
    assert [row["role"] for row in rows] == ["server", "server" if servers == 2 else "worker"]
    total = model_bytes(ns[name])
    assert sum(row["server_param_bytes"] for row in rows) == total
    assert all(row["param_bytes"] == total for row in rows)  # each rank computes on a full replica
    if servers == 1:
        assert rows[1]["server_param_bytes"] == 0 and rows[1]["server_updates"] == 0
    assert [row["server_updates"] for row in rows if row["role"] == "server"] == [14] * servers
    if optimizer == "adam":  # exp_avg and exp_avg_sq of the served parameters, only on the servers
        for row in rows:
            assert 2 * row["server_param_bytes"] <= row["optimizer_state_bytes"] <= 2 * row["server_param_bytes"] + 64
    for row in rows:
        assert isinstance(row["server_wait_seconds"], float) and 0 <= row["server_wait_seconds"] < row["seconds"]
        assert row["steps_ahead_max"] == 0

    # a second cell continues: the servers keep their optimizer state; a new --lr reaches them
    result2 = dist_session.train(BODY, model=name, data="ps_data", epochs=1, batch_size=16, optimizer=optimizer,
                                 lr=lr / 2, seed=4, strategy="ps", servers=servers, progress="none", quiet=True)
    assert result2.epochs == [2]
    assert [row["server_updates"] for row in result2.rows if row["role"] == "server"] == [7] * servers
    for group in ref_opt.param_groups:
        group["lr"] = lr / 2
    reference(ref, ns["ps_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=ref_opt, first_epoch=2)
    for p, p_ref in zip(ns[name].parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL)
    assert_weights_back(dist_session, ns[name], name)


LOOP_BODY = """
for epoch in ctx.epochs():
    for x, y in ctx.loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        ctx.report(loss)
"""


def test_loop_body_steps_through_the_servers(dist_session, shell):
    """With --loop the body's own optimizer.step() is the exchange: still the global-batch result."""
    ns = shell.user_ns
    ns["ps_loop_net"], ns["ps_data"], ns["F"] = make_model(), make_data(), F
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    result = dist_session.train(LOOP_BODY, model="ps_loop_net", data="ps_data", epochs=1, batch_size=16,
                                optimizer="sgd", lr=0.1, seed=4, loop=True, strategy="ps", servers=2,
                                progress="none", quiet=True)
    reference(ref, ns["ps_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=ref_opt)
    assert [row["server_updates"] for row in result.rows] == [7, 7]
    assert result.optimizer_steps == result.rows[0]["steps"]  # the body's steps, not also the servers' own
    for p, p_ref in zip(ns["ps_loop_net"].parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL)
    assert_weights_back(dist_session, ns["ps_loop_net"], "ps_loop_net")


def accuracy(model, test):
    x, y = test
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def test_staleness_converges_on_digits_and_applies_every_push(dist_session, shell):
    ns = shell.user_ns
    train, test = digits_split()
    ns["ps_digits_net"] = mlp(64, 64, 10, seed=0, activation=nn.ReLU)
    ns["ps_digits"], ns["F"] = train, F
    before = accuracy(ns["ps_digits_net"], test)

    options = dict(model="ps_digits_net", data="ps_digits", batch_size=32, optimizer="sgd", lr=0.2,
                   strategy="ps", servers=2, staleness=2, progress="none", quiet=True)
    result = dist_session.train(BODY, epochs=12, **options)
    acc = accuracy(ns["ps_digits_net"], test)
    assert before < 0.3 and acc > 0.9, (before, acc)
    steps = 12 * 22  # ceil(700 / 32) per epoch
    for row in result.rows:
        assert row["steps"] == steps and row["role"] == "server"
        assert isinstance(row["server_wait_seconds"], float) and 0 <= row["server_wait_seconds"] < row["seconds"]
        assert row["steps_ahead_max"] == 2  # each rank pushes to the other's server without waiting, 2 at most
        assert row["server_updates"] == 2 * steps  # every push of both workers was applied
        assert row["param_bytes"] == model_bytes(ns["ps_digits_net"]) + row["server_param_bytes"]  # replica + copy
    assert result.epoch_losses[-1] < result.epoch_losses[0]
    assert_weights_back(dist_session, ns["ps_digits_net"], "ps_digits_net")

    # a second cell continues from the servers' state and optimizer
    result2 = dist_session.train(BODY, epochs=1, **options)
    assert result2.epochs == [12] and result2.epoch_losses[0] < result.epoch_losses[0]
    assert [row["server_updates"] for row in result2.rows] == [2 * 22, 2 * 22]
    assert accuracy(ns["ps_digits_net"], test) > 0.9
    assert_weights_back(dist_session, ns["ps_digits_net"], "ps_digits_net")


def test_async_sgd_with_small_steps_stays_close_to_sync(dist_session, shell):
    """Stale gradients differ from fresh ones by O(lr): the asynchronous result must agree with
    the synchronous one to first order (every push applied, divided by world_size, to the right
    parameters), whatever order the pushes arrived in."""
    ns = shell.user_ns
    ns["ps_data"], ns["F"] = make_data(), F
    init = make_model()
    flats = {}
    for servers, staleness in [(1, 0), (2, 2), (1, 1)]:
        name = f"ps_close_{servers}_{staleness}"
        ns[name] = make_model()
        dist_session.train(BODY, model=name, data="ps_data", epochs=3, batch_size=16, optimizer="sgd", lr=0.02,
                           strategy="ps", servers=servers, staleness=staleness, progress="none", quiet=True)
        flats[servers, staleness] = torch.cat([p.detach().flatten() for p in ns[name].parameters()])
    sync = flats[1, 0]
    moved = (sync - torch.cat([p.detach().flatten() for p in init.parameters()])).norm()
    for key in [(2, 2), (1, 1)]:
        diff = (flats[key] - sync).norm()
        assert diff < 0.05 * moved, (key, diff.item(), moved.item())


def test_bad_options_error_before_anything_runs(dist_session, shell):
    ns = shell.user_ns
    ns["ps_bad_net"], ns["ps_one_tensor"], ns["ps_data"] = make_model(), nn.Linear(12, 3, bias=False), make_data()
    with pytest.raises(PlanError, match=r"--strategy ps: --servers 3 needs 3 ranks but the cluster has 2: servers "
                                        r"are ranks 0..2 .*use --servers 2 or fewer"):
        dist_session.train(BODY, model="ps_bad_net", data="ps_data", strategy="ps", servers=3, progress="none",
                           quiet=True)
    with pytest.raises(PlanError, match=r"--servers 2: Linear has only 1 trainable parameter tensor and each "
                                        r"server holds whole tensors; use --servers 1 or fewer"):
        dist_session.train(BODY, model="ps_one_tensor", data="ps_data", strategy="ps", servers=2, progress="none",
                           quiet=True)
    with pytest.raises(PlanError, match=r"--staleness is a --strategy ps option \(this cell uses --strategy ddp\)"):
        dist_session.train(BODY, model="ps_bad_net", data="ps_data", staleness=1, progress="none", quiet=True)
    dist_session.run("from distnb.engine.train import loop\n_sent = [n for n in ('ps_bad_net', 'ps_one_tensor') "
                     "if n in loop.RUNS]")
    assert dist_session.pull("_sent") == [[], []]


def test_failure_during_async_cell_then_next_cell_works(dist_session, shell):
    ns = shell.user_ns
    ns["ps_fail_net"], ns["ps_data"], ns["F"] = make_model(), make_data(), F
    options = dict(model="ps_fail_net", data="ps_data", batch_size=16, strategy="ps", staleness=1,
                   progress="none", quiet=True)
    body = "x, y = batch\nif rank == 1 and ctx.step == 3:\n    raise KeyError('broken batch')\n" + BODY
    with pytest.raises(RankError, match="broken batch") as info:
        dist_session.train(body, **options)
    assert info.value.rank == 1
    result = dist_session.train(BODY, epochs=1, **options)
    assert [row["steps"] for row in result.rows] == [7, 7]
    assert_weights_back(dist_session, ns["ps_fail_net"], "ps_fail_net")


def test_interrupt_drains_the_async_exchange(dist_session, shell):
    """An interrupt stops every rank after the same step; the exchange is drained, so every
    rank and the kernel hold the servers' values, and the next cell runs."""
    import os
    import signal
    import threading

    ns = shell.user_ns
    ns["ps_int_net"], ns["ps_data"], ns["F"] = make_model(), make_data(), F
    options = dict(model="ps_int_net", data="ps_data", batch_size=4, strategy="ps", servers=2, staleness=2,
                   progress="none", quiet=True)
    dist_session.train(BODY, epochs=1, **options)  # sends the model and data
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        stopped = interrupted(dist_session.train, BODY, epochs=10_000, **options).result
    finally:
        timer.cancel()
    assert stopped.interrupted and "every rank stopped after the same step" in stopped.interrupted_message
    assert_weights_back(dist_session, ns["ps_int_net"], "ps_int_net")
    result = dist_session.train(BODY, epochs=1, **options)
    assert all(row["server_updates"] == 2 * row["steps"] > 0 for row in result.rows)  # both workers' pushes
    assert_weights_back(dist_session, ns["ps_int_net"], "ps_int_net")


OPT_STATE = """
import torch
from distnb.engine.train import loop
_opt = {{i: {{k: v.clone() for k, v in s.items()}} for i, s in
         loop.RUNS['{name}'].optimizer.inner.state_dict()['state'].items()}}
"""


def test_checkpoint_of_an_async_run_restores_every_server(dist_session, shell, tmp_path):
    """Each server saves the values it serves and its optimizer state; loading restores both
    and hands every rank the servers' values."""
    ns = shell.user_ns
    ns["ps_ckpt_net"], ns["ps_data"], ns["F"] = make_model(), make_data(), F
    options = dict(model="ps_ckpt_net", data="ps_data", batch_size=16, strategy="ps", servers=2, staleness=1,
                   progress="none", quiet=True)
    dist_session.train(BODY, epochs=1, optimizer="adam", lr=0.01, **options)
    dist_session.save(str(tmp_path), model="ps_ckpt_net", quiet=True)
    saved = torch.cat([p.detach().flatten() for p in ns["ps_ckpt_net"].parameters()]).clone()
    dist_session.run(OPT_STATE.format(name="ps_ckpt_net"))
    saved_opt = dist_session.pull("_opt")
    assert all(len(state) > 0 for state in saved_opt)  # Adam moments on both servers

    dist_session.train(BODY, epochs=1, lr=0.5, **options)  # wander off
    dist_session.load(str(tmp_path), model="ps_ckpt_net", quiet=True)
    assert torch.equal(torch.cat([p.detach().flatten() for p in ns["ps_ckpt_net"].parameters()]), saved)
    for flat in ranks_params(dist_session, "ps_ckpt_net"):
        assert torch.equal(flat, saved)
    dist_session.run(OPT_STATE.format(name="ps_ckpt_net"))
    for got, want in zip(dist_session.pull("_opt"), saved_opt):
        assert got.keys() == want.keys()
        for i in want:
            for k in want[i]:
                assert torch.equal(got[i][k], want[i][k]), (i, k)
    # checkpoints in the middle of an asynchronous cell (the server threads keep applying pushes)
    result = dist_session.train(BODY, epochs=1, checkpoint_dir=str(tmp_path / "every"), checkpoint_every=3,
                                **options)
    assert all(row["server_updates"] == 2 * row["steps"] > 0 for row in result.rows)
    # global steps 9 and 12 (7 restored, 7 more), and the cell's last step, 14
    assert [os.path.basename(p) for p in result.rows[0]["checkpoints"]] == ["step_00000009", "step_00000012",
                                                                          "step_00000014"]
    assert_weights_back(dist_session, ns["ps_ckpt_net"], "ps_ckpt_net")


def test_the_ps_group_ends_with_the_world_when_a_rank_fails(dist_session, shell):
    """The ps group's gloo connections are armed with the world's (engine/abort.py ``tracking``): an
    announced failure shuts them too, so a rank waiting in a ps collective stops at once."""
    ns = shell.user_ns
    ns["ps_armed_net"], ns["ps_data"], ns["F"] = make_model(), make_data(), F
    options = dict(model="ps_armed_net", data="ps_data", batch_size=16, strategy="ps", progress="none", quiet=True)
    dist_session.train(BODY, epochs=1, **options)
    dist_session.run("from distnb.engine.process import abort\n_armed = len(abort.ARMED.sockets)")
    # one listener and world_size - 1 peer connections for each of the two groups (world and ps)
    assert dist_session.pull("_armed") == [2 * dist_session.world_size] * dist_session.world_size
    body = "x, y = batch\nif rank == 1 and ctx.step == 2:\n    raise KeyError('broken batch')\n" + BODY
    with pytest.raises(RankError, match="broken batch") as info:
        dist_session.train(body, **options)
    assert info.value.rank == 1
    assert {f["rank"]: f["ename"] for f in info.value.failures}[0] == "PeerFailed"
