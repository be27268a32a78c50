"""--strategy pipeline (torch.distributed.pipelining, GPipe and 1F1B) on the real 2-rank cluster.

Every rank trains on the same batches (the whole data set, shuffled with the plan seed), so a
step must equal one process training the unsplit model on that batch: losses and parameters
to 1e-5. Rank r holds stage r only; the weights loaded back into the kernel must equal the
stages' state.
"""

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.core.errors import PlanError, RankError
from support.data import mlp, parity_data
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
TOL = dict(atol=1e-5, rtol=1e-5)
N = 85  # 5 batches of 16 and a partial one of 5 (one microbatch: a second schedule, 1F1B falls back to GPipe)

MLP_CELL = """
import torch, torch.nn as nn
class PipeMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
    def forward(self, x):
        return self.net(x.flatten(1)) * self.scale
def make_pipe_mlp(seed=1):
    torch.manual_seed(seed)
    return PipeMLP()
"""


def make_data():
    return parity_data(N)  # the parity tests' data, N samples


def make_model(seed=1):
    return mlp(12, 16, 16, 3, seed=seed)


def same_batches(model, data, epochs, opt, first_epoch=0):
    """The reference: one process, the unsplit model, the batches every rank trains on (batch 16, seed 4)."""
    return reference(model, data, num_shards=1, batch_size=16, epochs=epochs, seed=4, optimizer=opt,
                     first_epoch=first_epoch)


def assert_params_close(model, ref):
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL, msg=lambda m: f"{name}: {m}")


def check_stages(dist_session, name, kernel_model, result):
    """Each rank holds its stage only (others freed), and the stages' state is what the kernel got back."""
    dist_session.run("from distnb.engine.train import loop\n"
                     f"_strategy = loop.RUNS[{name!r}].strategy\n"
                     "_stage_state = {k: v.detach().clone() for k, v in _strategy.model.state_dict().items()}\n"
                     f"_freed = sorted(n for n, p in loop.RUNS[{name!r}].module.named_parameters() if p.is_meta)")
    stage_states, freed = dist_session.pull("_stage_state"), dist_session.pull("_freed")
    kernel = kernel_model.state_dict()
    assert set(stage_states[0]).isdisjoint(stage_states[1])
    assert set(stage_states[0]) | set(stage_states[1]) == set(kernel)
    for rank, state in enumerate(stage_states):
        # the other stage's parameters are freed; the root's own (net-level) tensors stay on every rank
        assert freed[rank] == sorted(k for k in stage_states[1 - rank] if "." in k)
        for k, v in state.items():
            assert torch.equal(v, kernel[k]), (rank, k)
        row = result.rows[rank]
        assert row["stage"] == rank
        assert row["param_bytes"] == sum(v.numel() * v.element_size() for k, v in state.items()
                                         if k in dict(kernel_model.named_parameters()))
    return stage_states


@pytest.mark.parametrize("schedule,microbatches,optimizer,opt_cls,lr", [
    ("gpipe", 4, "sgd", torch.optim.SGD, 0.1),
    ("1f1b", 2, "sgd", torch.optim.SGD, 0.1),
    ("1f1b", None, "adam", torch.optim.Adam, 0.01),
])
def test_pipeline_matches_the_unsplit_model(dist_session, shell, schedule, microbatches, optimizer, opt_cls, lr):
    ns = shell.user_ns
    name = f"pp_{schedule}_{optimizer}"
    ns[name], ns["pp_data"], ns["F"] = make_model(), make_data(), F
    ref = make_model()
    opts = dict(model=name, data="pp_data", batch_size=16, optimizer=optimizer, lr=lr, seed=4, strategy="pipeline",
                schedule=schedule, microbatches=microbatches, progress="none", quiet=True)

    result = dist_session.train(BODY, epochs=2, **opts)
    opt = opt_cls(ref.parameters(), lr=lr)
    run = same_batches(ref, ns["pp_data"], 2, opt)
    means, last = run.epoch_losses, run.last_loss
    assert [row["steps"] for row in result.rows] == [12, 12]  # ceil(85 / 16) = 6 steps per epoch, every rank
    torch.testing.assert_close(result.epoch_losses, means, **TOL)
    for loss in dist_session.pull("loss"):  # the batch loss reaches every rank (broadcast from the last stage)
        torch.testing.assert_close(loss.item(), last, **TOL)
    assert_params_close(ns[name], ref)
    stages = check_stages(dist_session, name, ns[name], result)
    # balanced by parameter count: [Linear(12,16), Tanh] (208) | [Linear(16,16), Tanh, Linear(16,3)] (323)
    assert sorted(stages[0]) == ["0.bias", "0.weight"]

    # a second cell continues: same stages and optimizer state, next epoch
    result2 = dist_session.train(BODY, epochs=1, **opts)
    assert result2.epochs == [2]
    means2 = same_batches(ref, ns["pp_data"], 1, opt, first_epoch=2).epoch_losses
    torch.testing.assert_close(result2.epoch_losses, means2, **TOL)
    assert_params_close(ns[name], ref)
    check_stages(dist_session, name, ns[name], result2)


