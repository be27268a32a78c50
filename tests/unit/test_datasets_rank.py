"""distnb.engine.train.datasets in this process (no workers, no process group): the cut, the seeds, the messages."""

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from distnb.engine.train import datasets
from distnb.engine.process import runtime
from distnb.engine.transport import shard
from distnb.core.plan import TrainPlan


@pytest.fixture(autouse=True)
def rank_1(monkeypatch):
    monkeypatch.setattr(runtime.STATE, "rank", 1)


class Rows(Dataset):
    def __init__(self, n):
        self.x = torch.arange(n, dtype=torch.float32)[:, None]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i


def plan(**given):
    return TrainPlan(model="m", data="d", **given)


@pytest.mark.parametrize("n,drop_last", [(203, False), (203, True), (10, False)])
def test_a_map_style_set_is_cut_as_the_tensor_path_cuts_it(n, drop_last):
    p = plan(batch_size=4, seed=3, drop_last=drop_last)
    everyone = []
    for index in (0, 1):
        source = datasets.Source("d", Rows(n), "dataset", 2, index, {})
        for epoch in (0, 1):
            expected = shard.assign(n, 2, 3)[index][shard.epoch_order(n, 2, index, 3, epoch, drop_last)]
            assert torch.equal(source.indices(p, epoch), expected)
        got = [b for _, (x, i) in source.epoch(p, 0, 0, torch.device("cpu")) for b in i.tolist()]
        assert got == source.indices(p, 0)[:len(got)].tolist()
        assert source.steps_per_epoch(p) == shard.steps_per_epoch(n, 2, 4, drop_last)
        everyone += set(got)
    assert len(everyone) == len(set(everyone))  # disjoint
    if not drop_last:
        assert set(everyone) == set(range(n))  # covering
        source.close()


def test_a_part_is_visited_whole_and_reshuffled_each_epoch():
    source = datasets.Source("d", Rows(9), "part", 2, 1, {})
    p = plan(batch_size=4)
    epochs = [[i for _, (_, idx) in source.epoch(p, e, 0, torch.device("cpu")) for i in idx.tolist()] for e in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(9)) and epochs[0] != epochs[1]
    assert source.num_samples == 18 and source.steps_per_epoch(p) == 3


def test_seeds_come_from_seed_epoch_rank_and_worker():
    a = datasets.seed_all(1, 2, 3, 0)
    x = torch.randn(3)
    assert datasets.seed_all(1, 2, 3, 0) == a and torch.equal(torch.randn(3), x)
    assert len({datasets.seed_all(*k) for k in [(1, 2, 3, 0), (1, 3, 3, 0), (1, 2, 4, 0), (1, 2, 3, 1)]}) == 4


def _draws_after_each_batch(data, p, epoch, skip):
    """``torch.rand(2)`` after each batch of ``data``'s epoch (what a step's dropout draws), then the cell's end."""
    draws = [torch.rand(2) for _ in data.epoch(p, epoch, skip, torch.device("cpu"))]
    data.close()
    return torch.cat(draws)


@pytest.mark.parametrize("num_shards,index", [(1, 0), (2, 1)])
def test_tensors_seed_the_rank_as_a_dataset_without_workers_does(num_shards, index):
    from distnb.engine.train.shards import Shard

    n, p = 37, plan(batch_size=4, seed=5)
    x, y = torch.randn(n, 3), torch.arange(n)
    mine = shard.assign(n, num_shards, 5)[index]
    tensors = Shard(n, num_shards, 5, index, ("tuple", 2), [x[mine], y[mine]])
    source = datasets.Source("d", TensorDataset(x, y), "dataset", num_shards, index, {})
    with torch.random.fork_rng():
        seen = {}
        for epoch, skip in [(0, 0), (1, 0), (1, 8)]:  # two epochs, and the second resumed 8 samples in
            torch.manual_seed(100 + epoch)  # whatever the rank drew before: the epoch's first batch reseeds
            a = _draws_after_each_batch(tensors, p, epoch, skip)
            torch.manual_seed(200 + epoch)
            b = _draws_after_each_batch(source, p, epoch, skip)
            assert torch.equal(a, b)
            datasets.seed_all(5, epoch, index, 0)
            assert torch.equal(a[:2], torch.rand(2))  # from (--seed, epoch, data shard, no worker)
            seen[epoch, skip] = a
        assert not torch.equal(seen[0, 0][:2], seen[1, 0][:2])  # a new epoch, new draws
        assert torch.equal(seen[1, 8][:2], seen[1, 0][:2])  # a resumed epoch starts from the epoch's seed


