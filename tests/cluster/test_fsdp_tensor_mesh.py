"""--strategy fsdp+tensor --mesh DPxTP (2-D parallelism) on a real 4-rank cluster.

Tensor parallel within each group of TP consecutive ranks, FSDP2 across the DP groups: one step
must equal one process trained on the union of the DP groups' batches (the ranks of a group
train on the same batches), to 1e-5 with SGD and Adam; the weights loaded back into the
notebook's model must equal the ranks' state. The file restarts the shared cluster with 4 ranks
for its tests and gives the 2-rank one back at the end.
"""

import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from IPython.core.error import UsageError

from distnb import session as session_mod
from distnb.core.errors import RankError
from support.data import parity_data as make_data
from support.reference import reference

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
TOL = dict(atol=1e-5, rtol=1e-5)
OPTIMIZERS = [("sgd", torch.optim.SGD, 0.1), ("adam", torch.optim.Adam, 0.01)]


def make_model(seed=1):
    """Linear(12, 16), Tanh, Linear(16, 8), Linear(8, 3): the default plan splits 0/2, leaves 3 whole."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8), nn.Linear(8, 3))


@pytest.fixture(scope="module")
def mesh_session(shell):
    """The shared cluster restarted with 4 ranks for this file; 2 ranks again afterwards."""
    assert shell.run_cell("%dist restart -n 4 --timeout 30").error_in_exec is None
    s = session_mod.current()
    assert s.world_size == 4
    shell.user_ns["F"] = F
    yield s
    shell.run_cell("%dist restart -n 2 --timeout 30")
    assert session_mod.current().world_size == 2


def train(s, name, data, **kw):
    opts = dict(epochs=1, batch_size=16, seed=4, strategy="fsdp+tensor", progress="none", quiet=True)
    return s.train(kw.pop("body", BODY), model=name, data=data, **dict(opts, **kw))


def assert_params_close(model, ref):
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL, msg=lambda m: f"{name}: {m}")


PULL = """
import torch
from torch.distributed.tensor import DTensor
_full = {{n: p.full_tensor().detach().clone() for n, p in {name}.named_parameters()}}  # a collective
_local = {{n: p.to_local().detach().clone() for n, p in {name}.named_parameters()}}
_meshes = {{n: p.device_mesh.mesh_dim_names for n, p in {name}.named_parameters()}}
"""


@pytest.mark.parametrize("optimizer,opt_cls,lr", OPTIMIZERS)
def test_mesh_2x2_matches_one_process_on_the_global_batch(mesh_session, shell, capsys, optimizer, opt_cls, lr):
    s, ns = mesh_session, shell.user_ns
    name = f"mesh_{optimizer}"
    ns[name], ns["mesh_data"] = make_model(), make_data()
    ref = make_model()
    opt = opt_cls(ref.parameters(), lr=lr)
    result = train(s, name, "mesh_data", optimizer=optimizer, lr=lr, mesh="2x2", quiet=False)
    out = capsys.readouterr().out
    assert "mesh 2x2 (dp x tp): tensor-parallel groups [0, 1], [2, 3], FSDP across them" in out
    assert "tensor plan: '0' column-wise, '2' row-wise; '3' whole within each tensor-parallel group" in out
    assert "203 samples in 2 shards (each shared by the 2 ranks of a tensor-parallel group)" in out
    # 2 data shards (one per tensor-parallel group): one process on the union of the two groups' batches
    reference(ref, ns["mesh_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=opt)
    assert [row["steps"] for row in result.rows] == [7] * 4  # ceil(ceil(203 / 2) / 16)
    assert_params_close(ns[name], ref)
    assert [row["mesh"] for row in result.rows] == ["dp=0,tp=0", "dp=0,tp=1", "dp=1,tp=0", "dp=1,tp=1"]

    # what each rank holds: split layers over both dimensions (2.bias is whole within a group), the
    # whole layer over dp only; in all, the split layers once (2.bias twice), the whole layer twice
    split = (16 * 12 + 16 + 8 * 16 + 2 * 8) * 4
    assert sum(row["split_param_bytes"] for row in result.rows) == split
    assert sum(row["whole_param_bytes"] for row in result.rows) == 2 * (3 * 8 + 3) * 4
    if optimizer == "adam":
        for row in result.rows:
            assert 2 * row["param_bytes"] <= row["optimizer_state_bytes"] < 3 * row["param_bytes"]

    # the weights back equal the ranks' state; each rank's shard is its (dp, tp) block of it
    s.run(PULL.format(name=name))
    full, local, meshes = s.pull("_full"), s.pull("_local"), s.pull("_meshes", rank=0)
    kernel = {n: p.detach() for n, p in ns[name].named_parameters()}
    assert meshes == {"0.weight": ("dp", "tp"), "0.bias": ("dp", "tp"), "2.weight": ("dp", "tp"),
                      "2.bias": ("dp", "tp"), "3.weight": ("dp",), "3.bias": ("dp",)}
    for rank in range(4):
        d, t = divmod(rank, 2)
        for n, p in kernel.items():
            assert torch.equal(full[rank][n], p), (rank, n)
        col = slice(t * 8 + d * 4, t * 8 + d * 4 + 4)  # column-wise: rows t*8.. of 16, then FSDP's half of them
        assert torch.equal(local[rank]["0.weight"], kernel["0.weight"][col])
        assert torch.equal(local[rank]["0.bias"], kernel["0.bias"][col])
        # row-wise: in_features (dim 1) split by tp, then FSDP cuts dim 0
        assert torch.equal(local[rank]["2.weight"], kernel["2.weight"][d * 4:d * 4 + 4, t * 8:t * 8 + 8])
        assert torch.equal(local[rank]["2.bias"], kernel["2.bias"][d * 4:d * 4 + 4])
        assert torch.equal(local[rank]["3.weight"], kernel["3.weight"][[0, 1] if d == 0 else [2]])

    if optimizer == "adam":  # a second cell continues from the live model and optimizer state
        result2 = train(s, name, "mesh_data")
        assert result2.epochs == [1]
        reference(ref, ns["mesh_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=opt, first_epoch=1)
        assert_params_close(ns[name], ref)


@pytest.mark.parametrize("mesh,num_shards,steps", [("1x4", 1, 13), ("4x1", 4, 4)])
def test_a_tp_plan_on_pure_tensor_and_pure_fsdp_meshes(mesh_session, shell, mesh, num_shards, steps):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    s, ns = mesh_session, shell.user_ns
    name = f"mesh_plan_{mesh}"
    ns[name], ns["mesh_data"] = make_model(), make_data()
    ns["mesh_tp_plan"] = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    ref = make_model()
    result = train(s, name, "mesh_data", optimizer="adam", lr=0.01, mesh=mesh, tp_plan="mesh_tp_plan")
    reference(ref, ns["mesh_data"], num_shards=num_shards, batch_size=16, epochs=1, seed=4,
              optimizer=torch.optim.Adam, lr=0.01)
    assert [row["steps"] for row in result.rows] == [steps] * 4
    assert_params_close(ns[name], ref)


def test_clipping_accumulation_and_validation_count_each_sample_once(mesh_session, shell):
    """The gradient norm over both dimensions, accumulation, and the validation sums of 2 shards on 4 ranks."""
    s, ns = mesh_session, shell.user_ns
    ns["mesh_clip"], ns["mesh_data"], ns["mesh_val"] = make_model(), make_data(), make_data(61, seed=5)
    ref = make_model()
    result = train(s, "mesh_clip", "mesh_data", optimizer="sgd", lr=0.1, mesh="2x2", clip_grad_norm=0.05,
                   accumulate=2, val_data="mesh_val")
    run = reference(ref, ns["mesh_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=torch.optim.SGD,
                    lr=0.1, clip_grad_norm=0.05, accumulate=2)
    assert_params_close(ns["mesh_clip"], ref)
    assert result.grad_norm == pytest.approx(run.grad_norms[-1], rel=1e-5)  # the whole model's norm, not 2x it
    x, y = ns["mesh_val"].tensors
    with torch.no_grad():
        want = F.cross_entropy(ref(x), y).item()
    assert result.val_history[-1]["samples"] == 61
    assert result.val_history[-1]["loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("mesh,num_shards", [("1x4", 1), ("4x1", 4)])
def test_clipping_on_pure_tensor_and_pure_fsdp_meshes(mesh_session, shell, mesh, num_shards):
    """On 1x4 the row-wise bias (Shard over a dp of 1, Replicate over tp) counted 4 times in the norm."""
    s, ns = mesh_session, shell.user_ns
    name = f"mesh_clip_{mesh}"
    ns[name], ns["mesh_data"] = make_model(), make_data()
    ref = make_model()
    result = train(s, name, "mesh_data", optimizer="sgd", lr=0.1, mesh=mesh, clip_grad_norm=0.05)
    run = reference(ref, ns["mesh_data"], num_shards=num_shards, batch_size=16, epochs=1, seed=4,
                    optimizer=torch.optim.SGD, lr=0.1, clip_grad_norm=0.05)
    assert max(run.grad_norms) > 0.05  # some steps clip
    assert [v for _, v in result.grad_norm_history] == pytest.approx(run.grad_norms, rel=1e-5)
    assert_params_close(ns[name], ref)


DATASETS = """
import torch
class MeshSet(torch.utils.data.Dataset):  # map-style, not tensors: loaded on the ranks
    def __init__(self, x, y, noise=0.0):
        self.x, self.y, self.noise = x, y, noise
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i] + self.noise * torch.randn(self.x.shape[1]), self.y[i]
"""
RECORD = "x, y = batch\n_seen.append(x.clone())\nloss = F.cross_entropy(model(x), y)"


def test_a_dataset_is_cut_by_tensor_parallel_group_and_its_randomness_agrees_within_one(mesh_session, shell):
    s, ns = mesh_session, shell.user_ns
    assert shell.run_cell(DATASETS).error_in_exec is None
    x, y = make_data().tensors
    ns["mesh_ds"], ns["mesh_set"] = make_model(), ns["MeshSet"](x, y)
    ref = make_model()
    train(s, "mesh_ds", "mesh_set", optimizer="sgd", lr=0.1, mesh="2x2")
    reference(ref, make_data(), num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=torch.optim.SGD, lr=0.1)
    assert_params_close(ns["mesh_ds"], ref)

    # random augmentation: the ranks of a tensor-parallel group draw the same samples, the groups others
    ns["mesh_noisy"] = ns["MeshSet"](x, y, noise=0.5)
    s.run("_seen = []")
    train(s, "mesh_ds", "mesh_noisy", mesh="2x2", body=RECORD, reset=True)
    seen = [torch.cat(batches) for batches in s.pull("_seen")]
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3])
    assert not torch.equal(seen[0], seen[2])


def test_status_shows_each_ranks_mesh_coordinates(mesh_session, shell):
    s, ns = mesh_session, shell.user_ns
    ns["mesh_status"], ns["mesh_data"] = make_model(), make_data()
    train(s, "mesh_status", "mesh_data", mesh="2x2")
    rows = s.status().rows  # every model of this file is on a mesh: those on one mesh share an entry
    mine = [[part for part in row["mesh"].split("; ") if "mesh_status" in part.split("(")[1]] for row in rows]
    assert [[part.split(" (")[0] for part in parts] for parts in mine] == [
        ["dp=0 tp=0 of 2x2"], ["dp=0 tp=1 of 2x2"], ["dp=1 tp=0 of 2x2"], ["dp=1 tp=1 of 2x2"]]
    table = shell.run_cell("%dist status").result  # the magic's table: a mesh column after alive
    text = table.text().splitlines()
    assert table.columns[-2:] == ("alive", "mesh") and text[1].split()[-2:] == ["alive", "mesh"]
    assert "dp=1 tp=0 of 2x2 (" in text[5] and "mesh_status" in table._repr_html_()


BAD = [
    ("--mesh 3x2", r"--mesh 3x2 has 6 ranks \(3 x 2\) but world_size is 4: give DPxTP with DP \* TP = 4, e\.g\. "
                   r"--mesh 4x1 or 2x2 or 1x4"),
    ("--mesh 2", r"--mesh 2 is not DPxTP .*; world_size is 4: .* --mesh 4x1 or 2x2 or 1x4"),
    ("--mesh 0x4", r"--mesh 0x4 is not DPxTP \(two positive integers.*world_size is 4"),
    ("--mesh axb", r"--mesh axb is not DPxTP .*world_size is 4"),
    ("--mesh 2x2 --strategy fsdp", r"--mesh is a --strategy fsdp\+tensor option \(this cell uses --strategy fsdp\)"),
]


@pytest.mark.parametrize("options,message", BAD)
def test_bad_meshes_are_usage_errors_before_anything_is_sent(mesh_session, shell, options, message):
    s, ns = mesh_session, shell.user_ns
    ns["mesh_bad"], ns["mesh_data"] = make_model(), make_data()
    strategy = "" if "--strategy" in options else "--strategy fsdp+tensor "
    err = shell.run_cell(f"%%distrain --model mesh_bad --data mesh_data {strategy}{options} --progress none\n"
                         f"{BODY}").error_in_exec
    assert isinstance(err, UsageError) and re.search(message, str(err)), err
    s.run("from distnb.engine.train import loop\n_sent = 'mesh_bad' in loop.RUNS")
    assert s.pull("_sent") == [False] * 4


def test_a_layer_the_tensor_parallel_size_does_not_divide_names_it_and_the_mesh(mesh_session, shell):
    ns = shell.user_ns
    torch.manual_seed(0)
    ns["mesh_odd"], ns["mesh_data"] = nn.Sequential(nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3)), make_data()
    err = shell.run_cell(f"%%distrain --model mesh_odd --data mesh_data --strategy fsdp+tensor --mesh 1x4 "
                         f"--progress none\n{BODY}").error_in_exec
    assert isinstance(err, UsageError)
    assert ("tensor plan: 0 is split column-wise but its out_features (6) is not divisible by the tensor-parallel "
            "size 4 (--mesh 1x4); resize the layer, pick a --mesh whose TP divides it") in str(err)
    # 2x2 fits it: 6 splits over 2 ranks (and the default mesh on 4 ranks is 2x2)
    result = train(mesh_session, "mesh_odd", "mesh_data", optimizer="sgd", lr=0.1)
    assert [row["mesh"] for row in result.rows][-1] == "dp=1,tp=1"


def test_save_load_continue_equals_uninterrupted(mesh_session, shell, tmp_path):
    s, ns = mesh_session, shell.user_ns
    ns["mesh_ck_ref"], ns["mesh_ck"], ns["mesh_data"] = make_model(), make_model(), make_data()
    train(s, "mesh_ck_ref", "mesh_data", optimizer="adam", lr=0.01, mesh="2x2")
    train(s, "mesh_ck_ref", "mesh_data")
    want = [p.detach().clone() for p in ns["mesh_ck_ref"].parameters()]

    train(s, "mesh_ck", "mesh_data", optimizer="adam", lr=0.01, mesh="2x2")
    meta = s.save(str(tmp_path), model="mesh_ck", quiet=True)
    assert meta["plan"]["strategy"] == "fsdp+tensor" and meta["plan"]["mesh"] == "2x2"
    saved = [p.detach().clone() for p in ns["mesh_ck"].parameters()]
    train(s, "mesh_ck", "mesh_data", lr=0.5)  # wander off
    s.load(str(tmp_path), model="mesh_ck", quiet=True)
    for p, q in zip(ns["mesh_ck"].parameters(), saved):
        torch.testing.assert_close(p.detach(), q)
    assert train(s, "mesh_ck", "mesh_data").epochs == [1]
    for p, q in zip(ns["mesh_ck"].parameters(), want):
        torch.testing.assert_close(p.detach(), q, **TOL)


def test_a_failing_rank_stops_the_others_fast_and_the_notebook_keeps_the_last_weights(mesh_session, shell):
    s, ns = mesh_session, shell.user_ns
    ns["mesh_fail"], ns["mesh_data"] = make_model(), make_data()
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    train(s, "mesh_fail", "mesh_data", optimizer="sgd", lr=0.1, mesh="2x2")
    reference(ref, ns["mesh_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=opt)
    before = {k: v.clone() for k, v in ns["mesh_fail"].state_dict().items()}
    bad = "x, y = batch\nif ctx.rank == 3 and ctx.step == 2:\n    raise ValueError('boom')\n" + BODY
    t0 = time.perf_counter()
    with pytest.raises(RankError, match="rank 3 .*ValueError: boom"):
        train(s, "mesh_fail", "mesh_data", body=bad)
    # well under the 30 s collective timeout: the peers fail at once (their deep DTensor tracebacks then take
    # IPython a few seconds to format on this loaded 2-core machine, so the bound is looser than 2-rank fsdp's)
    assert time.perf_counter() - t0 < 25, "the other ranks waited for the collective timeout (30 s)"
    for k, v in ns["mesh_fail"].state_dict().items():  # the last completed cell's weights
        assert torch.equal(v, before[k]), k
    # the cluster is usable: the model is sent again from those weights and trains on
    result = train(s, "mesh_fail", "mesh_data", optimizer="sgd", lr=0.1)
    assert result.epochs == [0]
    reference(ref, ns["mesh_data"], num_shards=2, batch_size=16, epochs=1, seed=4, optimizer=torch.optim.SGD, lr=0.1)
    assert_params_close(ns["mesh_fail"], ref)


INPLACE = ("import torch, torch.nn as nn\nclass AddsInPlace(nn.Module):\n    def __init__(self):\n"
           "        super().__init__()\n        torch.manual_seed(3)\n        self.fc1 = nn.Linear(12, 16)\n"
           "        self.fc2 = nn.Linear(16, 8)\n        self.head = nn.Linear(8, 3)\n"
           "    def forward(self, x):\n        h = self.fc1(x)\n        h += 0.5  # in place, on a unit's output\n"
           "        return self.head(self.fc2(torch.tanh(h)))\n")


def test_split_layers_give_fsdp_no_view_so_no_warning_and_in_place_ops_train_right(mesh_session, shell, capsys):
    # a tensor-parallel layer's output is a view (DTensor.to_local): FSDP2 warned on a correct model that backward
    # "can fail or produce wrong gradients", and an in-place op on it dropped FSDP2's pre-backward all-gather
    s, ns = mesh_session, shell.user_ns
    assert shell.run_cell(INPLACE + "inplace_net = AddsInPlace()\nref_inplace = AddsInPlace()").error_in_exec is None
    ns["mesh_data"] = make_data()
    capsys.readouterr()
    train(s, "inplace_net", "mesh_data", optimizer="sgd", lr=0.1, mesh="2x2", quiet=False)
    out, err = capsys.readouterr()
    assert "'fc1' column-wise, 'fc2' row-wise" in out
    assert "wrong gradients" not in out + err and "returned a view tensor" not in out + err
    ref = ns["ref_inplace"]
    reference(ref, ns["mesh_data"], num_shards=2, batch_size=16, epochs=1, seed=4,
              optimizer=torch.optim.SGD(ref.parameters(), lr=0.1))
    assert_params_close(ns["inplace_net"], ref)
