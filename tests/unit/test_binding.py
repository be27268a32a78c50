"""CPU binding (distnb/engine/process/binding.py) and the load that decides ``--cpu-bind auto`` (distnb/cluster/cpuload.py)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from distnb.cluster import cpuload, placement
from distnb.engine.process import binding
from distnb.core.plan import ClusterSpec


def test_the_cores_are_cut_into_equal_contiguous_shares():
    assert [binding.share([0, 1], r, 2) for r in range(2)] == [[0], [1]]
    assert [binding.share(list(range(8)), r, 3) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert binding.share(list(range(8)), 0, 1) == list(range(8))
    assert binding.share([4, 6, 9], 1, 3) == [6]  # the cores this engine may use, not 0..n-1


def test_more_ranks_than_cores_or_a_rank_outside_them_is_not_bound():
    assert binding.share([0, 1], 0, 3) is None
    assert binding.share([0, 1], 2, 2) is None
    assert binding.share([0, 1], 0, 0) is None


def test_a_cores_hardware_threads_stay_in_one_share(tmp_path, monkeypatch):
    # Linux numbers first threads 0-3 of cores 0-3, then their siblings 4-7: a share keeps siblings together
    for cpu in range(8):
        top = tmp_path / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "physical_package_id").write_text("0\n")
        (top / "core_id").write_text(f"{cpu % 4}\n")
    monkeypatch.setattr(binding, "SYSFS_CPUS", str(tmp_path))
    assert [binding.share(list(range(8)), r, 2) for r in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_describe_names_runs_of_cores():
    assert binding.describe([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert binding.describe([3]) == "3"
    assert binding.describe(None) == "all"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and 2 cores")
def test_bind_sets_every_thread_and_new_ones_inherit_then_unbinds():
    code = textwrap.dedent("""
        import json, os, threading, time
        from distnb.engine.process import binding
        stop = threading.Event()
        before = threading.Thread(target=stop.wait)  # a thread that exists before the binding
        before.start()
        def cpus():
            out = set()
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/status") as f:
                    out.add(next(l.split()[1] for l in f if l.startswith("Cpus_allowed_list")))
            return sorted(out)
        allowed = binding.describe(binding.allowed())
        mine = binding.bind(1, 2)
        after = threading.Thread(target=stop.wait)  # made after: inherits the share
        after.start()
        bound = cpus()
        binding.bind(1, None)
        print(json.dumps(dict(mine=mine, bound=bound, unbound=cpus(), allowed=allowed, cores=binding.CORES)))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    cores = sorted(os.sched_getaffinity(0))
    assert got["mine"] == binding.share(cores, 1, 2)
    assert got["bound"] == [binding.describe(got["mine"])]  # every thread, the one made before too
    assert got["unbound"] == [got["allowed"]] and got["cores"] is None


def test_auto_binds_only_while_other_processes_leave_the_cores_free():
    places = [dict(node_rank=0, local=True), dict(node_rank=0, local=True), dict(node_rank=1, local=False)]
    auto, cores, none = (ClusterSpec(num_engines=3, cpu_bind=b) for b in ("auto", "cores", "none"))
    assert placement.bind_among(places, auto, 0.0) == [2, 2, 1]
    assert placement.bind_among(places, auto, cpuload.AUTO_MAX_FOREIGN) == [None, None, 1]  # another host: its own
    assert placement.bind_among(places, cores, 5.0) == [2, 2, 1]
    assert placement.bind_among(places, none, 0.0) == [None, None, None]
    gpu = ClusterSpec(num_engines=3, backend="gloo", device_type="cuda")
    assert placement.bind_among(places, gpu, 0.0) == [None, None, None]


def test_foreign_load_is_the_cores_busy_time_less_this_kernels_own(monkeypatch):
    clock = [100.0]
    busy = iter([50.0, 50.9])  # the cores: 0.9 s busy over the span
    own = iter([{1: 3.0, 2: 1.0}, {1: 3.2, 2: 1.2, 3: 0.2}])  # ours: 0.2 + 0.2 + a new child's 0.2
    monkeypatch.setattr(cpuload.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cpuload, "_busy_seconds", lambda cpus: next(busy))
    monkeypatch.setattr(cpuload, "_own_seconds", lambda: next(own))
    cpuload.mark()
    clock[0] += 0.5
    assert cpuload.foreign_cores() == pytest.approx((0.9 - 0.6) / 0.5)


def test_foreign_load_samples_afresh_when_the_mark_is_too_recent(monkeypatch):
    clock = [100.0]
    busy = iter([10.0, 20.0, 20.05])
    monkeypatch.setattr(cpuload.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cpuload.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(cpuload, "_busy_seconds", lambda cpus: next(busy))
    monkeypatch.setattr(cpuload, "_own_seconds", lambda: {})
    cpuload.mark()
    clock[0] += 0.01  # a restart right after a stop: not a span to judge by
    assert cpuload.foreign_cores() == pytest.approx(0.05 / cpuload.SAMPLE_SECONDS)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_a_detached_busy_process_counts_as_foreign_load():
    spin = "import time\nt = time.time()\nwhile time.time() - t < 20: pass\n"
    out = subprocess.run(["sh", "-c", '"$0" -c "$1" >/dev/null 2>&1 & echo $!', sys.executable, spin],
                         capture_output=True, text=True, check=True, start_new_session=True)
    pid = int(out.stdout.split()[-1])  # not this process's descendant (its shell exited): someone else's work
    try:
        cpuload.mark()
        import time

        time.sleep(0.4)
        assert cpuload.foreign_cores() > 0.5
    finally:
        os.kill(pid, 9)
