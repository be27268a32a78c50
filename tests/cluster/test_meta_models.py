"""Models built on the meta device in the notebook, on the real 2-rank cluster (engine/materialize.py).

The ranks receive the structure only, materialise what they hold and initialise it module by module
from the notebook's generator state: the weights must equal a one-process build after the same
``torch.manual_seed`` (to 1e-6), and training must then equal one process trained on the same batches.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.core import calls
from distnb.core.errors import PlanError
from distnb.core.plan import TrainPlan
from distnb.train import bigmodels
from support.data import parity_data
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
SEED = 7


def make():
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def built(meta: bool):
    torch.manual_seed(SEED)
    if not meta:
        return make()
    with torch.device("meta"):
        return make()


# every rank: its tensors as full ones (a collective for DTensors), leaving out those it does not hold
PULL = """
import torch
from torch.distributed.tensor import DTensor
_held = {{n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
          for n, t in {name}.state_dict(keep_vars=True).items()}}
_held = {{n: t for n, t in _held.items() if not t.is_meta}}
"""


def ranks_weights(dist_session, name):
    """The model's full weights as the ranks hold them (a pipeline stage gives its own)."""
    dist_session.run(PULL.format(name=name))
    merged = {}
    for held in dist_session.pull("_held"):
        for key, t in held.items():
            if key in merged:
                assert torch.equal(merged[key], t), f"{key} differs between ranks"
            merged[key] = t
    return merged


