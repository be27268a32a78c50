"""Data sets loaded on the ranks (distnb.engine.train.datasets): real Datasets, real DataLoader workers, real cluster.

The Dataset classes are defined in the shell's namespace (``__main__``), as a notebook defines
them, so that they travel to the ranks by value.
"""

import os
import re
import shutil

import pytest
import torch

from distnb.engine.train import datasets
from distnb.engine.transport import shard
from distnb.core.errors import PlanError, RankError
from support.data import dropout_model, parity_data, parity_model
from support.reference import reference

DEFINE = r'''
import os, tempfile, time
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset

class Plain(Dataset):
    """The same samples as a TensorDataset, one __getitem__ at a time."""
    def __init__(self, x, y):
        self.x, self.y = x, y
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

CALLS = tempfile.mkdtemp(prefix="distnb-getitem-")

class Logged(Plain):
    """Plain, writing one byte per __getitem__ to a file named for the process that calls it."""
    def __getitem__(self, i):
        with open(os.path.join(CALLS, str(os.getpid())), "a") as f:
            f.write("x")
        return self.x[i], self.y[i]

class Noisy(Dataset):
    """Index i -> (random noise, i): what a random augmentation looks like from outside."""
    def __init__(self, n, slow=0.0):
        self.n, self.slow = n, slow
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        if self.slow:
            time.sleep(self.slow)
        return torch.randn(4), i

class Flaky(Plain):
    bad = 7
    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"corrupt record {i}")
        return self.x[i], self.y[i]

class Ragged(Dataset):
    """Sequences of length 1 + i % 3: default_collate cannot stack them."""
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return torch.ones(1 + i % 3), i % 2

def pad(samples):
    seqs, labels = zip(*samples)
    out = torch.zeros(len(seqs), 3)
    for k, s in enumerate(seqs):
        out[k, :len(s)] = s
    return out, torch.tensor(labels)

class Count(IterableDataset):
    """The stream 0, 1, ..., n-1 as (features, index)."""
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        for i in range(self.n):
            yield torch.full((4,), i / self.n), i

def make_part(rank, world_size):
    g = torch.Generator().manual_seed(rank)
    return Plain(torch.randn(60, 12, generator=g), torch.randint(0, 3, (60,), generator=g))

def make_uneven(rank, world_size):
    return Plain(torch.randn(50 + rank, 12), torch.zeros(50 + rank, dtype=torch.long))
'''
BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
#: A step that records what it saw (on the ranks: the epoch, the indices and the features).
RECORD = "x, i = batch\n_seen.append((ctx.epoch, i.clone(), x.clone()))\nloss = model(x).pow(2).mean()"
QUIET = dict(progress="none", quiet=True)


@pytest.fixture(scope="module")
def ns(shell):
    result = shell.run_cell(DEFINE)
    result.raise_error()
    yield shell.user_ns
    shutil.rmtree(shell.user_ns["CALLS"], ignore_errors=True)


def children(session):
    """The engines' child processes (DataLoader workers), as psutil sees them."""
    import psutil

    return [c for r in session.cluster.ranks for c in psutil.Process(r["pid"]).children(recursive=True)]


