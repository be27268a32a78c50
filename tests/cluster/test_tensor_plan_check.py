"""A tensor plan is verified on the first forward: a forward that is not elementwise between a split pair
fails the cell on every rank before any step (2 ranks; tensor and fsdp+tensor --mesh 1x2); models whose
forward is elementwise there still train and match one process.

Before the check, the models below trained to different weights with no error (the mean over the
hidden dim was each rank's half: 0.0967 largest weight difference after 5 Adam epochs).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distnb.core.errors import RankError
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
TOL = dict(atol=1e-5, rtol=1e-5)


def classes():
    """(Normed, Mlp), made here so that they travel to the ranks by value (a test module is not importable there)."""

    class Normed(nn.Module):
        """fc1 -> an op over the hidden dim -> fc2: the default plan pairs fc1 and fc2 by registration order."""

        def __init__(self, op="mean"):
            super().__init__()
            self.op = op
            self.fc1 = nn.Linear(16, 32)
            self.fc2 = nn.Linear(32, 3)
            if op == "gated":  # ReZero / adaLN-Zero: the term across the hidden dim starts at 0
                self.g = nn.Parameter(torch.zeros(1))

        def forward(self, x):
            h = self.fc1(x)
            if self.op == "mean":
                h = h - h.mean(-1, keepdim=True)
            elif self.op == "softmax":
                h = torch.softmax(h, -1) * 32
            elif self.op == "gated":  # equal at the first batch's weights, different once g has trained
                h = h + self.g * h.mean(-1, keepdim=True)
            elif self.op == "view":  # swaps the two halves of the hidden units: a view across the split dim
                h = h.view(h.shape[0], 2, -1).flip(1).reshape(h.shape)
            return self.fc2(torch.relu(h))

    class Mlp(nn.Module):
        """A transformer MLP block (fc1 -> GELU -> dropout -> fc2, residual, LayerNorm) called with keywords."""

        def __init__(self, dropout=0.0):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.fc1 = nn.Linear(16, 64)
            self.act = nn.GELU()
            self.drop = nn.Dropout(dropout)
            self.fc2 = nn.Linear(64, 16)
            self.head = nn.Linear(16, 3)

        def forward(self, *, inputs):
            x = inputs["x"]
            x = x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))
            return self.head(x)

    class Attn(nn.Module):
        """Attention: the default plan pairs q (column-wise) with k (row-wise), whose shapes cannot meet in q @ k^T."""

        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

        def forward(self, x):
            x = x.view(x.shape[0], 4, 4).repeat(1, 1, 4)  # 4 tokens of 16 features
            a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), -1) @ self.v(x)
            return self.o(a).mean(1)[:, :3]

    return Normed, Mlp, Attn


def data(n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long())


def made(which, *args, seed=2):
    torch.manual_seed(seed)
    return classes()[which](*args)


@pytest.mark.parametrize("strategy,mesh", [("tensor", None), ("fsdp+tensor", "1x2")])
def test_a_mean_over_the_hidden_dim_fails_the_cell_and_the_next_cell_trains(dist_session, shell, strategy, mesh):
    ns = shell.user_ns
    name = f"tpc_mean_{strategy.replace('+', '_')}"
    ns[name], ns["tpc_data"], ns["F"] = made(0), data(), F
    before = {k: v.clone() for k, v in ns[name].state_dict().items()}
    with pytest.raises(RankError) as info:
        dist_session.train(BODY, model=name, data="tpc_data", epochs=2, batch_size=64, optimizer="adam", lr=0.01,
                           seed=3, strategy=strategy, mesh=mesh, progress="none", quiet=True)
    text = str(info.value)
    assert "StrategyError: tensor plan changes what the model computes" in text
    assert "'fc1' (column-wise) -> 'fc2' (row-wise)" in text
    assert "elementwise over the hidden units" in text and "--tp-plan NAME" in text and "--strategy ddp" in text
    assert "Nothing was trained" in text
    for k, v in ns[name].state_dict().items():  # no step: the notebook's model is untouched
        assert torch.equal(v, before[k]), k
    # the cluster is usable: the next cell trains with another strategy and matches one process
    ref = made(0)
    dist_session.train(BODY, model=name, data="tpc_data", epochs=1, batch_size=32, optimizer="sgd", lr=0.1, seed=3,
                       strategy="ddp", progress="none", quiet=True)
    reference(ref, ns["tpc_data"], num_shards=2, batch_size=32, epochs=1, seed=3, optimizer=torch.optim.SGD, lr=0.1)
    for p, p_ref in zip(ns[name].parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL)


@pytest.mark.parametrize("op", ["softmax", "view", "gated"])
def test_other_ops_across_the_hidden_dim_fail_too(dist_session, shell, op):
    ns = shell.user_ns
    name = f"tpc_{op}"
    ns[name], ns["tpc_data"], ns["F"] = made(0, op), data(), F
    with pytest.raises(RankError, match=r"tensor plan changes what the model computes.*'fc1' \(column-wise\)"):
        dist_session.train(BODY, model=name, data="tpc_data", epochs=1, batch_size=64, optimizer="sgd", lr=0.1,
                           seed=3, strategy="tensor", progress="none", quiet=True)


def test_a_split_model_that_cannot_run_is_the_plan_error_without_torchs_log(dist_session, shell, capfd):
    """q column-wise, k row-wise: DTensor cannot multiply their outputs. It was a raw 'a and b must have same
    reduction dim' with a generic hint, after tens of lines of fake_tensor ERROR log from every rank."""
    ns = shell.user_ns
    ns["tpc_attn"], ns["tpc_data"], ns["F"] = made(2), data(), F
    with pytest.raises(RankError, match=r"StrategyError: tensor plan changes what the model computes: on the first "
                                        r"batch, in eval mode, the split model cannot run: "):
        dist_session.train(BODY, model="tpc_attn", data="tpc_data", epochs=1, batch_size=64, optimizer="sgd", lr=0.1,
                           seed=3, strategy="tensor", progress="none", quiet=True)
    assert "fake_tensor" not in "".join(capfd.readouterr())
    dist_session.train(BODY, model="tpc_attn", data="tpc_data", epochs=1, batch_size=64, optimizer="sgd", lr=0.1,
                       seed=3, strategy="ddp", progress="none", quiet=True)  # the next cell works


