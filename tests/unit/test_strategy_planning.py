"""The strategies' planning functions, in one process: pipeline stage splits, the default tensor plan, ps servers."""

import pytest
import torch.nn as nn

from distnb.engine.strategies.ps import assign_servers
from support.data import mlp


def pipeline_model():
    """The pipeline parity tests' model (tests/cluster/test_pipeline.py): 208, 0, 272, 0 and 51 parameters."""
    return mlp(12, 16, 16, 3, seed=1)


def test_default_split_balances_parameters_and_split_checks():
    from distnb.engine.strategies import StrategyError
    from distnb.engine.strategies.pipeline_split import balance, split_points, tensor_owners

    assert balance([208, 0, 272, 0, 51], 2) == [0, 2]  # largest stage 323, not 480
    assert split_points(pipeline_model(), 2) == ["2"]
    assert split_points(pipeline_model(), 3) == ["2", "4"]
    wrapper = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    assert split_points(wrapper, 2) == ["0.2"]  # a wrapper's single child is split
    with pytest.raises(StrategyError, match=r"'0\.2' is inside '0'"):
        split_points(wrapper, 3, ("0", "0.2"))
    with pytest.raises(StrategyError, match=r"in model order .*: 0\.1, 0\.2"):
        split_points(wrapper, 3, ("0.2", "0.1"))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    with pytest.raises(StrategyError, match=r"0\.weight and 1\.weight are the same tensor in different stages"):
        tensor_owners(tied, split_points(tied, 2))


def test_default_tensor_plan_pairs_consecutive_linears():
    from distnb.engine.strategies.tensor import default_pairs

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.drop, self.fc2 = nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 8)

    model = nn.Sequential(nn.Linear(4, 8), Block(), nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 6),
                          nn.Linear(6, 2), nn.Linear(2, 2))
    pairs, leftovers = default_pairs(model)
    # block: fc1/fc2 across an activation and dropout; a LayerNorm (parameters) breaks a pair; 4-5 pair up
    assert pairs == [("1.fc1", "1.fc2"), ("4", "5")]
    assert leftovers == ["0", "2", "6"]


def test_assign_servers_balances_whole_tensors_by_bytes():
    assert assign_servers([400, 100, 300, 200], 2) == [0, 0, 1, 1]  # 400+100 | 300+200
    assert assign_servers([8, 8, 8], 1) == [0, 0, 0]
    assert assign_servers([0, 10], 2) == [1, 0]  # every server gets a tensor


def test_fsdp_units_sharing_a_parameter_are_grouped_or_left_to_the_outer_unit():
    from distnb.engine.strategies import StrategyError
    from distnb.engine.strategies.fsdp import unit_groups

    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    assert unit_groups(net, ["0", "2", "3"]) == [["0"], ["2"], ["3"]]  # nothing tied: one unit each
    net[2].weight = net[0].weight
    assert unit_groups(net, ["0", "2", "3"]) == [["0", "2"], ["3"]]  # fully_shard([net[0], net[2]])
    assert unit_groups(net, ["0", "3"]) == [["3"]]  # 2 is in the root: the root takes the tied weight
    nested = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
    nested[1].weight = nested[0][0].weight
    # 0.0 and 1 are grouped; the group is sharded before 0, which contains 0.0
    assert unit_groups(nested, ["0", "1", "0.0", "0.1"]) == [["1", "0.0"], ["0.1"], ["0"]]
    nested[0][1].weight = nested[0][0].weight  # 0.0, 0.1 and 1 share one weight: one group
    assert unit_groups(nested, ["0", "1", "0.0", "0.1"]) == [["1", "0.0", "0.1"], ["0"]]
    # 0.1 is not a unit, so unit 0 holds it: 0.0 is left to 0, which is grouped with 1
    assert unit_groups(nested, ["0", "1", "0.0"]) == [["0", "1"]]
    # a: [x, m], c: [y, n]; a.x ties to c's own n and c.y to a's own m: each group contains a unit of the other
    a, c = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    a[0].weight, c[0].weight = c[1].weight, a[1].weight
    with pytest.raises(StrategyError, match=r"tied .* make 0\+1\.0 and 0\.0\+1 FSDP groups .*choose --fsdp-units"):
        unit_groups(nn.Sequential(a, c), ["0", "0.0", "1", "1.0"])


def test_tensor_plan_check_compares_nested_outputs_at_a_dtype_tolerance():
    import torch

    from distnb.engine.strategies.tensor_check import DIFFERENT, SAME, UNCOMPARABLE, compare, leaves

    a = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    out = {"logits": a, "extra": (a * 2, torch.tensor([1, 2])), "name": "x"}
    assert [t.shape for t in leaves(out)] == [(2, 2), (2, 2), (2,)]
    import dataclasses

    @dataclasses.dataclass
    class Output:  # a model's own output class (transformers' ModelOutput is a dict and a dataclass)
        logits: torch.Tensor
        extra: tuple = ()
        loss: object = None

    assert [t.shape for t in leaves(Output(a, (a[0],)))] == [(2, 2), (2,)]
    assert compare(leaves(out), leaves(out))[0] == SAME
    assert compare([a], [a + 1e-6])[0] == SAME  # a different order of sums
    verdict, worst, which = compare([a, a], [a, a + 0.05])  # 0.05 / 4 relative: what a half-mean does
    assert (verdict, which) == (DIFFERENT, "output 1") and worst == pytest.approx(0.0125, rel=1e-5)
    assert compare([a], [a * float("nan")])[0] == DIFFERENT
    nan = torch.tensor([float("nan"), float("inf"), 1.0])
    assert compare([nan], [nan.clone()])[0] == SAME  # the whole model's own NaN and inf are no difference
    assert compare([a.bfloat16()], [(a + 0.01).bfloat16()])[0] == SAME  # bf16: rounding of partial sums
    assert compare([a], [a[:, :1]]) == (UNCOMPARABLE, 0.0, "output 0 has shape (2, 1) where the whole model's "
                                                           "is (2, 2)")
    assert compare([a], [a, a])[0] == UNCOMPARABLE
    assert compare([torch.tensor([1])], [torch.tensor([2])])[0] == UNCOMPARABLE  # nothing to compare