def test_traced_model_with_split_and_loss_function(dist_session, shell):
    """A non-Sequential model is traced (torch.export) and cut at --split; --loss replaces the body's loss."""
    shell.run_cell(MLP_CELL + "def pp_loss(output, target):\n    return F.cross_entropy(output, target)\n")
    ns = shell.user_ns
    ns["pp_mlp"], ns["pp_data"], ns["F"] = ns["make_pipe_mlp"](), make_data(), F
    ref = ns["make_pipe_mlp"]()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    result = dist_session.train("x, y = batch\nout = model(x)", model="pp_mlp", data="pp_data", epochs=1,
                                batch_size=16, optimizer="sgd", lr=0.1, seed=4, strategy="pipeline", split="net.4",
                                schedule="1f1b", loss="pp_loss", progress="none", quiet=True)
    means = same_batches(ref, ns["pp_data"], 1, opt).epoch_losses
    torch.testing.assert_close(result.epoch_losses, means, **TOL)
    assert_params_close(ns["pp_mlp"], ref)
    stages = check_stages(dist_session, "pp_mlp", ns["pp_mlp"], result)
    # the root's own parameter goes to the stage that uses it
    assert sorted(stages[1]) == ["net.4.bias", "net.4.weight", "scale"]


def test_traced_model_default_split(dist_session, shell):
    """Default split of a wrapper: the children of its single nn.Sequential, balanced by parameter count."""
    shell.run_cell(MLP_CELL)
    ns = shell.user_ns
    ns["pp_mlp2"], ns["pp_data"], ns["F"] = ns["make_pipe_mlp"](), make_data(), F
    ref = ns["make_pipe_mlp"]()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    result = dist_session.train(BODY, model="pp_mlp2", data="pp_data", epochs=1, batch_size=16, optimizer="sgd",
                                lr=0.1, seed=4, strategy="pipeline", progress="none", quiet=True)
    same_batches(ref, ns["pp_data"], 1, opt)
    assert_params_close(ns["pp_mlp2"], ref)
    stages = check_stages(dist_session, "pp_mlp2", ns["pp_mlp2"], result)
    assert sorted(stages[0]) == ["net.0.bias", "net.0.weight"]


DICT_CELL = """
import torch, torch.nn as nn
class PipeDict(nn.Module):
    def __init__(self, early=False):
        super().__init__()
        self.early = early
        self.a, self.b, self.head = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 3)
    def forward(self, x):
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.b(h))
        return {"logits": self.head(g), "hidden": h if self.early else g}
def make_pipe_dict(seed=1, early=False):
    torch.manual_seed(seed)
    return PipeDict(early)
"""
DICT_BODY = "x, y = batch\nout = model(x)\nloss = F.cross_entropy(out['logits'], y) + 0.01 * out['hidden'].pow(2).mean()"


def test_a_model_returning_a_dict_gets_its_dict_on_the_last_stage(dist_session, shell):
    """A traced last stage returns the output's tensors flattened: the body gets the model's dict back.

    Before, ``model(x)`` was a tuple (two tensors) or the bare tensor (a dict of one), and ``out['logits']``
    failed with ``tuple indices must be integers`` / ``too many indices for tensor``.
    """
    shell.run_cell(DICT_CELL)
    ns = shell.user_ns
    ns["pp_dict"], ns["pp_data"], ns["pp_val"], ns["F"] = ns["make_pipe_dict"](), make_data(), parity_data(20, seed=3), F
    ref = ns["make_pipe_dict"]()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def loss_fn(out, y):
        return F.cross_entropy(out["logits"], y) + 0.01 * out["hidden"].pow(2).mean()

    result = dist_session.train(DICT_BODY, model="pp_dict", data="pp_data", val_data="pp_val", epochs=1,
                                batch_size=16, optimizer="sgd", lr=0.1, seed=4, strategy="pipeline", split="b",
                                progress="none", quiet=True)
    run = reference(ref, ns["pp_data"], num_shards=1, batch_size=16, epochs=1, seed=4, optimizer=opt, loss_fn=loss_fn)
    torch.testing.assert_close(result.epoch_losses, run.epoch_losses, **TOL)
    assert_params_close(ns["pp_dict"], ref)
    with torch.no_grad():
        x, y = ns["pp_val"].tensors
        assert result.val_loss == pytest.approx(float(loss_fn(ns["pp_dict"](x), y)), rel=1e-5)
    # a tensor returned from an earlier stage never reaches the last one: an error that says so
    ns["pp_early"] = ns["make_pipe_dict"](early=True)
    with pytest.raises(RankError, match=r"pipeline stage 1 of 2 \(rank 1\): the model returns 2 tensors \(a dict of "
                                        r"shapes \(8, 3\), \(8, 16\) per microbatch\) but the last stage computes 1"):
        dist_session.train(DICT_BODY, model="pp_early", data="pp_data", epochs=1, batch_size=16, strategy="pipeline",
                           split="b", progress="none", quiet=True)


