"""distnb.train.meshes: an fsdp+tensor ``--mesh`` across a world-size change (kernel side, no ranks)."""

import pytest

from distnb.train import meshes
from distnb.core.errors import PlanError
from distnb.train.holdings import Holdings


@pytest.mark.parametrize("mesh,old,n,want", [("1x2", 2, 4, "2x2"), ("2x2", 4, 2, "1x2"), ("3x1", 3, 2, "2x1"),
                                             (None, 4, 6, "3x2"), (None, 2, 4, "4x1"), ("2x3", 6, 12, "4x3"),
                                             ("3x1", 2, 2, "2x1")])  # a mesh of a world before an earlier scale
def test_refit_keeps_the_tensor_parallel_size(mesh, old, n, want):
    assert meshes.refit(mesh, old, n, "net") == want


def test_refit_refuses_a_world_the_tensor_parallel_size_does_not_divide():
    with pytest.raises(PlanError) as info:
        meshes.refit("2x2", 4, 3, "%dist scale 3: net")
    assert str(info.value) == ("%dist scale 3: net (--strategy fsdp+tensor, --mesh 2x2) keeps its tensor-parallel "
                               "size 2 when the world changes size, and 2 does not divide N = 3: world sizes that "
                               "work are multiples of 2 (2, 4, ...)")
    assert meshes.sizes_that_work(4, 9) == [4, 8, 12]
    assert meshes.sizes_that_work(2, 11) == [6, 8, 10, 12]


def test_plan_changes_are_for_fsdp_tensor_on_another_world_only():
    assert meshes.plan_changes({"strategy": "fsdp+tensor", "mesh": "1x2"}, 2, 4, "net") == {"mesh": "2x2"}
    assert meshes.plan_changes({"strategy": "fsdp+tensor", "mesh": "1x2"}, 2, 2, "net") == {}
    assert meshes.plan_changes({"strategy": "fsdp+tensor", "mesh": None}, 2, 2, "net") == {}  # the default stays
    assert meshes.plan_changes({"strategy": "fsdp", "mesh": None}, 2, 4, "net") == {}


def test_carry_rewrites_carried_meshes_that_can_follow_the_world():
    held = Holdings()
    held.carried = {"a": {"strategy": "fsdp+tensor", "mesh": "1x2"}, "b": {"strategy": "fsdp+tensor", "mesh": "2x2"},
                    "c": {"strategy": "fsdp+tensor", "mesh": None}, "d": {"strategy": "ddp"},
                    "e": {"strategy": "fsdp+tensor", "mesh": "1x3"}}
    assert meshes.carry(held, 2, 4) == {"a": "2x2", "c": "4x1"}  # b fits 4 already; e's TP 3 does not divide 4
    assert held.carried["a"]["mesh"] == "2x2" and held.carried["b"]["mesh"] == "2x2"
    assert held.carried["e"]["mesh"] == "1x3" and "mesh" not in held.carried["d"]


def test_a_carried_mesh_message_names_the_cell_it_came_from_and_the_fix():
    assert meshes.carried_message("net", "1x2", 4) == (
        "--mesh 1x2 came from net's last cell, on a world of 2 ranks, not from this one, and does not fit this "
        "world of 4 ranks: give this cell --mesh DPxTP with DP * TP = 4 (--mesh 4x1 or 2x2 or 1x4), or %dist scale "
        "2 to go back to it")


def test_keep_global_batch_counts_data_parallel_ranks_of_the_mesh():
    from distnb.elastic import scaling

    mesh = {"strategy": "fsdp+tensor", "mesh": "2x2"}  # the carried mesh, laid out for 4 ranks
    assert [scaling._dp_at(mesh, 4, at) for at in (2, 4, 6)] == [1, 2, 3]  # TP 2 stays: DP = ranks / 2
    assert scaling._dp_at({"strategy": "ddp"}, 4, 3) == 3 and scaling._dp_at({}, 2, 5) == 5
    assert scaling._dp_at({"strategy": "tensor"}, 2, 4) == 1
