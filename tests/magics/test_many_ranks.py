"""16 real ranks on this 2-core machine (issue 20): start, train, fail, interrupt, stop, nothing left.

One cluster of 16 CPU engines, forked from the kernel's engine template, started once for the
module through the Python API behind the magics (the shared 2-rank cluster is left alone), then,
in order: a DDP cell that matches one process trained on the global batch; output that every
rank prints the same, shown once; the same error on every rank, shown once with the rank list;
one failing rank among 16, named, the cell ended within seconds, the cluster usable after it; an
interrupt that stops every rank after the same step; and ``stop``, after which none of the
processes the cluster started is alive. The figures at 2-32 ranks are benchmarks/ranks.py's.
"""

import os
import re
import signal
import threading
import time

import psutil
import pytest
import torch
import torch.nn.functional as F

from distnb.cluster import zygote
from distnb.cluster.cluster import Cluster
from distnb.cluster.defaults import default_spec
from support.cells import interrupted
from distnb.core.errors import RankError
from distnb.session import Session
from support.data import parity_data, parity_model
from support.reference import reference

N = 16
BODY = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
#: Seconds a failing rank may take to be named, the cell ended (the cell's own start-up included).
FAIL_BOUND = 20.0


@pytest.fixture(scope="module")
def many():
    session = Session(Cluster(default_spec(n=N, timeout=30)).start(), ns={"F": F})
    try:
        yield session
    finally:
        if session.running:
            session.stop(quiet=True)


def _alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_16_ranks_start_forked_and_form_one_group(many):
    assert many.world_size == N
    pids = [r["pid"] for r in many.cluster.ranks]
    assert len(set(pids)) == N and [r["rank"] for r in many.cluster.ranks] == list(range(N))
    template = zygote.get()
    assert all(psutil.Process(p).ppid() == template.pid for p in pids)  # forked from the template
    assert all(r["num_threads"] == 1 for r in many.cluster.ranks)
    many.run("import torch, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)")
    assert float(many.pull("t", rank=N - 1)) == N * (N + 1) / 2


def test_ddp_on_16_ranks_matches_one_process(many):
    ns = many._ns
    ns["net16"], ns["data16"] = parity_model(), parity_data()
    ref = parity_model()
    result = many.train(BODY, model="net16", data="data16", epochs=2, batch_size=4, optimizer="sgd", lr=0.1,
                        seed=3, progress="none", quiet=True)
    reference(ref, ns["data16"], num_shards=N, batch_size=4, epochs=2, seed=3, optimizer=torch.optim.SGD, lr=0.1)
    assert [row["steps"] for row in result.rows] == [2 * 4] * N  # ceil(ceil(203 / 16) / 4) = 4 steps per epoch
    for p_dist, p_ref in zip(ns["net16"].parameters(), ref.parameters()):
        torch.testing.assert_close(p_dist, p_ref, atol=1e-5, rtol=1e-5)


def test_the_same_line_from_16_ranks_is_shown_once(many, capsys):
    many.run("print('loaded the shard')\nprint(f'rank {rank} of {world_size}')", all_output=True)
    out = capsys.readouterr().out
    assert out.count("loaded the shard") == 1 and "[ranks 0-15] loaded the shard" in out, out
    assert all(f"[rank {r}] rank {r} of 16" in out for r in range(N)), out


def test_the_same_error_on_16_ranks_is_shown_once_with_the_rank_list(many):
    with pytest.raises(RankError) as info:
        many.run("raise ValueError('no such file: data.csv')")
    err = info.value
    assert sorted(err.ranks) == list(range(N))
    assert str(err).startswith("%%dist cell failed on ranks 0-15") and "(the same error on each)" in str(err), err
    shown = "\n".join(err._render_traceback_())
    assert shown.count("--- traceback from") == 1 and shown.count("no such file: data.csv") >= 1, shown


def test_one_failing_rank_of_16_is_named_within_seconds(many):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        many.train(BODY.replace("loss =", "if rank == 11 and ctx.step == 3:\n    raise ValueError('bad batch')\nloss ="),
                   model="net16", data="data16", epochs=50, batch_size=4, progress="none", quiet=True)
    seconds = time.monotonic() - t0
    err = info.value
    assert err.rank == 11 and err.ename == "ValueError" and sorted(err.ranks) == list(range(N)), err
    assert "ranks 0-10,12-15 were stopped as a consequence" in str(err), err
    # the others' pending all-reduce ended at once (engine/abort.py), not at gloo's timeout (30 s here)
    assert all(f["ename"] == "PeerFailed" for f in err.failures[1:]), [f["ename"] for f in err.failures]
    assert seconds < FAIL_BOUND, f"naming the failed rank took {seconds:.1f} s"
    many.run("t = torch.ones(1)\ndist.all_reduce(t)")  # the group re-formed: the next cell works
    assert float(many.pull("t", rank=0)) == N


def test_one_rank_of_16_whose_copy_drifts_is_named_against_the_majority(many):
    """--check-replicas: with a majority of equal copies the rank that changed is the one named."""
    many.ns["drift16"], many.ns["data"] = parity_model(), parity_data()
    noisy = ("if ctx.rank == 5 and ctx.step == 2:\n    import torch\n    with torch.no_grad():\n"
             "        model.module[0].bias.add_(0.25)\n") + BODY
    with pytest.raises(RankError, match=r"replicas drifted apart at the end of epoch 0: 0\.bias: rank 5's copy "
                                        r"differs from rank 0's \(and 14 more\), largest difference 0\.2"):
        many.train(noisy, model="drift16", data="data", epochs=1, batch_size=4, lr=0.1, progress="none", quiet=True)


def test_an_interrupt_stops_all_16_ranks_after_the_same_step(many, tmp_path):
    mark, done = tmp_path / "training", threading.Event()

    def interrupt_once_training():  # a fixed delay could land before the first step on a loaded machine
        deadline = time.monotonic() + 120
        while not mark.exists() and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        if mark.exists() and not done.is_set():
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

    watcher = threading.Thread(target=interrupt_once_training, daemon=True)
    watcher.start()
    body = f"if rank == 0 and ctx.step == 5:\n    open({str(mark)!r}, 'w').close()\n" + BODY
    try:
        result = interrupted(many.train, body, model="net16", data="data16", epochs=10_000, batch_size=4,
                             progress="none", quiet=True).result
    finally:
        done.set()
        watcher.join(5)
    assert result.interrupted and result.stop_reason == "interrupted"
    steps = {row["steps"] for row in result.rows}
    assert len(steps) == 1 and steps.pop() > 0, [row["steps"] for row in result.rows]
    assert "every rank stopped after the same step" in result.interrupted_message
    # one position for all N ranks: said once (each rank's own, had they differed)
    assert re.search(r"\(every rank: (epoch \d+, step \d+|after epoch \d+)\)", result.interrupted_message), \
        result.interrupted_message
    many.run("import torch\n_w = torch.cat([p.detach().flatten() for p in net16.parameters()])")
    flats = many.pull("_w")
    assert all(torch.equal(flats[0], w) for w in flats)  # identical replicas: no step half-applied


def test_stop_leaves_nothing_of_16_ranks(many):
    cluster = many.cluster
    procs = [psutil.Process(p) for p in {*cluster.family, *(r["pid"] for r in cluster.ranks)}]
    assert len(procs) >= N + 1  # the engines and the controller (and the reaper's charges)
    t0 = time.monotonic()
    many.stop(quiet=True)
    while any(_alive(p) for p in procs) and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    left = [p.pid for p in procs if _alive(p)]
    assert not left, f"{len(left)} processes left after stop: {left}"