CONST_CELL = """
import torch, torch.nn as nn
class PipeConst(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(12, 12), nn.Linear(12, 16), nn.Linear(16, 3)
        self.gate = torch.linspace(0.0, 1.0, 12)  # a plain tensor attribute, as many models hold a causal mask
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 16), persistent=False)
    def forward(self, x):
        h = torch.tanh(self.a(x)) * self.gate
        return self.head(torch.tanh(self.b(h) + self.shift))
def make_pipe_const(seed=1):
    torch.manual_seed(seed)
    return PipeConst()
"""


def test_a_traced_model_with_a_plain_tensor_attribute_and_a_non_persistent_buffer(dist_session, shell):
    """Tensors outside the state_dict go into the traced stages too.

    Before: the plain attribute stayed on the CPU in the meta copy that is traced (``could not trace PipeConst
    ... meta and cpu``), and a non-persistent buffer was refused (``the traced stage holds 'shift', which is
    not in the model's state_dict``).
    """
    shell.run_cell(CONST_CELL)
    ns = shell.user_ns
    ns["pp_const"], ns["pp_data"], ns["F"] = ns["make_pipe_const"](), make_data(), F
    ref = ns["make_pipe_const"]()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    result = dist_session.train(BODY, model="pp_const", data="pp_data", epochs=1, batch_size=16, optimizer="sgd",
                                lr=0.1, seed=4, strategy="pipeline", split="b", progress="none", quiet=True)
    means = same_batches(ref, ns["pp_data"], 1, opt).epoch_losses
    torch.testing.assert_close(result.epoch_losses, means, **TOL)
    assert_params_close(ns["pp_const"], ref)
    assert sorted(ns["pp_const"].state_dict()) == ["a.bias", "a.weight", "b.bias", "b.weight", "head.bias",
                                                   "head.weight"]


LABELLED_CELL = """
import torch, torch.nn as nn, torch.nn.functional as F
class PipeLabelled(nn.Module):  # computes its own loss, as models called as model(input_ids, labels) do
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 3)
    def forward(self, x, labels):
        logits = self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return logits, F.cross_entropy(logits, labels)
"""


def test_an_argument_only_a_later_stage_uses_is_an_error_naming_it(dist_session, shell):
    """torch's pipeline feeds model(...)'s arguments to the first stage only; the labels a model uses in its
    last stage made stage 0's forward fail with 'takes 2 positional arguments but 3 were given' (and a
    message that was only torch's 'failed to run forward: args: ...')."""
    shell.run_cell(LABELLED_CELL)
    ns = shell.user_ns
    ns["pp_labelled"], ns["pp_data"], ns["F"] = ns["PipeLabelled"](), make_data(), F
    body = "x, y = batch\nlogits, loss = model(x, y)"
    with pytest.raises(RankError, match=r"argument 1 \(labels\) of model\(\.\.\.\) is not used by the first stage "
                                        r"\(the layers before 'b'\).* loss = F\.cross_entropy\(model\(x\), y\)"):
        dist_session.train(body, model="pp_labelled", data="pp_data", epochs=1, batch_size=16, strategy="pipeline",
                           split="b", progress="none", quiet=True)
    ns["pp_after"] = make_model()  # the next cell works
    result = dist_session.train(BODY, model="pp_after", data="pp_data", epochs=1, batch_size=16, strategy="pipeline",
                                progress="none", quiet=True)
    assert result.epochs == [0]


