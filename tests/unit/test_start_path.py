"""The pieces that shorten ``%dist start`` (issue 17): the controller's database wait, its schedulers, the file wait."""

import json
import time
import types

from ipyparallel.controller.dictdb import DictDB, NoDB

from distnb.cluster import launchers
from distnb.engine import ipengine, zygote


def _fake_controller_module():
    """A module shaped like ipyparallel.controller.app: init_hub sleeps through the module's ``time``."""
    module = types.ModuleType("fake_controller_app")
    module.time = time
    slept = []

    class IPController:
        db_class = NoDB

        def init_hub(self):
            module.time.sleep(0.25)
            slept.append(module.time.monotonic() > 0)  # the rest of time still works meanwhile
            return "hub"

    module.IPController = IPController
    return module, slept


def test_no_db_wait_skips_the_quarter_second_only_without_a_database():
    module, slept = _fake_controller_module()
    zygote._no_db_wait(module)
    t0 = time.perf_counter()
    assert module.IPController().init_hub() == "hub"
    assert time.perf_counter() - t0 < 0.1 and slept == [True]
    assert module.time is time  # put back after the call
    with_db = module.IPController()
    with_db.db_class = DictDB
    t0 = time.perf_counter()
    with_db.init_hub()
    assert time.perf_counter() - t0 >= 0.25  # a real database keeps ipyparallel's wait


def test_scheduler_threads_for_small_clusters_processes_for_large():
    threads = ["--IPController.use_threads=True"]
    assert launchers.scheduler_args(2) == threads
    assert launchers.scheduler_args(launchers.SCHEDULER_THREADS_UP_TO) == threads
    assert launchers.scheduler_args(launchers.SCHEDULER_THREADS_UP_TO + 1) == []
    assert launchers.scheduler_args(2, "ssh") == launchers.scheduler_args(2, "slurm") == []  # a fresh controller


def test_connection_file_counts_once_it_parses(tmp_path):
    path = tmp_path / "ipcontroller-client.json"
    assert not ipengine.holds_json(str(path))
    path.write_text('{"key": "ab')  # written in place: half a file first
    assert not ipengine.holds_json(str(path))
    path.write_text(json.dumps({"key": "abc"}))
    assert ipengine.holds_json(str(path))
