"""The hang decision (execute/hangs.py) fed ranks' positions and CPU shares (engine/where.py), without a cluster.

A rank computing while another waits for it in a collective is slow, not hung: on the first step there is no step
time to go by, and a big model's first SGD step of 13 s on a busy 2-core machine was named a hang at --hang-after
(10 s) although every rank computed. A rank that waits without computing (a sleep, a lock) is a hang at
--hang-after, as before. The real-cluster side is tests/magics/test_hang_computing.py.
"""

import time
from types import SimpleNamespace

from distnb.core.plan import ClusterSpec
from distnb.engine.process import where
from distnb.execute import hangs


class _Result:
    """Stands for a rank's ipyparallel AsyncResult: still running, or finished."""

    def __init__(self, ready=False):
        self._ready = ready

    def ready(self):
        return self._ready

    def successful(self):
        return True


class _Cluster:
    def __init__(self, spec):
        self.spec, self.engine_ids, self.signalled, self.released = spec, [10, 11], [], []

    def signal(self, sig, ranks):
        self.signalled.append(list(ranks))

    def apply(self, rank, fn, *args):
        self.released.append(rank)

    def host_of(self, rank):
        return "localhost"


def _watch(rank_1, waited=3.0, hang_after=1.0, timeout=30.0, ready_1=False):
    """Rank 0 waited ``waited`` s in all_reduce; rank 1 is at cell line 3 (``rank_1``: its where's extra keys)."""
    now = time.time()
    wheres = {0: dict(state="collective", op="all_reduce", shape=[4], cell_line=4, cell_code="dist.all_reduce(t)",
                      stack=[("<dist-cell-1>", 4, "<module>", "dist.all_reduce(t)")], since=now - waited, sent=now),
              1: dict(dict(state="running", op=None, shape=None, cell_line=3, cell_code="burn()",
                           stack=[("<dist-cell-1>", 3, "<module>", "burn()")], since=now - waited, sent=now), **rank_1)}
    spec = ClusterSpec(num_engines=2, timeout=timeout, hang_after=hang_after)
    return SimpleNamespace(cluster=_Cluster(spec), ars=[_Result(), _Result(ready_1)], wheres=wheres, dead={},
                           progress={}, what="%%dist cell", hang=None)


def test_a_rank_computing_while_the_other_waits_is_not_a_hang_at_hang_after():
    watch = _watch(dict(busy=0.97), waited=3.0)  # 3 s > --hang-after 1 s: named a hang before
    assert hangs.check(watch) is None
    assert watch.cluster.signalled == []  # nobody interrupted


def test_a_rank_waiting_without_computing_is_a_hang_at_hang_after_as_before():
    for quiet in (dict(busy=0.01), dict(busy=None), {}):  # asleep; no second look yet; an older engine's report
        watch = _watch(quiet, waited=1.5)
        hang = hangs.check(watch)
        assert hang is not None and hang["limit"] == 1.0 and hang["computing"] == [], quiet
        assert watch.cluster.signalled == [[1]]
        watch.hang = hang
        text = str(hangs.error(watch, []))
        assert "rank 1 never arrived: it is at cell line 3: `burn()`. Ended after 1 s (--hang-after 1 s, or 5" in text


def test_a_rank_computing_longer_than_patient_computing_times_the_limit_is_named_computing():
    watch = _watch(dict(busy=0.97), waited=4.9)
    assert hangs.check(watch) is None
    watch = _watch(dict(busy=0.97), waited=5.0)
    hang = hangs.check(watch)
    assert hang is not None and hang["limit"] == 5.0 and hang["computing"] == [1]
    watch.hang = hang
    err = hangs.error(watch, [])
    text = str(err)
    assert text.startswith("%%dist cell hung: rank 0 waited 5 s in all_reduce of [4] (cell line 4: "), text
    assert "rank 1 never arrived: it is at cell line 3: `burn()`, computing (97% of a CPU core)." in text, text
    assert ("Ended after 5 s (5 times --hang-after 1 s or 5 of the slowest rank's steps when longer, at most "
            "--timeout: rank 1 was computing), and the process group re-formed") in text, text
    assert err.failures[0]["evalue"] == "it is at cell line 3: `burn()`, computing (97% of a CPU core)"


def test_the_patience_for_a_computing_rank_ends_at_the_timeout():
    watch = _watch(dict(busy=0.97), waited=8.0, hang_after=2.0, timeout=8.0)  # 5 x 2 s is past gloo's 8 s
    hang = hangs.check(watch)
    assert hang is not None and hang["limit"] == 8.0


def test_a_computing_rank_whose_position_is_old_is_not_taken_to_compute():
    # native code holding the GIL keeps a rank from saying where it is: its last busy says nothing of now
    watch = _watch(dict(busy=0.97, sent=time.time() - hangs.STALE - 1), waited=1.5)
    hang = hangs.check(watch)
    assert hang is not None and hang["computing"] == []
    watch.hang = hang
    assert "computing" not in str(hangs.error(watch, []))


def test_a_rank_that_finished_the_cell_is_not_computing_whatever_it_last_said():
    watch = _watch(dict(busy=0.97), waited=1.5, ready_1=True)
    hang = hangs.check(watch)
    assert hang is not None and hang["computing"] == [] and watch.cluster.released == [1]


def test_busy_is_the_share_of_a_core_over_the_last_second_of_looks(monkeypatch):
    clock = {"wall": 100.0, "cpu": 5.0}
    monkeypatch.setattr(where.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(where.time, "process_time", lambda: clock["cpu"])
    dog = where.Watchdog(lambda data: None)
    assert dog._busy() is None  # one look: no interval yet
    for _ in range(4):  # computing: 0.25 s of CPU each 0.25 s
        clock["wall"] += 0.25
        clock["cpu"] += 0.25
        assert dog._busy() == 1.0
    for expected in (0.75, 0.5, 0.25, 0.0, 0.0):  # then asleep: the window forgets the computing looks
        clock["wall"] += 0.25
        clock["cpu"] += 0.0
        assert dog._busy() == expected