def test_tensor_plan_check_leaves_modes_rng_and_grad_mode_as_they_were():
    import torch

    from distnb.engine.strategies.tensor_check import _Quiet

    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.BatchNorm1d(2))
    net[1].eval()  # a submodule's own mode comes back too
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with _Quiet([net], torch.device("cpu")):
        assert not net.training and not torch.is_grad_enabled()
        net(torch.randn(4, 2))
        torch.rand(5)
    assert torch.equal(torch.rand(3), expected)
    assert [m.training for m in net.modules()] == [True, True, False, True]
    assert int(net[2].num_batches_tracked) == 0 and torch.is_grad_enabled()


def test_tensor_plan_check_message_names_the_pair_and_the_fix():
    from distnb.engine.strategies.tensor_check import DIFFERENT, UNCOMPARABLE, explain

    text = explain("tensor plan", "tensor plan: 'fc1' column-wise, 'fc2' row-wise", DIFFERENT, 0.0967, "output 0",
                   ["'fc1' (column-wise) -> 'fc2' (row-wise)"], default=True)
    assert text.startswith("tensor plan changes what the model computes: on the first batch, in eval mode, the "
                           "split model's output differs from the whole model's by up to 0.0967")
    assert "at the split pair 'fc1' (column-wise) -> 'fc2' (row-wise)" in text
    assert "elementwise over the hidden units" in text and "Nothing was trained" in text
    assert "--tp-plan NAME" in text and "--strategy ddp or fsdp" in text
    text = explain("--tp-plan p", "tensor plan: 'a' column-wise", UNCOMPARABLE, 0.0, "output 0 has shape (2, 1)", [],
                   default=False)
    assert "does not match the whole model's (output 0 has shape (2, 1))" in text
    assert "at the split layers (tensor plan: 'a' column-wise)" in text and "fix --tp-plan p" in text


class _Blocks(nn.Module):
    """A transformer-like stack: an input layer, a ModuleList of residual blocks, a ModuleDict of heads."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(10, 10), nn.ReLU()) for _ in range(3)])
        self.heads = nn.ModuleDict({"out": nn.Linear(10, 2)})
        self.gains = nn.ParameterList([nn.Parameter(nn.init.ones_(nn.Linear(1, 10).weight[:, 0]))])

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h) * self.gains[0]
        return self.heads["out"](h)


def test_containers_stand_for_their_elements_as_fsdp_units_and_pipeline_blocks():
    """ModuleList/ModuleDict are never called: FSDP2 refuses them as units and no stage can begin at one."""
    from distnb.engine.strategies import StrategyError, is_container
    from distnb.engine.strategies.fsdp import FSDP, default_units
    from distnb.engine.strategies.pipeline_split import default_blocks, split_points
    from distnb.core.plan import TrainPlan

    model = _Blocks()
    assert is_container(model.blocks) and is_container(model.gains) and not is_container(model.blocks[0])
    assert default_units(model) == ["inp", "blocks.0", "blocks.1", "blocks.2", "heads.out"]
    assert [n for n, _ in default_blocks(model)] == ["inp", "blocks.0", "blocks.1", "blocks.2", "heads.out"]
    assert split_points(model, 2) == ["blocks.1"]
    with pytest.raises(StrategyError, match=r"--fsdp-units: blocks is an ModuleList.*--fsdp-units "
                                            r"blocks\.0,blocks\.1,blocks\.2"):
        FSDP.check(TrainPlan(model="m", data="d", strategy="fsdp", fsdp_units=("blocks",)), model, 2)
    with pytest.raises(StrategyError, match=r"gains is an ParameterList.*leave it out"):
        FSDP.check(TrainPlan(model="m", data="d", strategy="fsdp", fsdp_units=("gains",)), model, 2)
    with pytest.raises(StrategyError, match=r"--split: heads is an ModuleDict.*--split heads\.out"):
        split_points(model, 2, ("heads",))


def test_the_kernel_checks_the_default_tensor_plan_without_torchs_tensor_parallel_package():
    """Importing torch.distributed.tensor.parallel costs the kernel 41 MiB (16 % of a 0.25 GiB model's bound in
    benchmarks/memory.py, issue 34); the default plan's check needs only each layer's kind (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys, torch.nn as nn\n"
            "from distnb.engine.strategies import StrategyError, tensor\n"
            "P = type('P', (), {'tp_plan': None})\n"
            "m = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))\n"
            "tensor.check_default(P(), m, 2)\n"
            "try:\n"
            "    tensor.check_default(P(), m, 8)\n"
            "except StrategyError as exc:\n"
            "    print('refused:', exc)\n"
            "print('loaded' if 'torch.distributed.tensor.parallel' in sys.modules else 'not loaded')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: tensor plan: 0 is split column-wise but its out_features (12) is not divisible by world_size 8" \
        in out.stdout, out.stdout
    assert out.stdout.strip().endswith("not loaded"), out.stdout
