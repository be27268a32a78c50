"""An epoch left in the middle, then ``%dist scale``: the rest of the epoch trains exactly the samples not trained.

Each rank writes the data-set index of every sample whose optimizer step completed (the body's
``ctx.after_backward`` hook, to a file per engine process, so a killed rank's record survives it);
over the interrupted epoch and the cell that finishes it, every index must be there exactly once.
Every test leaves the shared cluster at 2 ranks.
"""

import collections
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

from distnb.core.errors import RankError
from support.data import parity_model
from support.worlds import back_to_two_ranks

N = 240  # 120 samples per rank on 2 ranks, 80 on 3: no padding in the epochs before and after

#: Records the indices of a step's samples once its optimizer step completes; rank 0 interrupts itself (a real
#: SIGINT, as the interrupt button sends) at micro-step ER_STOP; rank 1 dies at micro-step ER_KILL.
BODY = """import os, signal, time
x, y, i = batch
_pend = globals().setdefault("_pend", [])
_pend.extend(i.tolist())
def _flush(p=_pend, path=os.path.join(ER_DIR, str(os.getpid()))):
    with open(path, "a") as f:
        f.write(" ".join(map(str, p)) + "\\n")
    p.clear()
ctx.after_backward(_flush)
if ctx.rank == 0 and 0 <= ER_STOP <= ctx.step and globals().get("_sent") != ER_DIR:  # once a cell
    _sent = ER_DIR
    os.kill(os.getpid(), signal.SIGINT)
if ctx.rank == 1 and ctx.step == ER_KILL:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.05)
loss = F.cross_entropy(model(x), y)"""


#: A map-style Dataset whose samples carry their index, defined in the notebook (it travels by value).
INDEXED = """import torch
class Indexed(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i], i
"""


@pytest.fixture(autouse=True)
def two_ranks(shell):
    yield
    back_to_two_ranks()


def _data(shell, kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 12, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    if kind == "tensor":
        return torch.utils.data.TensorDataset(x, y, torch.arange(N))
    shell.run_cell(INDEXED)
    return shell.user_ns["Indexed"](x, y)


def _seen(folder) -> collections.Counter:
    seen = collections.Counter()
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            seen.update(int(v) for v in f.read().split())
    return seen


def _train(sess, name, accumulate, **kw):
    return sess.train(BODY, model=f"{name}_net", data=f"{name}_data", epochs=1, batch_size=8, seed=5,
                      accumulate=accumulate, optimizer="sgd", lr=0.05, progress="none", quiet=True, **kw)


@pytest.mark.parametrize("kind,world,accumulate", [("tensor", 3, 1), ("tensor", 1, 2), ("dataset", 3, 2),
                                                    ("dataset", 1, 1)])
def test_an_interrupted_epoch_finishes_on_the_new_world_with_exactly_the_untrained_samples(
        shell, dist_session, tmp_path, kind, world, accumulate):
    name = f"er_{kind}_{world}_{accumulate}"
    ns = shell.user_ns
    ns.update({f"{name}_net": parity_model(), f"{name}_data": _data(shell, kind), "F": F, "ER_DIR": str(tmp_path),
               "ER_STOP": 2, "ER_KILL": -1})
    dist_session.push("ER_DIR", "ER_STOP", "ER_KILL")
    first = _train(dist_session, name, accumulate)
    assert first.interrupted, "the self-interrupt did not stop the cell"
    steps = first.rows[0]["steps"]
    assert 0 < steps < 15, f"stopped after {steps} of 15 steps: not in the middle of the epoch"
    dist_session.scale(world, quiet=True)
    ns["ER_STOP"] = -1
    dist_session.push("ER_STOP")
    rest = _train(dist_session, name, accumulate)
    said = rest.rows[0]["note"]
    assert rest.epochs == [0] and not rest.interrupted  # the same epoch, finished
    seen = _seen(tmp_path)
    twice = sorted(i for i, c in seen.items() if c > 1)
    never = sorted(set(range(N)) - set(seen))
    assert not twice and not never, f"{len(twice)} trained twice {twice[:10]}, {len(never)} never {never[:10]}"
    assert f"it goes on with exactly the {N - 2 * 8 * steps} samples it has not trained yet" in said, said
    # the epoch after it is the new world's usual one: every sample once more
    ns["ER_DIR"] = str(tmp_path / "next")
    os.mkdir(ns["ER_DIR"])
    dist_session.push("ER_DIR")
    after = _train(dist_session, name, accumulate)
    assert after.epochs == [1] and sorted(_seen(ns["ER_DIR"]).values()) == [1] * N


def test_a_rank_lost_mid_epoch_then_a_shrink_trains_the_rest_exactly_once(shell, dist_session, tmp_path):
    ns = shell.user_ns
    ns.update(er_lost_net=parity_model(), er_lost_data=_data(shell, "tensor"), F=F, ER_DIR=str(tmp_path), ER_STOP=-1,
              ER_KILL=4)
    dist_session.push("ER_DIR", "ER_STOP", "ER_KILL")
    with pytest.raises(RankError):
        _train(dist_session, "er_lost", 1)
    deadline = time.time() + 10
    while not dist_session.cluster.dead_ranks() and time.time() < deadline:
        time.sleep(0.1)
    dist_session.scale(1, quiet=True)
    dist_session.run("_pend.clear()")  # the failed step's indices (its optimizer step never came)
    ns["ER_KILL"] = -1
    dist_session.push("ER_KILL")
    rest = _train(dist_session, "er_lost", 1)
    assert rest.epochs == [0]
    seen = _seen(tmp_path)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, \
        (sorted(i for i, c in seen.items() if c > 1), sorted(set(range(N)) - set(seen)))
