"""The kernel's record of what the ranks hold (``holdings.Holdings``, ``data.scatter_line``), no cluster needed."""

import weakref

from distnb.train.holdings import Holdings


class Net:  # any object the notebook binds to the model's name
    pass


def test_a_step_count_belongs_to_the_object_it_was_trained_on():
    """``net = Net()`` run again is new weights: the old object's global step count is not theirs (the ranks would
    count on from it, and a resume would take the new weights for trained ones)."""
    held, old, new = Holdings(), Net(), Net()
    held.objects["net"], held.trained_steps["net"] = weakref.ref(old), 12
    assert held.steps_of("net", old) == 12 and held.steps_of("net", new) is None
    assert held.steps_of("other", old) is None
    held.replaced("net", new)  # the cell that finds the new object forgets the old one's options and steps
    assert "net" not in held.trained_steps and held.steps_of("net", old) is None


def test_the_scatter_line_says_how_the_ranks_hold_the_shards():
    from distnb.transfer.data import scatter_line

    assert scatter_line("X", dict(num_samples=64, num_shards=2), [32, 32]) == "scattered X (64 samples) as shards of 32, 32"
    assert scatter_line("X", dict(num_samples=64, num_shards=1), [64, 64]) == \
        "scattered X (64 samples): every rank holds the whole set (num_shards=1)"  # it read 'shards of 64, 64'
    assert scatter_line("X", dict(num_samples=64, num_shards=2), [32, 32, 32, 32]).endswith(
        "as 2 shards of 32, 32, each held by 2 ranks in a row")