def assert_weights(got, ref, atol=1e-6):
    want = ref.state_dict()
    assert set(got) == set(want)
    for key, t in want.items():
        torch.testing.assert_close(got[key], t, atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("strategy", ["fsdp", "tensor", "pipeline", "ddp", "fsdp+tensor"])
def test_meta_model_is_initialised_as_one_process_builds_it(dist_session, shell, capsys, strategy):
    ns = shell.user_ns
    name = f"meta_{strategy.replace('+', '_')}"
    ns["meta_data"], ns["F"] = parity_data(), F
    ref = built(meta=False)
    ns[name] = built(meta=True)
    opts = dict(mesh="1x2") if strategy == "fsdp+tensor" else {}
    dist_session.train(BODY, model=name, data="meta_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.0, seed=4,
                       strategy=strategy, progress="none", **opts)
    out = capsys.readouterr().out
    assert f"{name} is on the meta device in the notebook, so its weights stay on the ranks" in out
    assert all(p.is_meta for p in ns[name].parameters())  # the notebook's model stays on meta
    assert_weights(ranks_weights(dist_session, name), ref)


def test_meta_model_trains_under_fsdp_as_one_process(dist_session, shell):
    ns = shell.user_ns
    ns["meta_data"], ns["F"] = parity_data(), F
    ref = built(meta=False)
    ns["meta_train"] = built(meta=True)
    dist_session.train(BODY, model="meta_train", data="meta_data", epochs=2, batch_size=16, optimizer="sgd", lr=0.1,
                       seed=4, strategy="fsdp", progress="none", quiet=True)
    reference(ref, ns["meta_data"], num_shards=2, batch_size=16, epochs=2, seed=4, optimizer=torch.optim.SGD, lr=0.1)
    assert_weights(ranks_weights(dist_session, "meta_train"), ref, atol=1e-5)
    # the next cell goes on with the live model: nothing is sent again, training continues
    r = dist_session.train(BODY, model="meta_train", data="meta_data", epochs=1, batch_size=16, seed=4,
                           strategy="fsdp", progress="none", quiet=True)
    assert r.epochs == [2]
    reference(ref, ns["meta_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=torch.optim.SGD, lr=0.1,
              first_epoch=2)
    assert_weights(ranks_weights(dist_session, "meta_train"), ref, atol=1e-5)


# defined in the notebook (__main__), so that they travel to the ranks by value
NOTEBOOK = """
import torch
import torch.nn as nn

class Scale(nn.Module):
    \"\"\"A module holding a parameter of its own, without reset_parameters.\"\"\"

    def __init__(self, n):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(n))

    def forward(self, x):
        return x * self.gain

def init_weights(module):
    \"\"\"An --init function: every module's own tensors.\"\"\"
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.1)
        nn.init.zeros_(module.bias)
    elif isinstance(module, Scale):
        nn.init.uniform_(module.gain, 0.5, 1.5)
"""


def notebook_defs(shell):
    assert shell.run_cell(NOTEBOOK).success
    return shell.user_ns["Scale"], shell.user_ns["init_weights"]


def test_a_module_without_reset_parameters_is_named_before_anything_is_sent(dist_session, shell):
    ns = shell.user_ns
    ns["meta_data"], ns["F"] = parity_data(), F
    Scale, _ = notebook_defs(shell)
    with torch.device("meta"):
        ns["meta_noreset"] = nn.Sequential(nn.Linear(12, 8), Scale(8), nn.Linear(8, 3))
    with pytest.raises(PlanError, match=r"its module 1 \(Scale\) has no reset_parameters\(\).*--init FN"):
        dist_session.train(BODY, model="meta_noreset", data="meta_data", epochs=1, batch_size=16,
                           strategy="fsdp", progress="none", quiet=True)
    assert "meta_noreset" not in dist_session.holdings.models


HALF_INIT = """
import torch
import torch.nn as nn

class HalfInit(nn.Linear):
    \"\"\"reset_parameters initialises the weight and bias, not the running buffer it also holds.\"\"\"

    def __init__(self, n, m):
        super().__init__(n, m)
        self.register_buffer("running", torch.empty(m))
"""


def test_a_meta_model_that_fails_to_initialise_leaves_nothing_to_pull_or_save(dist_session, shell, tmp_path):
    """The ranks refuse it (a tensor left uninitialised); then %dist pull returned that uninitialised memory (values
    up to 1e38, no error: found by a fresh user) while %dist save said it was not on the ranks."""
    from distnb.core.errors import RankError

    assert shell.run_cell(HALF_INIT).success
    ns = shell.user_ns
    ns["meta_data"], ns["F"] = parity_data(), F
    with torch.device("meta"):
        ns["meta_half"] = nn.Sequential(ns["HalfInit"](12, 8), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(RankError, match=r"left 0\.running uninitialised"):
        dist_session.train(BODY, model="meta_half", data="meta_data", epochs=1, batch_size=16, strategy="fsdp",
                           progress="none", quiet=True)
    with pytest.raises((PlanError, RankError), match="meta_half"):
        dist_session.pull("meta_half.0.weight")
    with pytest.raises(PlanError, match="meta_half is not on the ranks"):
        dist_session.save(str(tmp_path / "ckpt"), model="meta_half")
    ns["meta_half"] = built(meta=True)  # the next cell works
    dist_session.train(BODY, model="meta_half", data="meta_data", epochs=1, batch_size=16, strategy="fsdp",
                       progress="none", quiet=True)


def test_init_function_initialises_every_module_as_one_process(dist_session, shell):
    ns = shell.user_ns
    ns["meta_data"], ns["F"] = parity_data(), F
    Scale, init_weights = notebook_defs(shell)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        ref = nn.Sequential(nn.Linear(12, 8), Scale(8), nn.Linear(8, 3))
    ref.to_empty(device="cpu")
    for module in ref.modules():  # what --init does: each module holding tensors itself, in named_modules() order
        if list(module.parameters(recurse=False)) or list(module.buffers(recurse=False)):
            init_weights(module)
    torch.manual_seed(SEED)  # the ranks start from the generator's state when the cell sends the model
    with torch.device("meta"):
        ns["meta_init"] = nn.Sequential(nn.Linear(12, 8), Scale(8), nn.Linear(8, 3))
    dist_session.train(BODY, model="meta_init", data="meta_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.0,
                       seed=4, strategy="fsdp", init="init_weights", progress="none", quiet=True)
    assert_weights(ranks_weights(dist_session, "meta_init"), ref)


@pytest.mark.parametrize("strategy,need", [("ddp", r"each rank would need 88\.\d\d GiB for the model \(44\.\d\d GiB\), "
                                                   r"its gradients \(44\.\d\d GiB\) and sgd's state \(none\): ddp keeps"),
                                           ("fsdp", r"each rank would need 132\.\d\d GiB for 44\.\d\d GiB as 1/2 of the "
                                                    r"model \(44\.\d\d GiB\), its gradients \(44\.\d\d GiB\) and sgd's "
                                                    r"state \(none\), plus its largest FSDP unit gathered whole with its "
                                                    r"gradient \(88\.\d\d GiB\)")])
def test_a_meta_model_too_big_for_the_ranks_is_refused_before_anything_is_sent(dist_session, shell, strategy, need):
    ns = shell.user_ns
    ns["meta_data"], ns["F"] = parity_data(), F
    with torch.device("meta"):  # 44 GiB of fp32: more than this machine has, held by no one
        ns["meta_huge"] = nn.Sequential(nn.Linear(12, 109_000), nn.Linear(109_000, 109_000), nn.Linear(109_000, 3))
    with pytest.raises(PlanError, match=rf"--strategy {strategy} cannot fit meta_huge .*{need}.*rank 0 has"):
        dist_session.train(BODY, model="meta_huge", data="meta_data", epochs=1, batch_size=16, strategy=strategy,
                           progress="none", quiet=True)
    assert "meta_huge" not in dist_session.holdings.models


def tightest_room(dist_session) -> int:
    """The smallest room of a rank as the fit check counts it, asked of the ranks now: its own (a GPU, a memory
    cgroup) or its host's available memory shared by the ranks on that host."""
    cluster = dist_session.cluster
    rooms = cluster.wait_all(cluster.apply_all(calls.capacity), timeout=60, what="asking the ranks' free memory")
    per_host = {h: sum(r["host"] == h for r in rooms) for h in {r["host"] for r in rooms}}
    return min(r["bytes"] if r["scope"] == "rank" else r["bytes"] // per_host[r["host"]] for r in rooms)


def meta_stack(nbytes):
    """Bias-free Linear(4096, 4096) layers (64 MiB each) on the meta device, about ``nbytes`` in all."""
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(max(1, round(nbytes / (64 << 20))))))


@pytest.mark.parametrize("optimizer,share", [("sgd", 0.7), ("adam", 0.35)])
def test_ddp_refuses_a_meta_model_whose_training_state_outgrows_the_ranks(dist_session, shell, optimizer, share):
    """Sized from the ranks' real free memory: the weights alone fit (0.7 or 0.35 of the tightest rank's room),
    the weights with their gradients (DDP's buckets), and Adam's two moments, do not (1.4 of it). The check
    itself runs first, so a check that let it through fails here without anything sent or trained."""
    ns = shell.user_ns
    ns["meta_data"], ns["F"] = parity_data(), F
    name = f"meta_ddp_{optimizer}"
    ns[name] = meta_stack(share * tightest_room(dist_session))
    plan = TrainPlan(model=name, data="meta_data", strategy="ddp", optimizer=optimizer)
    if optimizer == "adam":  # with sgd it fits: no gradient to keep beyond the weights' size
        bigmodels.check_before_sending(dist_session, TrainPlan(model=name, data="meta_data", strategy="ddp",
                                                               optimizer="sgd"), ns[name])
    want = rf"--strategy ddp cannot fit {name} .*its gradients .* and {optimizer}'s state .*, and rank \d has"
    with pytest.raises(PlanError, match=want):
        bigmodels.check_before_sending(dist_session, plan, ns[name])
    with pytest.raises(PlanError, match=want):
        dist_session.train("loss = model(batch[0]).pow(2).mean()", model=name, data="meta_data", epochs=1,
                           batch_size=4, strategy="ddp", optimizer=optimizer, progress="none", quiet=True)
    assert name not in dist_session.holdings.models
    dist_session.run("from distnb.engine.train import loop as _loop\n_held = sorted(_loop.RUNS)")
    assert all(name not in held for held in dist_session.pull("_held"))


def test_a_big_tensor_parallel_meta_model_is_verified_one_module_at_a_time(dist_session, shell, capsys):
    ns = shell.user_ns
    ns["F"] = F
    ns["big_tp_data"] = torch.utils.data.TensorDataset(torch.randn(8, 4096))
    torch.manual_seed(0)
    with torch.device("meta"):  # 256 MiB and a bit: the plan check held all of it, so it was skipped above 256 MiB
        ns["big_tp"] = nn.Sequential(nn.Linear(4096, 8192), nn.ReLU(), nn.Linear(8192, 4096))
    r = dist_session.train("loss = model(batch[0]).pow(2).mean()", model="big_tp", data="big_tp_data", epochs=1,
                           batch_size=4, optimizer="sgd", lr=1e-3, strategy="tensor", progress="none", quiet=True)
    out = capsys.readouterr().out
    assert "not verified" not in out  # checked one module at a time (engine/strategies/layered.py)
    assert [row["steps"] for row in r.rows] == [2, 2]
    half = (4096 * 8192 * 2 * 4 + 8192 * 4) // 2  # each rank: half of both weights and of the first bias
    assert [row["sharded_param_bytes"] for row in r.rows] == [half, half]


SHARDS = {"ddp": 2, "fsdp": 2, "tensor": 1, "pipeline": 1}


@pytest.mark.parametrize("first,second", [("fsdp", "ddp"), ("ddp", "tensor"), ("tensor", "pipeline"),
                                          ("pipeline", "fsdp")])
def test_a_meta_model_sent_again_keeps_the_weights_the_ranks_trained(dist_session, shell, capsys, first, second):
    """Another strategy re-places a meta model: it goes on from the trained weights, as one process would.

    It was initialised afresh (the notebook holds no weights to send), losing the first cell's training."""
    ns = shell.user_ns
    name = f"meta_again_{first}_{second}"
    ns["meta_data"], ns["F"] = parity_data(), F
    ref = built(meta=False)
    ns[name] = built(meta=True)
    opts = dict(data="meta_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.1, seed=4, progress="none")
    dist_session.train(BODY, model=name, strategy=first, **opts)
    reference(ref, ns["meta_data"], num_shards=SHARDS[first], batch_size=16, epochs=1, seed=4,
              optimizer=torch.optim.SGD, lr=0.1)
    capsys.readouterr()
    r = dist_session.train(BODY, model=name, strategy=second, **opts)  # another strategy: placed anew
    out = capsys.readouterr().out
    assert f"{name} is on the meta device in the notebook: the ranks keep the weights they trained" in out
    assert "initialises it afresh" not in out
    # the lines about the notebook's weights and each rank initialising its part contradicted it (a fresh user)
    assert "from the notebook's weights" not in out and "initialises the part it holds" not in out, out
    reference(ref, ns["meta_data"], num_shards=SHARDS[second], batch_size=16, epochs=1, seed=4,
              optimizer=torch.optim.SGD, lr=0.1, first_epoch=r.epochs[0])
    assert_weights(ranks_weights(dist_session, name), ref, atol=1e-6)


def test_a_meta_model_rebuilt_in_the_notebook_is_initialised_afresh_and_says_so(dist_session, shell, capsys):
    ns = shell.user_ns
    ns["meta_data"], ns["F"] = parity_data(), F
    ns["meta_rebuilt"] = built(meta=True)
    opts = dict(data="meta_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.1, seed=4, progress="none")
    dist_session.train(BODY, model="meta_rebuilt", strategy="fsdp", **opts)
    ns["meta_rebuilt"] = built(meta=True)  # a new model under the same name
    capsys.readouterr()
    dist_session.train(BODY, model="meta_rebuilt", strategy="fsdp", lr=0.0, **{k: v for k, v in opts.items()
                                                                              if k != "lr"})
    out = capsys.readouterr().out
    assert "meta_rebuilt is on the meta device in the notebook and changed in the notebook, so sending it again " \
           "initialises it afresh" in out
    assert_weights(ranks_weights(dist_session, "meta_rebuilt"), built(meta=False))


def test_a_restart_is_not_called_a_change_in_the_notebook_and_a_real_change_still_is(dist_session, shell, capsys):
    """After %dist restart, the next cell of a meta model said it "changed in the notebook" (it had not); a model
    rebuilt in the notebook after the restart is still told as changed."""
    from distnb import session

    ns = shell.user_ns
    ns["meta_data"], ns["F"] = parity_data(), F
    ns["meta_kept"], ns["meta_remade"] = built(meta=True), built(meta=True)
    opts = dict(data="meta_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.1, seed=4, strategy="fsdp",
                progress="none")
    for name in ("meta_kept", "meta_remade"):
        dist_session.train(BODY, model=name, **opts)
    shell.run_line_magic("dist", "restart")
    ns["meta_remade"] = built(meta=True)  # a new model under the same name, after the restart
    capsys.readouterr()
    session.current().train(BODY, model="meta_kept", **opts)
    out = capsys.readouterr().out
    assert "meta_kept is on the meta device in the notebook and the ranks were started again since they trained it " \
           "(%dist restart, %dist stop and start, or an automatic restart): its weights went with them, so sending it " \
           "again initialises it afresh" in out, out
    assert "changed in the notebook" not in out
    session.current().train(BODY, model="meta_remade", **dict(opts, lr=0.0))
    out = capsys.readouterr().out
    assert "meta_remade is on the meta device in the notebook and changed in the notebook, so sending it again " \
           "initialises it afresh" in out, out
    assert_weights(ranks_weights(session.current(), "meta_remade"), built(meta=False))