def test_a_tp_plan_that_changes_the_forward_is_the_same_error(dist_session, shell):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    ns = shell.user_ns
    ns["tpc_user"], ns["tpc_data"], ns["F"] = made(0), data(), F
    ns["tpc_user_plan"] = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    with pytest.raises(RankError, match=r"--tp-plan tpc_user_plan changes what the model computes.*'fc2'.*"
                                        r"fix --tp-plan tpc_user_plan"):
        dist_session.train(BODY, model="tpc_user", data="tpc_data", epochs=1, batch_size=64, optimizer="sgd",
                           lr=0.1, seed=3, strategy="tensor", tp_plan="tpc_user_plan", progress="none", quiet=True)


@pytest.mark.parametrize("strategy,mesh", [("tensor", None), ("fsdp+tensor", "1x2")])
def test_an_elementwise_block_called_with_a_dict_trains_and_matches_one_process(dist_session, shell, strategy, mesh):
    ns = shell.user_ns
    name = f"tpc_mlp_{strategy.replace('+', '_')}"
    ns[name], ns["tpc_data"], ns["F"] = made(1), data(), F
    ref = made(1)
    body = "x, y = batch\nloss = F.cross_entropy(model(inputs={'x': x}), y)"
    result = dist_session.train(body, model=name, data="tpc_data", epochs=2, batch_size=64, optimizer="adam",
                                lr=0.01, seed=3, strategy=strategy, mesh=mesh, progress="none", quiet=True)
    assert [row["steps"] for row in result.rows] == [8, 8]

    class Wrapped(nn.Module):  # the reference calls model(x): the same function of x
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(inputs={"x": x})

    reference(Wrapped(ref), ns["tpc_data"], num_shards=1, batch_size=64, epochs=2, seed=3,
              optimizer=torch.optim.Adam, lr=0.01)
    for (n, p), p_ref in zip(ns[name].named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL, msg=lambda m: f"{n}: {m}")


def test_dropout_and_batchnorm_are_left_alone_by_the_check(dist_session, shell):
    """The check runs in eval mode with the RNG restored: running statistics and dropout masks are the
    ones one process gets (dropout on the replicated output, as tests/cluster/test_datasets.py does)."""
    ns = shell.user_ns

    def make():
        torch.manual_seed(5)
        return nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Dropout(0.5),
                             nn.Linear(16, 3))

    ns["tpc_bn"], ns["tpc_data"], ns["F"] = make(), data(), F
    ref = make()
    dist_session.train(BODY, model="tpc_bn", data="tpc_data", epochs=1, batch_size=64, optimizer="sgd", lr=0.1,
                       seed=3, strategy="tensor", progress="none", quiet=True)
    reference(ref, ns["tpc_data"], num_shards=1, batch_size=64, epochs=1, seed=3, optimizer=torch.optim.SGD, lr=0.1,
              seed_epochs=True)
    state, ref_state = ns["tpc_bn"].state_dict(), ref.state_dict()
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k].float(), v.float(), **TOL, msg=lambda m: f"{k}: {m}")
    assert int(state["0.num_batches_tracked"]) == 4  # one update per training batch, none by the check