def test_map_style_dataset_gives_the_weights_of_the_same_data_as_tensors(dist_session, ns, capsys):
    data = parity_data()
    ns["as_tensors"], ns["as_dataset"] = data, ns["Logged"](*data.tensors)
    ns["m_tensors"], ns["m_dataset"] = parity_model(), parity_model()
    common = dict(epochs=2, batch_size=16, optimizer="adam", lr=0.01, seed=4, progress="none")
    dist_session.train(BODY, model="m_tensors", data="as_tensors", quiet=True, **common)
    r = dist_session.train(BODY, model="m_dataset", data="as_dataset", **common)
    out = capsys.readouterr().out
    assert "203 samples in 2 shards" in out, out
    assert "a map-style Logged sent by value" in out
    assert kernel_calls(ns) <= 1  # the kernel looked at one sample at most
    assert [row["steps"] for row in r.rows] == [14, 14]
    for a, b in zip(ns["m_tensors"].parameters(), ns["m_dataset"].parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # with workers the same samples arrive in the same order: the same weights again
    ns["m_workers"] = parity_model()
    dist_session.train(BODY, model="m_workers", data="as_dataset", workers=2, quiet=True, **common)
    for a, b in zip(ns["m_tensors"].parameters(), ns["m_workers"].parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert children(dist_session) == []  # the workers ended with the cell
    assert kernel_calls(ns) <= 1  # not sent again: the kernel never looked again


def test_dropout_trains_tensors_and_the_same_data_as_a_dataset_to_the_same_weights(dist_session, ns):
    # each rank seeds its own generators at an epoch's first batch from (--seed, epoch, rank) on both paths
    # (a Dataset with --workers 0 in _Indexed, tensors in shards.Shard): the same dropout masks, the same weights
    data = parity_data()
    ns["do_tensors"], ns["do_dataset"] = data, ns["Plain"](*data.tensors)
    ns["do_a"], ns["do_b"] = dropout_model(), dropout_model()
    common = dict(epochs=2, batch_size=16, optimizer="adam", lr=0.01, seed=4, **QUIET)
    a = dist_session.train(BODY, model="do_a", data="do_tensors", **common)
    b = dist_session.train(BODY, model="do_b", data="do_dataset", **common)
    for p_a, p_b in zip(ns["do_a"].parameters(), ns["do_b"].parameters()):
        torch.testing.assert_close(p_a, p_b, atol=1e-6, rtol=0)
    for row_a, row_b in zip(a.rows, b.rows):  # each rank's own last loss
        assert row_a["final_loss"] == pytest.approx(row_b["final_loss"], rel=1e-6)


def test_a_list_of_samples_trains_as_a_dataset_and_validates(dist_session, ns, capsys):
    # list(zip(X, y)), as DataLoader takes it: a map-style data set (it was a PlanError, "[0] is a tuple")
    data = parity_data()
    ns["pairs"] = list(zip(*data.tensors))
    ns["held_out"] = [{"x": x, "y": y} for x, y in zip(*parity_data().tensors)][:40]
    ns["m_tensors2"], ns["m_pairs"] = parity_model(), parity_model()
    common = dict(epochs=2, batch_size=16, optimizer="adam", lr=0.01, seed=4, progress="none")
    dist_session.train(BODY, model="m_tensors2", data=data, quiet=True, **common)
    r = dist_session.train(BODY, model="m_pairs", data="pairs", **common)
    out = capsys.readouterr().out
    assert "pairs: a list of samples sent by value" in out and "203 samples in 2 shards" in out, out
    assert [row["steps"] for row in r.rows] == [14, 14]
    for a, b in zip(ns["m_tensors2"].parameters(), ns["m_pairs"].parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)  # the same cut of the same samples
    r = dist_session.train(BODY.replace("x, y = batch", "x, y = (batch['x'], batch['y']) if isinstance(batch, dict) "
                                        "else batch"), model="m_pairs", data="pairs", val_data="held_out", **common)
    x, y = (torch.stack([s[k] for s in ns["held_out"]]) for k in ("x", "y"))
    with torch.no_grad():  # the notebook's loss on the returned weights: what the ranks reported
        loss = torch.nn.functional.cross_entropy(ns["m_pairs"](x), y).item()
    assert r.val_history[-1]["samples"] == 40 and r.val_loss == pytest.approx(loss, rel=1e-5)


def test_a_dataset_changed_in_place_is_sent_again(dist_session, ns):
    """``ds.x[:] = 0`` moves no tensor and leaves the pickle as it was; the ranks must still get the new data."""
    x, y = parity_data().tensors
    ns["inplace_ds"], ns["inplace_net"] = ns["Plain"](x.clone(), y.clone()), parity_model()
    body = "x, y = batch\n_seen.append((float(x.abs().sum()), x.numel()))\nloss = F.cross_entropy(model(x), y)"
    kw = dict(model="inplace_net", data="inplace_ds", epochs=1, batch_size=256, **QUIET)

    def seen():  # (sum of |x| over every batch of every rank, elements in them)
        dist_session.run("_seen = []")
        dist_session.train(body, **kw)
        rows = [row for rank in dist_session.pull("_seen") for row in rank]
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    total, elements = seen()
    assert total > elements * 0.1
    ns["inplace_ds"].x[:] = 0
    assert seen() == (0.0, elements)
    ns["inplace_ds"].x += 1
    assert seen() == (pytest.approx(elements), elements)
    assert seen() == (pytest.approx(elements), elements)  # unchanged since: the same


def kernel_calls(ns):
    path = os.path.join(ns["CALLS"], str(os.getpid()))
    return os.path.getsize(path) if os.path.exists(path) else 0


def _seen(session):
    """Per rank: {(epoch, index): features} recorded by RECORD."""
    out = []
    for rows in session.pull("_seen"):
        out.append({(e, int(i)): x[k] for e, idx, x in rows for k, i in enumerate(idx)})
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_augmentation_is_new_each_epoch_and_rank_and_the_same_for_the_same_seed(dist_session, ns, workers):
    ns["noisy"] = ns["Noisy"](24)
    runs = []
    for k in range(2):
        ns[f"lin_{workers}_{k}"] = torch.nn.Linear(4, 1)
        dist_session.run("_seen = []")
        dist_session.train(RECORD, model=f"lin_{workers}_{k}", data="noisy", epochs=2, batch_size=4, seed=9,
                           workers=workers, **QUIET)
        runs.append(_seen(dist_session))
    first, again = runs
    for rank in (0, 1):
        assert first[rank].keys() == again[rank].keys()
        for key, x in first[rank].items():
            assert torch.equal(x, again[rank][key])  # same seed, same samples
        mine = {i for (_, i) in first[rank]}
        for i in mine:
            assert not torch.equal(first[rank][(0, i)], first[rank][(1, i)])  # new noise each epoch
    assert not torch.equal(next(iter(first[0].values())), next(iter(first[1].values())))
    assert {i for (_, i) in first[0]}.isdisjoint({i for (_, i) in first[1]})
    assert {i for (_, i) in first[0]} | {i for (_, i) in first[1]} == set(range(24))


def test_workers_run_during_the_cell_and_are_gone_after_it(dist_session, ns):
    ns["noisy"], ns["lin_kids"] = ns["Noisy"](16), torch.nn.Linear(4, 1)
    body = "import psutil\n_kids = len(psutil.Process().children())\n" + RECORD
    dist_session.run("_seen = []")
    dist_session.train(body, model="lin_kids", data="noisy", epochs=2, batch_size=4, workers=2, prefetch_factor=1,
                       **QUIET)
    assert dist_session.pull("_kids") == [2, 2]
    assert children(dist_session) == []


def test_collate_function_and_the_error_without_one(dist_session, ns):
    ns["ragged"], ns["lin_pad"] = ns["Ragged"](), torch.nn.Linear(3, 2)
    with pytest.raises(RankError) as err:
        dist_session.train(BODY, model="lin_pad", data="ragged", batch_size=4, **QUIET)
    text = str(err.value)
    assert "cannot be batched by torch's default_collate" in text and "--collate" in text and "samples [" in text
    assert re.search(r"the samples are \(float32\[\d\], int\) and \(float32\[\d\], int\)", text), text
    r = dist_session.train(BODY, model="lin_pad", data="ragged", batch_size=4, collate="pad", workers=1, **QUIET)
    assert [row["steps"] for row in r.rows] == [5, 5]
    assert children(dist_session) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_raises_names_the_rank_and_index_and_the_next_cell_works(dist_session, ns, workers):
    data = parity_data(n=40)
    ns["flaky"], ns["m_flaky"] = ns["Flaky"](*data.tensors), parity_model()
    owner = next(r for r, idx in enumerate(shard.assign(40, 2, 0)) if 7 in idx.tolist())
    with pytest.raises(RankError) as err:
        dist_session.train(BODY, model="m_flaky", data="flaky", batch_size=4, workers=workers, **QUIET)
    assert err.value.rank == owner
    assert f"rank {owner}: flaky[7] raised ValueError: corrupt record 7" in str(err.value)
    assert "Fix the Dataset's __getitem__ for index 7" in str(err.value)
    shown = err.value.failures[0]["traceback"]  # the Dataset's own frame, with its line, in a worker or not
    assert 'raise ValueError(f"corrupt record {i}")' in shown and "__getitem__" in shown, shown
    assert children(dist_session) == []
    ns["flaky"].bad = -1  # fixed: sent again (its attributes changed) and trains
    r = dist_session.train(BODY, model="m_flaky", data="flaky", batch_size=4, workers=workers, **QUIET)
    assert [row["steps"] for row in r.rows] == [5, 5]


def test_make_runs_on_each_rank_and_uneven_parts_are_an_error(dist_session, ns, capsys):
    ns["m_make"] = parity_model()
    r = dist_session.train(BODY, model="m_make", data="make_part", batch_size=16, epochs=2, progress="none")
    out = capsys.readouterr().out
    assert "make_part(rank, world_size) runs on each rank" in out and "parts of 60 samples" in out, out
    assert [row["samples"] for row in r.rows] == [120, 120]
    with pytest.raises(PlanError, match=r"different lengths on the ranks \(rank 0: 50, rank 1: 51\)"):
        dist_session.train(BODY, model="m_make", data="make_uneven", batch_size=16, **QUIET)
    dist_session.train(BODY, model="m_make", data="make_part", batch_size=16, **QUIET)  # usable after
    ns["make_none"] = lambda: None  # takes no (rank, world_size): said in the kernel, before anything is sent
    with pytest.raises(PlanError, match=r"each rank calls make_none\(rank, world_size\).*does not take those two"):
        dist_session.train(BODY, model="m_make", data="make_none", batch_size=16, **QUIET)


def test_a_dataset_made_on_the_ranks_is_used_by_name(dist_session, ns):
    dist_session.run("import torch\nfrom torch.utils.data import TensorDataset, Dataset\n"
                     "class OnRanks(Dataset):\n"
                     "    def __len__(self): return 30\n"
                     "    def __getitem__(self, i): return torch.full((12,), float(i)), i % 3\n"
                     "made_there = OnRanks()")
    assert "made_there" not in ns
    ns["m_there"] = parity_model()
    r = dist_session.train(BODY, model="m_there", data="made_there", data_on_ranks=True, batch_size=5, **QUIET)
    assert [row["samples"] for row in r.rows] == [15, 15]
    with pytest.raises(RankError, match="no such name on this rank"):
        dist_session.train(BODY, model="m_there", data="not_there", data_on_ranks=True, **QUIET)


def test_a_stream_is_split_across_ranks_and_workers_without_duplicates(dist_session, ns):
    ns["count"] = ns["Count"](103)
    for workers in (0, 2):
        ns[f"lin_stream_{workers}"] = torch.nn.Linear(4, 1)
        dist_session.run("_seen = []")
        r = dist_session.train(RECORD, model=f"lin_stream_{workers}", data="count", batch_size=5, workers=workers,
                               **QUIET)
        seen = [[int(i) for _, idx, _ in rows for i in idx] for rows in dist_session.pull("_seen")]
        both = seen[0] + seen[1]
        assert len(both) == len(set(both))  # no sample twice
        assert r.rows[0]["steps"] == r.rows[1]["steps"] >= 9  # the first stream to end ended the epoch: no hang
        assert len(both) >= 90
    dist_session.run("_seen = []")
    r = dist_session.train(RECORD, model="lin_stream_0", data="count", batch_size=5, steps_per_epoch=3, epochs=2,
                           **QUIET)
    assert [row["steps"] for row in r.rows] == [6, 6]
    ns["m_make"] = parity_model()
    with pytest.raises(PlanError, match="--steps-per-epoch is for an IterableDataset"):
        dist_session.train(BODY, model="m_make", data="make_part", steps_per_epoch=3, **QUIET)
    assert children(dist_session) == []
    ns["m_never_sent"], ns["plain_set"] = parity_model(), ns["Plain"](*parity_data().tensors)
    with pytest.raises(PlanError, match="--steps-per-epoch is for an IterableDataset.*has 203 samples"):
        dist_session.train(BODY, model="m_never_sent", data="plain_set", steps_per_epoch=3, **QUIET)
    assert "m_never_sent" not in dist_session.holdings.models  # refused before the model was sent


def test_a_stream_that_gives_a_rank_no_sample_is_an_error_not_a_success(dist_session, ns):
    """It ended as a success with 0 steps, a nan loss and the epoch count moved on: here rank 1's part of a make
    stream is empty, then a stream over a generator is empty from its second pass."""
    shell_ns = ns
    dist_session.run("_seen = []")
    exec("def make_half_empty(rank, world_size):\n    return Count(0 if rank == 1 else 40)\n"
         "class Once(IterableDataset):\n    def __init__(self, n):\n        self.it = iter(range(n))\n"
         "    def __iter__(self):\n        for i in self.it:\n            yield torch.full((4,), 0.5), i", shell_ns)
    shell_ns["lin_empty"] = torch.nn.Linear(4, 1)
    for data, epochs, says in (("make_half_empty", 1, "gave rank 1 no sample in epoch 0"),
                               ("once", 2, "gave every rank no sample in epoch 1")):
        shell_ns["once"] = shell_ns["Once"](40)
        with pytest.raises(RankError, match=says):
            dist_session.train(RECORD, model="lin_empty", data=data, batch_size=5, epochs=epochs, **QUIET)
    dist_session.run("_seen = []")
    shell_ns["count"] = shell_ns["Count"](103)
    assert dist_session.train(RECORD, model="lin_empty", data="count", batch_size=5, **QUIET).rows[0]["steps"] > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_that_raises_is_named_at_the_sample_that_raised(dist_session, ns, workers):
    """Each rank reads the whole stream and keeps its part: the ranks (and workers) that do not own sample 37 named
    the next sample of their own part (38, 40)."""
    exec("class Boom(IterableDataset):\n    def __iter__(self):\n        for i in range(200):\n"
         "            if i == 37:\n                raise KeyError('broken record 37')\n"
         "            yield torch.full((4,), 0.5), i", ns)
    ns["boom"], ns["lin_boom"] = ns["Boom"](), torch.nn.Linear(4, 1)
    dist_session.run("_seen = []")
    with pytest.raises(RankError) as err:
        dist_session.train(RECORD, model="lin_boom", data="boom", batch_size=16, workers=workers, **QUIET)
    text = str(err.value)
    assert "broken record 37" in text and "at sample 37" in text, text
    assert not re.search(r"at sample (?!37\b)\d+", text), text


def test_loader_options_with_tensors_are_an_error(dist_session, ns):
    ns["as_tensors"], ns["m_tensors"] = parity_data(), parity_model()
    with pytest.raises(PlanError, match="--workers: for a Dataset loaded on the ranks"):
        dist_session.train(BODY, model="m_tensors", data="as_tensors", workers=2, **QUIET)
    with pytest.raises(PlanError, match="--prefetch-factor needs --workers"):
        dist_session.train(BODY, model="m_tensors", data="as_tensors", prefetch_factor=4, **QUIET)


def test_workers_end_when_the_cell_is_interrupted(dist_session, ns):
    import time

    ns["slowish"], ns["lin_stop"] = ns["Noisy"](400, slow=0.002), torch.nn.Linear(4, 1)
    dist_session.run("_seen = []")
    dist_session.train(RECORD, model="lin_stop", data="slowish", epochs=100, batch_size=8, workers=2,
                       background=True, **QUIET)
    deadline = time.monotonic() + 30
    while len(children(dist_session)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(children(dist_session)) == 4  # two workers on each rank
    dist_session.stop_training(quiet=True)
    assert children(dist_session) == []


def test_the_magic_takes_the_loader_options(shell, dist_session, ns):
    ns["ragged"], ns["lin_magic"] = ns["Ragged"](), torch.nn.Linear(3, 2)
    result = shell.run_cell("%%distrain --model lin_magic --data ragged --batch-size 4 --workers 1 "
                            "--prefetch-factor 3 --collate pad --progress none -o magic_run\n" + BODY)
    result.raise_error()
    assert [row["steps"] for row in ns["magic_run"].rows] == [5, 5]
    assert ns["magic_run"].plan.collate == "pad" and ns["magic_run"].plan.prefetch_factor == 3


def test_a_strategy_that_trains_every_rank_on_the_same_batches_gets_the_whole_set(dist_session, ns):
    data = parity_data(n=64)
    ns["tp_tensors"], ns["tp_dataset"] = data, ns["Plain"](*data.tensors)
    ns["tp_a"], ns["tp_b"] = parity_model(), parity_model()
    common = dict(epochs=1, batch_size=16, optimizer="sgd", lr=0.1, seed=2, strategy="tensor", **QUIET)
    dist_session.train(BODY, model="tp_a", data="tp_tensors", **common)
    r = dist_session.train(BODY, model="tp_b", data="tp_dataset", **common)
    assert [row["samples"] for row in r.rows] == [64, 64]  # every rank saw all of it
    for a, b in zip(ns["tp_a"].parameters(), ns["tp_b"].parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("strategy,mesh", [("tensor", None), ("fsdp+tensor", "1x2")])
def test_tensor_parallel_ranks_draw_the_same_dropout_masks_as_one_process(dist_session, ns, strategy, mesh):
    # the ranks of a tensor-parallel group train on the same batches: on tensor data they must draw the same
    # numbers (here a dropout on replicated activations), those one process seeded per epoch draws
    data = parity_data(n=64)
    ns["tpd_tensors"], ns["tpd_dataset"] = data, ns["Plain"](*data.tensors)
    ns["tpd_a"], ns["tpd_b"], ns["tpd_c"], ref = dropout_model(), dropout_model(), dropout_model(), dropout_model()
    common = dict(epochs=2, batch_size=16, optimizer="sgd", lr=0.1, seed=2, strategy=strategy, **QUIET)
    if mesh is not None:
        common["mesh"] = mesh
    r = dist_session.train(BODY, model="tpd_a", data="tpd_tensors", **common)
    assert r.rows[0]["final_loss"] == pytest.approx(r.rows[1]["final_loss"], rel=1e-6)  # each rank's own loss
    dist_session.train(BODY, model="tpd_b", data="tpd_dataset", **common)
    reference(ref, data, num_shards=1, batch_size=16, epochs=2, seed=2, optimizer=torch.optim.SGD, lr=0.1,
              seed_epochs=True)
    for p_a, p_b, p_ref in zip(ns["tpd_a"].parameters(), ns["tpd_b"].parameters(), ref.parameters()):
        torch.testing.assert_close(p_a, p_b, atol=1e-6, rtol=0)
        torch.testing.assert_close(p_a, p_ref, atol=1e-5, rtol=1e-5)
    # what the body draws: the same on both ranks, from (--seed, epoch, data shard 0) at each epoch's start
    draw = "x, y = batch\n_tpd_draws.append(torch.rand(1).item())\nloss = F.cross_entropy(model(x), y)"
    dist_session.run("_tpd_draws = []")
    dist_session.train(draw, model="tpd_c", data="tpd_tensors", **common)
    draws = dist_session.pull("_tpd_draws")
    assert len(draws[0]) == 8 and draws[0] == draws[1]
    with torch.random.fork_rng():
        firsts = [(datasets.seed_epoch(2, epoch, 0), torch.rand(1).item())[1] for epoch in (0, 1)]
    assert [draws[0][0], draws[0][4]] == pytest.approx(firsts, rel=1e-7)


@pytest.mark.parametrize("strategy,mesh", [("tensor", None), ("fsdp+tensor", "1x2")])
def test_with_workers_the_ranks_still_seed_themselves_per_epoch_and_draw_the_same_dropout(dist_session, ns,
                                                                                          strategy, mesh):
    # --workers 1: the samples load in a worker, but the forward (its dropout) runs on the rank, whose own
    # generator is seeded from (--seed, epoch, data shard 0) as with --workers 0
    data = parity_data(n=64)
    ns["tpw_dataset"] = ns["Plain"](*data.tensors)
    ns["tpw_a"], ns["tpw_b"], ref = dropout_model(), dropout_model(), dropout_model()
    common = dict(epochs=2, batch_size=16, optimizer="sgd", lr=0.1, seed=2, strategy=strategy, workers=1, **QUIET)
    if mesh is not None:
        common["mesh"] = mesh
    r = dist_session.train(BODY, model="tpw_a", data="tpw_dataset", **common)
    assert r.rows[0]["final_loss"] == pytest.approx(r.rows[1]["final_loss"], rel=1e-6)
    reference(ref, data, num_shards=1, batch_size=16, epochs=2, seed=2, optimizer=torch.optim.SGD, lr=0.1,
              seed_epochs=True)
    for p_a, p_ref in zip(ns["tpw_a"].parameters(), ref.parameters()):
        torch.testing.assert_close(p_a, p_ref, atol=1e-5, rtol=1e-5)
    draw = "x, y = batch\n_tpw_draws.append(torch.rand(1).item())\nloss = F.cross_entropy(model(x), y)"
    dist_session.run("_tpw_draws = []")
    dist_session.train(draw, model="tpw_b", data="tpw_dataset", **common)
    draws = dist_session.pull("_tpw_draws")
    with torch.random.fork_rng():
        firsts = [(datasets.seed_epoch(2, epoch, 0), torch.rand(1).item())[1] for epoch in (0, 1)]
    assert draws[0] == draws[1] and [draws[0][0], draws[0][4]] == pytest.approx(firsts, rel=1e-7)
