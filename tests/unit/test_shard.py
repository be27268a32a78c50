import math

import pytest
import torch

from distnb.engine.transport import shard


@pytest.mark.parametrize("n,w", [(1797, 2), (10, 3), (7, 7), (1000, 4)])
def test_shards_are_disjoint_and_cover(n, w):
    parts = shard.assign(n, w, seed=3)
    allidx = torch.cat(parts)
    assert len(allidx) == n and len(set(allidx.tolist())) == n
    assert [len(p) for p in parts] == [shard.shard_length(n, w, r) for r in range(w)]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("drop_last", [False, True])
def test_uneven_sizes_give_every_rank_the_same_number_of_steps(drop_last):
    n, w, b = 1797, 2, 64
    steps = []
    for r in range(w):
        order = shard.epoch_order(n, w, r, seed=0, epoch=0, drop_last=drop_last)
        assert order.max() < shard.shard_length(n, w, r)
        batches = list(shard.batches(order, b, drop_last))
        steps.append(len(batches))
        sizes = [len(x) for x in batches]
        if drop_last:
            assert set(sizes) == {b}
    assert steps[0] == steps[1] == shard.steps_per_epoch(n, w, b, drop_last)
    assert steps[0] == (math.floor(898 / 64) if drop_last else math.ceil(899 / 64))


def test_padding_repeats_only_own_samples():
    order = shard.epoch_order(1797, 2, 1, seed=0, epoch=0, drop_last=False)  # rank 1 holds 898
    assert len(order) == 899 and len(set(order.tolist())) == 898


def test_order_reshuffles_per_epoch_and_repeats_per_seed():
    a0 = shard.epoch_order(1797, 2, 0, seed=1, epoch=0, drop_last=False)
    a1 = shard.epoch_order(1797, 2, 0, seed=1, epoch=1, drop_last=False)
    again = shard.epoch_order(1797, 2, 0, seed=1, epoch=0, drop_last=False)
    other_seed = shard.epoch_order(1797, 2, 0, seed=2, epoch=0, drop_last=False)
    assert not torch.equal(a0, a1)
    assert torch.equal(a0, again)
    assert not torch.equal(a0, other_seed)
    assert sorted(a0.tolist()) == sorted(a1.tolist())  # same shard, new order
    assert torch.equal(shard.assign(100, 2, 5)[0], shard.assign(100, 2, 5)[0])


@pytest.mark.parametrize("n,w,b,drop,msg", [(0, 2, 8, False, "empty"), (1, 2, 8, False, "fewer than world_size"),
                                            (20, 2, 16, True, "no full batch")])
def test_check_sizes(n, w, b, drop, msg):
    with pytest.raises(ValueError, match=msg):
        shard.check_sizes(n, w, b, drop)


def test_global_batches_are_the_union_of_the_ranks_batches():
    n, w, b = 203, 2, 16
    steps = list(shard.global_batches(n, w, seed=4, epoch=1, batch_size=b, drop_last=False))
    assert len(steps) == shard.steps_per_epoch(n, w, b, False)
    assert all(len(idx) == 2 * b for idx in steps[:-1])
    assert set(torch.cat(steps).tolist()) == set(range(n))  # padded epoch still covers the data


def test_the_cut_names_the_batch_a_rank_really_trains_on():
    from distnb.transfer.data import describe_cut
    from distnb.core.plan import TrainPlan

    said = describe_cut(TrainPlan(model="m", data="d", batch_size=1000), {"num_samples": 203}, 2, 2)
    assert said.endswith("1 step/epoch of 102 per rank (--batch-size 1000 is more than the 102 samples a rank "
                         "visits per epoch)")
    said = describe_cut(TrainPlan(model="m", data="d", batch_size=16), {"num_samples": 203}, 2, 2)
    assert said.endswith("7 steps/epoch of 16 per rank")
    said = describe_cut(TrainPlan(model="m", data="d", batch_size=300, strategy="pipeline"), {"num_samples": 203}, 1, 2)
    assert said.endswith("1 step/epoch of 203 (--batch-size 300 is more than the 203 samples a rank visits per epoch)")
