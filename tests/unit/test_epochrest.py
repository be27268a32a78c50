"""The rest of an epoch after resizes (distnb.engine.train.epochrest): every sample once, equal steps on every shard."""

import collections
import itertools

import pytest

from distnb.engine.train import epochrest


def _train_segment(n, trail, num_shards, batch_size, drop_last, steps, seen):
    """Train ``steps`` steps (None: all) of the segment after ``trail`` on ``num_shards`` shards; positions taken."""
    parts = epochrest.layout(n, trail, num_shards)
    lengths = [len(p) for p in parts]
    cuts = [epochrest.cut(lengths, i, 0, batch_size, drop_last) for i in range(num_shards)]
    assert len({len(c) for c in cuts}) == 1, "the shards run different numbers of steps"
    assert all(len(b) for c in cuts for b in c), "an empty batch"
    for i, part in enumerate(parts):
        for b in cuts[i][:steps]:
            seen.update(part[b].tolist())
    return sum(len(b) for b in cuts[0][:steps]) if steps is not None else None


@pytest.mark.parametrize("worlds,batch_size,stops", [((2, 3), 8, (3,)), ((2, 1), 8, (1,)), ((4, 3, 2), 5, (2, 1)),
                                                     ((3, 2, 3), 4, (4, 2)), ((2, 4), 16, (1,)), ((1, 2), 7, (9,))])
@pytest.mark.parametrize("n", [240, 96, 120])
def test_an_epoch_resized_in_the_middle_trains_every_sample_once(n, worlds, batch_size, stops):
    trail = epochrest.new_trail(("d", n), 3, 11, False)
    seen = collections.Counter()
    for world, steps in zip(worlds, stops):
        taken = _train_segment(n, trail, world, batch_size, False, steps, seen)
        trail["segments"].append([world, taken])
    _train_segment(n, trail, worlds[-1], batch_size, False, None, seen)
    assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}


def test_drop_last_trains_each_sample_at_most_once_and_only_full_batches():
    n, batch_size = 100, 8
    trail = epochrest.new_trail(("d", n), 0, 1, True)
    seen = collections.Counter()
    taken = _train_segment(n, trail, 2, batch_size, True, 2, seen)
    trail["segments"].append([2, taken])
    parts = epochrest.layout(n, trail, 3)
    cuts = [epochrest.cut([len(p) for p in parts], i, 0, batch_size, True) for i in range(3)]
    assert all(len(b) == batch_size for c in cuts for b in c)
    for i, part in enumerate(parts):
        seen.update(itertools.chain.from_iterable(part[b].tolist() for b in cuts[i]))
    assert set(seen.values()) == {1}


def test_a_resize_undone_before_any_step_gives_the_position_back():
    class Run:
        epoch, epoch_step, epoch_samples, epoch_data, epoch_trail = 2, 3, 24, ("d", 96), None
        plan_dict = dict(seed=4, drop_last=False, batch_size=8)

    run = Run()
    epochrest.carry(run, 2, 3)
    assert run.epoch_samples == 0 and run.epoch_trail["segments"] == [[2, 24]]
    epochrest.carry(run, 3, 2)
    assert run.epoch_samples == 24 and not epochrest.active(run)