def test_a_tp_plan_that_leaves_the_output_sharded_is_trained_with_a_warning(dist_session, shell, capsys):
    """A sharded output (a column-wise last layer) has another shape than the whole model's: not comparable."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    ns = shell.user_ns
    torch.manual_seed(2)
    ns["tpc_sharded"], ns["tpc_data"] = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), data()
    ns["tpc_sharded_plan"] = {"2": ColwiseParallel()}
    result = dist_session.train("x, y = batch\nloss = model(x).square().mean()", model="tpc_sharded", data="tpc_data",
                                epochs=1, batch_size=64, optimizer="sgd", lr=0.1, seed=3, strategy="tensor",
                                tp_plan="tpc_sharded_plan", progress="none", quiet=True)
    assert [row["steps"] for row in result.rows] == [4, 4]
    out = capsys.readouterr().out
    assert out.count("--tp-plan tpc_sharded_plan was not verified") == 1  # rank 0 only
    assert "output 0 has shape (64, 2) where the whole model's is (64, 4)" in out


DATACLASS_CELL = """
import dataclasses, typing
import torch, torch.nn as nn, torch.nn.functional as F
@dataclasses.dataclass
class TpcOutput:  # as transformers' ModelOutput is used: logits and the loss the model computed itself
    logits: torch.Tensor
    loss: typing.Optional[torch.Tensor] = None
class TpcLabelled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 3)
    def forward(self, x, labels=None):
        logits = self.fc2(torch.relu(self.fc1(x)))
        return TpcOutput(logits, None if labels is None else F.cross_entropy(logits, labels))
"""


@pytest.mark.parametrize("strategy,mesh", [("tensor", None), ("fsdp+tensor", "1x2")])
def test_a_model_returning_a_dataclass_is_checked_on_its_tensors(dist_session, shell, strategy, mesh):
    """The check walked tuples, lists and dicts only: a dataclass output had 'no floating-point output tensor',
    and the default plan of an elementwise model was refused as one that 'changes what the model computes'."""
    shell.run_cell(DATACLASS_CELL)
    ns = shell.user_ns
    name = f"tpc_dc_{strategy.replace('+', '_')}"
    torch.manual_seed(4)
    ns[name], ns["tpc_data"] = ns["TpcLabelled"](), data()
    torch.manual_seed(4)
    ref = ns["TpcLabelled"]()
    body = "x, y = batch\nloss = model(x, y).loss"
    dist_session.train(body, model=name, data="tpc_data", epochs=1, batch_size=64, optimizer="sgd", lr=0.1, seed=3,
                       strategy=strategy, mesh=mesh, progress="none", quiet=True)
    reference(ref, ns["tpc_data"], num_shards=1, batch_size=64, epochs=1, seed=3, optimizer=torch.optim.SGD, lr=0.1,
              loss_fn=lambda out, y: F.cross_entropy(out.logits, y))
    for (n, p), p_ref in zip(ns[name].named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL, msg=lambda m: f"{n}: {m}")


TIED_CELL = """
import torch, torch.nn as nn, torch.nn.functional as F
class TpcTied(nn.Module):  # a language model whose output layer is its embedding (out.weight = emb.weight)
    def __init__(self):
        super().__init__()
        self.emb, self.up, self.down = nn.Embedding(20, 8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight
    def forward(self, tok):
        h = self.emb(tok)
        return self.out(h + self.down(torch.relu(self.up(h))))
"""


@pytest.mark.parametrize("mesh", ["2x1", "1x2"])
def test_tied_weights_under_fsdp_tensor_pass_the_check_and_match_one_process(dist_session, shell, mesh):
    """The check's whole copy got the tied weight twice (FSDP's full state holds each name apart); moving the
    weights at random moved one copy only, and a correct plan was refused ('differs ... by up to 0.418, with
    the weights moved at random'; --mesh 2x1, where FSDP shards the tied weight; 1x2 passed)."""
    shell.run_cell(TIED_CELL)
    ns = shell.user_ns
    g = torch.Generator().manual_seed(5)
    tok = torch.randint(0, 20, (64, 6), generator=g)
    ns["tpc_tok"] = torch.utils.data.TensorDataset(tok, torch.randint(0, 20, (64, 6), generator=g))
    name = f"tpc_tied_{mesh.replace('x', '_')}"
    torch.manual_seed(6)
    ns[name] = ns["TpcTied"]()
    torch.manual_seed(6)
    ref = ns["TpcTied"]()
    body = "x, y = batch\nloss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())"
    dist_session.train(body, model=name, data="tpc_tok", epochs=1, batch_size=8, optimizer="sgd", lr=0.5, seed=3,
                       strategy="fsdp+tensor", mesh=mesh, progress="none", quiet=True)
    reference(ref, ns["tpc_tok"], num_shards=int(mesh[0]), batch_size=8, epochs=1, seed=3,
              optimizer=torch.optim.SGD, lr=0.5, loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    assert ns[name].out.weight is ns[name].emb.weight
    for (n, p), p_ref in zip(ns[name].named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL, msg=lambda m: f"{n}: {m}")
