"""Validation sets of every shape (issue 36, item 12), on the real 2-rank cluster.

``--val-data`` takes what ``--data`` takes, an IterableDataset, and ``make(rank, world_size)``; a set with fewer
samples than ranks (an empty shard) joins the reductions with a count of zero and never hangs. Before, a set of one
sample was refused ("fewer than world_size=2"), as were an IterableDataset and a function. Each figure is checked
against the notebook's own on the returned weights and the whole set (a single-process reference).
"""

import pytest
import torch
import torch.nn.functional as F

from distnb.core.errors import PlanError, RankError
from support.data import parity_data, parity_model

BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
DEFINE = """
import torch
class VsDataset(torch.utils.data.Dataset):
    def __init__(self, x, y): self.x, self.y = x, y
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return self.x[i], self.y[i]
class VsStream(torch.utils.data.IterableDataset):
    def __init__(self, x, y): self.x, self.y = x, y
    def __iter__(self):
        for i in range(len(self.x)):
            yield self.x[i], self.y[i]
def vs_make_uneven(rank, world_size):        # parts of 3 and 2 samples
    return torch.utils.data.TensorDataset(vs_x[rank::world_size], vs_y[rank::world_size])
def vs_make_empty_rank(rank, world_size):    # rank 1's part is empty (a Dataset of no sample)
    return VsDataset(vs_x, vs_y) if rank == 0 else VsDataset(vs_x[:0], vs_y[:0])
def vs_make_stream(rank, world_size):        # each rank streams its part
    return VsStream(vs_x[rank::world_size], vs_y[rank::world_size])
"""


@pytest.fixture
def val_shapes(shell):
    ns = shell.user_ns
    whole = parity_data(n=5, seed=7)
    ns["vs_x"], ns["vs_y"] = whole.tensors
    assert shell.run_cell(DEFINE).error_in_exec is None
    ns["vs_train"], ns["F"] = parity_data(n=96), F
    return ns


def _figures(model, x, y):
    with torch.no_grad():
        out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(-1) == y).float().mean().item()


CASES = {  # name -> (the validation set from the namespace, how many of vs_x's first samples it holds)
    "one sample, tensors": (lambda ns: (ns["vs_x"][:1], ns["vs_y"][:1]), 1),
    "one sample, TensorDataset": (lambda ns: torch.utils.data.TensorDataset(ns["vs_x"][:1], ns["vs_y"][:1]), 1),
    "one sample, Dataset": (lambda ns: ns["VsDataset"](ns["vs_x"][:1], ns["vs_y"][:1]), 1),
    "five samples, uneven shards": (lambda ns: ns["VsDataset"](ns["vs_x"], ns["vs_y"]), 5),
    "IterableDataset": (lambda ns: ns["VsStream"](ns["vs_x"][:3], ns["vs_y"][:3]), 3),
    "make, uneven parts": (lambda ns: ns["vs_make_uneven"], 5),
    "make, an empty part": (lambda ns: ns["vs_make_empty_rank"], 5),
    "make, a stream per rank": (lambda ns: ns["vs_make_stream"], 5),
}


# fsdp: the empty-shard cases (every rank must run every forward: FSDP all-gathers in each)
@pytest.mark.parametrize("case, strategy", [(case, "ddp") for case in CASES] +
                         [("one sample, Dataset", "fsdp"), ("make, an empty part", "fsdp")])
def test_every_shape_of_validation_set_gives_the_whole_sets_figures(dist_session, shell, val_shapes, case, strategy):
    make, n = CASES[case]
    ns = val_shapes
    name = "vs_net_" + strategy
    ns[name] = parity_model()
    ns["vs_val"] = make(ns)
    result = dist_session.train(BODY, model=name, data="vs_train", val_data="vs_val", epochs=2, batch_size=4,
                                optimizer="sgd", lr=0.1, seed=3, strategy=strategy, progress="none", quiet=True)
    assert [e["samples"] for e in result.val_history] == [n, n]  # every sample once; an empty shard counts 0
    loss, acc = _figures(ns[name], ns["vs_x"][:n], ns["vs_y"][:n])
    assert result.val_loss == pytest.approx(loss, rel=1e-5), case
    assert result.val_metric == pytest.approx(acc, abs=1e-6) and result.metric_name == "accuracy"


def test_a_make_whose_parts_differ_in_layout_or_return_no_data_set_names_it(dist_session, shell, val_shapes):
    ns = val_shapes
    ns["vs_net_bad"] = parity_model()
    shell.run_cell("def vs_make_bad(rank, world_size):\n    return vs_x[:, :rank + 2], vs_y\n"
                   "def vs_make_none(rank, world_size):\n    return 3\n"
                   "def vs_make_nothing(rank, world_size):\n    return []")
    for maker, says in (("vs_make_bad", "the parts differ in their columns' shapes or dtypes"),
                        ("vs_make_none", "returned a int, not a data set"),
                        ("vs_make_nothing", "every rank's part is empty")):
        with pytest.raises(RankError, match=says):
            dist_session.train(BODY, model="vs_net_bad", data="vs_train", val_data=maker, epochs=1, batch_size=4,
                               progress="none", quiet=True)
    ns["vs_not_data"] = "a string"
    with pytest.raises(PlanError, match="make\\(rank, world_size\\)"):
        dist_session.train(BODY, model="vs_net_bad", data="vs_train", val_data="vs_not_data", epochs=1,
                           progress="none", quiet=True)
    ok = dist_session.train(BODY, model="vs_net_bad", data="vs_train", val_data="vs_make_uneven", epochs=1,
                            batch_size=4, progress="none", quiet=True)  # the cluster works after each
    assert ok.val_history[0]["samples"] == 5