def test_bad_options_error_before_anything_runs(dist_session, shell):
    ns = shell.user_ns
    ns["pp_bad"], ns["pp_small"], ns["pp_data"], ns["F"] = make_model(), nn.Sequential(nn.Linear(12, 3)), make_data(), F
    opts = dict(data="pp_data", strategy="pipeline", progress="none", quiet=True)
    with pytest.raises(PlanError, match=r"--split gives 2 names, i\.e\. 3 stages, on 2 ranks; the pipeline runs one "
                                        r"stage per rank: give 1 name"):
        dist_session.train(BODY, model="pp_bad", split="2,4", **opts)
    with pytest.raises(PlanError, match=r"--split: Sequential has no submodule named 'head'; its submodules are: "
                                        r"0, 1, 2, 3, 4"):
        dist_session.train(BODY, model="pp_bad", split="head", **opts)
    with pytest.raises(PlanError, match=r"--microbatches 3 does not divide --batch-size 16"):
        dist_session.train(BODY, model="pp_bad", batch_size=16, microbatches=3, **opts)
    with pytest.raises(PlanError, match=r"the default --microbatches 2 \(one per stage\) does not divide "
                                        r"--batch-size 15"):
        dist_session.train(BODY, model="pp_bad", batch_size=15, **opts)
    with pytest.raises(PlanError, match=r"--schedule 1f1b needs at least as many microbatches as stages \(2\)"):
        dist_session.train(BODY, model="pp_bad", schedule="1f1b", microbatches=1, **opts)
    with pytest.raises(PlanError, match=r"2 stages on 2 ranks .* need at least 2 blocks .* Sequential has 1 \(0\)"):
        dist_session.train(BODY, model="pp_small", **opts)
    with pytest.raises(PlanError, match=r"--split 0 leaves stage 0 empty"):
        dist_session.train(BODY, model="pp_bad", split="0", **opts)
    with pytest.raises(PlanError, match=r"--loop is not available with --strategy pipeline"):
        dist_session.train(BODY, model="pp_bad", loop=True, **opts)
    dist_session.run("from distnb.engine.train import loop\n_sent = [n for n in ('pp_bad', 'pp_small') if n in loop.RUNS]")
    assert dist_session.pull("_sent") == [[], []]
    # the cluster works: the same model trains with a valid split
    result = dist_session.train(BODY, model="pp_bad", split="4", epochs=1, batch_size=16, **opts)
    assert [row["stage"] for row in result.rows] == [0, 1]


def test_an_error_in_a_stage_names_it_and_the_next_cell_works(dist_session, shell):
    """The body fails only on the last stage (where its loss runs); the first stage must not wait for the timeout."""
    ns = shell.user_ns
    ns["pp_fail"], ns["pp_data"], ns["F"] = make_model(), make_data(), F
    before = {k: v.clone() for k, v in ns["pp_fail"].state_dict().items()}
    bad = "x, y = batch\nout = model(x)\nloss = F.cross_entropy(out, y) + pp_undefined_name"
    t0 = time.perf_counter()
    with pytest.raises(RankError, match=r"rank 1 .*NameError: pipeline stage 1 of 2 \(rank 1\): name "
                                        r"'pp_undefined_name' is not defined"):
        dist_session.train(bad, model="pp_fail", data="pp_data", epochs=1, batch_size=16, strategy="pipeline",
                           progress="none", quiet=True)
    assert time.perf_counter() - t0 < 15, "the first stage waited for the collective timeout (30 s)"
    for k, v in ns["pp_fail"].state_dict().items():  # the stages died with the group: the kernel keeps its weights
        assert torch.equal(v, before[k]), k
    ref = make_model()
    result = dist_session.train(BODY, model="pp_fail", data="pp_data", epochs=1, batch_size=16, optimizer="sgd",
                                lr=0.1, seed=4, strategy="pipeline", progress="none", quiet=True)
    assert result.epochs == [0]
    same_batches(ref, ns["pp_data"], 1, torch.optim.SGD(ref.parameters(), lr=0.1))
    assert_params_close(ns["pp_fail"], ref)


def test_checkpoint_of_traced_stages_round_trips(dist_session, shell, tmp_path):
    """Save (each rank its stage; the root's own parameter from the stage that trains it), wander off, load, go on."""
    shell.run_cell(MLP_CELL)
    ns = shell.user_ns
    ns["pp_ck_ref"], ns["pp_ck"], ns["pp_data"], ns["F"] = ns["make_pipe_mlp"](), ns["make_pipe_mlp"](), make_data(), F

    def train(name, **kw):
        return dist_session.train(BODY, model=name, data="pp_data", epochs=1, batch_size=16, seed=4,
                                  strategy="pipeline", progress="none", quiet=True, **kw)

    def flat(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    train("pp_ck_ref", optimizer="adam", lr=0.01)
    train("pp_ck_ref")
    train("pp_ck", optimizer="adam", lr=0.01)
    dist_session.save(str(tmp_path), model="pp_ck", quiet=True)
    saved = flat(ns["pp_ck"]).clone()
    train("pp_ck", lr=0.5)  # wander off
    dist_session.load(str(tmp_path), model="pp_ck", quiet=True)
    torch.testing.assert_close(flat(ns["pp_ck"]), saved)
    assert train("pp_ck").epochs == [1]
    torch.testing.assert_close(flat(ns["pp_ck"]), flat(ns["pp_ck_ref"]), **TOL)