def test_a_stream_is_split_into_disjoint_parts():
    class Count(IterableDataset):
        def __iter__(self):
            return iter((torch.tensor([float(i)]), i) for i in range(23))

    def read(index, batch_size=3):
        batcher = datasets.Batcher("s", index)
        part = datasets._Split(Count(), "s", index, 2, index, 0, 0, batcher, batch_size, False)
        return [i for _, idx in part for i in idx.tolist()]

    parts = [read(0), read(1)]
    assert parts[0] == list(range(0, 23, 2)) and parts[1] == list(range(1, 23, 2))

    class Hooked(Count):
        def iter_part(self, part, num_parts):  # the dataset's own split wins
            return iter([(torch.tensor([0.0]), 100 + part)])

    batcher = datasets.Batcher("s", 0)
    assert [i for _, idx in datasets._Split(Hooked(), "s", 1, 2, 1, 0, 0, batcher, 3, False) for i in idx.tolist()] \
        == [101]


def test_errors_name_the_rank_the_indices_and_the_fix():
    class Bad(Rows):
        def __getitem__(self, i):
            if i == 5:
                raise KeyError("no record")
            return torch.ones(1 + i % 2), i

    indexed = datasets._Indexed(Bad(8), "bad", 1, 0, datasets.Batcher("bad", 1))
    with pytest.raises(datasets.SampleError, match=r"rank 1: bad\[5\] raised KeyError: 'no record'.*index 5"):
        indexed.__getitems__((0, [4, 5]))
    with pytest.raises(datasets.SampleError) as err:
        indexed.__getitems__((0, [0, 1]))
    text = str(err.value)
    assert "samples [0, 1] of bad cannot be batched" in text and "(float32[1], int) and (float32[2], int)" in text
    assert "--collate NAME" in str(err.value)


@pytest.mark.parametrize("message,words", [
    ("DataLoader worker (pid(s) 4242) exited unexpectedly", ["rank 1 died", "out-of-memory killer", "--workers 0"]),
    ("DataLoader worker (pid 4242) is killed by signal: Killed. ", ["rank 1 died", "--prefetch-factor"]),
    ("unable to write to file </torch_17_238_0>: No space left on device (28)", ["out of shared memory", "/dev/shm",
                                                                                 "MiB free of", "--shm-size"]),
    ("DataLoader worker (pid 77) is killed by signal: Bus error. It is possible that dataloader's workers are out "
     "of shared memory. Please try to raise your shared memory limit.", ["out of shared memory", "--shm-size"]),
])
def test_worker_failures_get_the_diagnosis_and_the_fix(message, words):
    exc = RuntimeError(message)
    datasets.explain(exc, "while loading samples [1, 2]")
    text = str(exc)
    assert text.startswith(message) and all(w in text for w in words), text
    datasets.explain(exc)
    assert str(exc).count("[distnb]") == 1
    other = RuntimeError("something else")
    datasets.explain(other)
    assert str(other) == "something else"


def test_the_kernel_sends_datasets_by_value_and_tensors_as_shards():
    from distnb.transfer import data
    from distnb.core.errors import PlanError

    class NoLen(Dataset):
        def __getitem__(self, i):
            return i

    assert data.path_of(plan(), TensorDataset(torch.zeros(3)))[0] == "tensors"
    assert data.path_of(plan(), (torch.zeros(3), torch.zeros(3)))[0] == "tensors"
    assert data.path_of(plan(), Rows(3))[0] == "dataset"
    assert data.path_of(plan(), datasets._Split(Rows(3), "s", 0, 1, 0, 0, 0, None, 1, False))[0] == "stream"
    assert data.path_of(plan(), lambda rank, world_size: Rows(3))[0] == "factory"
    assert data.path_of(plan(data_on_ranks=True), None)[0] == "ranks"
    with pytest.raises(PlanError, match="without __len__"):
        data.path_of(plan(), NoLen())
    with pytest.raises(PlanError, match="--workers, --collate: for a Dataset loaded on the ranks"):
        data.path_of(plan(workers=1, collate="f"), torch.zeros(3))


def test_the_kernel_looks_at_one_sample_and_stops_what_cannot_be_batched():
    from distnb.transfer import data
    from distnb.core.errors import PlanError

    class Strings(Rows):
        calls = []

        def __getitem__(self, i):
            Strings.calls.append(i)
            return object()

    with pytest.raises(PlanError, match="sample 0 is object, which torch's default_collate cannot batch"):
        data._sample(plan(), Strings(3))
    assert Strings.calls == [0]
    assert data._sample(plan(collate="mine"), Strings(3)) == "samples like object"
    assert data._sample(plan(), Rows(3)) == "samples like (float32[1], int)"
