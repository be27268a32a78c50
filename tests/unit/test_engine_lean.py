"""What makes each call on a rank cheaper (engine/lean.py, engine/where.py's looker), without a cluster.

The real-cluster side (output still arrives, folded and complete, with ``busy`` left out and lazy
flushes) is what tests/magics/test_magics.py and test_ux.py check on every cell.
"""

import io
import threading
import time

from distnb.engine.process import lean, where


class _Stream:
    """Stands for ipykernel's OutStream: ``pub_thread`` marks it; ``flush`` is the IOPub round trip."""

    pub_thread = object()

    def __init__(self):
        self.text, self.flushed, self.flushes = "", "", 0
        self.during_flush = None  # called inside flush, before what was written is taken

    def write(self, string):
        self.text += string
        return len(string)

    def flush(self):
        self.flushes += 1
        if self.during_flush is not None:
            self.during_flush()
        self.flushed = self.text


def test_a_lazy_stream_flushes_only_what_was_written_since_its_last_flush():
    s = _Stream()
    assert lean.lazy_flush(s) is True
    s.flush()  # whatever was there before it was made lazy
    assert s.flushes == 1
    s.flush()
    s.flush()
    assert s.flushes == 1  # nothing written: no round trip
    assert s.write("a line\n") == 7
    s.flush()
    assert s.flushes == 2 and s.flushed == "a line\n"
    print("x", file=s, flush=True)  # print(flush=True) writes, then flushes
    assert s.flushes == 3 and s.flushed.endswith("x\n")
    assert lean.lazy_flush(s) is False  # once only
    s.write("y")
    s.flush()
    assert s.flushes == 4


def test_a_stream_that_is_not_ipykernels_is_left_alone():
    import io

    buf = io.StringIO()
    assert lean.lazy_flush(buf) is False
    assert "flush" not in vars(buf)


def test_text_written_from_another_thread_during_a_flush_is_flushed_by_the_next():
    s = _Stream()
    lean.lazy_flush(s)
    s.flush()

    def another_thread_writes():
        t = threading.Thread(target=lambda: s.write("late\n"))
        t.start()
        t.join()
        s.during_flush = None

    s.write("first\n")
    s.during_flush = another_thread_writes
    s.flush()
    s.flush()  # "late" was written after this flush cleared the mark: the next one takes it
    assert s.flushed == "first\nlate\n" and s.flushes == 3
    s.flush()
    assert s.flushes == 3


def test_stopped_watchdogs_publish_nothing_more_and_two_can_watch_at_once():
    seen = {"a": 0, "b": 0}
    stop_b = threading.Event()

    def other():
        dog = where.Watchdog(lambda d: seen.__setitem__("b", seen["b"] + 1))
        dog.start()
        stop_b.wait(5)
        dog.stop()
        dog.join(2)

    thread = threading.Thread(target=other)
    thread.start()
    dog = where.Watchdog(lambda d: seen.__setitem__("a", seen["a"] + 1))
    dog.start()
    time.sleep(3.5 * where.INTERVAL)
    dog.stop()
    dog.join(2)
    after_stop = seen["a"]
    assert after_stop >= 2 and seen["b"] >= 2, seen  # both armed: both looked at, about every INTERVAL
    time.sleep(2 * where.INTERVAL)
    assert seen["a"] == after_stop  # stopped: nothing more
    assert seen["b"] >= 3  # the other one goes on
    stop_b.set()
    thread.join(5)
    assert len([t for t in threading.enumerate() if t.name == "distnb-where"]) == 1  # one looker per process


def test_a_watchdog_whose_thread_ended_is_dropped():
    published = []

    def short():
        where.Watchdog(published.append).start()  # never stopped: its thread ends

    t = threading.Thread(target=short)
    t.start()
    t.join()
    time.sleep(3 * where.INTERVAL)
    looker = where._looker()
    with looker.cond:
        assert not any(d.target_id == t.ident for d in looker.armed), looker.armed
    assert published == []  # the thread was gone at the first look


def test_a_look_that_hangs_does_not_starve_the_next_cells_watchdog(monkeypatch):
    monkeypatch.setattr(where, "STUCK_SECONDS", 0.3)
    release = threading.Event()
    first = where.Watchdog(lambda data: release.wait(10))  # its first look blocks (a store that never answers)
    first.start()
    time.sleep(where.INTERVAL + 0.3 + 0.2)
    first.stop()  # the looker is stuck: a new one takes over
    seen = []
    second = where.Watchdog(seen.append)
    second.start()
    time.sleep(3 * where.INTERVAL)
    second.stop()
    release.set()
    assert len(seen) >= 2, seen


def test_a_logger_above_debug_builds_no_record_its_handler_would_drop():
    import logging

    log = logging.getLogger("distnb-test-lean-engine")
    log.propagate, log.level = False, logging.DEBUG
    handler = logging.StreamHandler(io.StringIO())
    handler.setLevel(logging.INFO)
    log.addHandler(handler)
    built = []
    make = log.makeRecord
    log.makeRecord = lambda *a, **k: built.append(a[1]) or make(*a, **k)
    try:
        log.debug("before")
        assert built == [logging.DEBUG]
        assert lean.quiet_logger(log) == logging.INFO
        log.debug("after")
        log.info("shown")
        assert built == [logging.DEBUG, logging.INFO]
        assert handler.stream.getvalue() == "shown\n"
    finally:
        log.removeHandler(handler)


def test_a_logger_whose_handler_takes_everything_is_left_alone():
    import logging

    log = logging.getLogger("distnb-test-lean-notset")
    log.propagate, log.level = False, logging.DEBUG
    handler = logging.NullHandler()
    log.addHandler(handler)
    try:
        assert lean.quiet_logger(log) == logging.DEBUG
    finally:
        log.removeHandler(handler)



def _define(path: str, code: str) -> dict:
    """The names ``code`` defines, its functions' frames saying they are in file ``path``."""
    import sys

    ns = {"sys": sys}
    exec(compile(code, path, "exec"), ns)
    return ns


def test_a_pipeline_stage_computing_inside_the_schedule_is_running_not_in_a_collective():
    """A stage's forward runs inside ScheduleGPipe.step (torch/distributed/pipelining): the whole step was taken for
    a collective, and a stage computing for 10 s under load was named a hang (rank 0 "waited 10 s in step")."""
    import os

    dist = os.sep + os.path.join("x", "torch", "distributed") + os.sep
    schedule = _define(dist + os.path.join("pipelining", "schedules.py"), "def step(fn):\n    return fn()\n")
    c10d = _define(dist + "distributed_c10d.py", "def all_reduce():\n    return sys._getframe()\n")
    user = _define("/work/cell.py", "def forward():\n    return sys._getframe()\n")
    computing = where._summary(schedule["step"](user["forward"]), False)
    assert computing["state"] == "running" and computing["op"] is None, computing
    waiting = where._summary(schedule["step"](c10d["all_reduce"]), False)  # a wait, called from the schedule
    assert waiting["state"] == "collective" and waiting["op"] == "step", waiting
