"""DataLoader workers never outlive their rank: not when its engine is killed mid-cell, not after a restart.

On the shared real 2-rank cluster (it is restarted at the end, as test_engine_death does).
"""

import threading
import time

import psutil

from distnb import session as session_mod
from distnb.core.errors import RankError

SETUP = """
import time, torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import Dataset
class SlowRows(Dataset):
    def __len__(self):
        return 400
    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.randn(8), i % 2
slow_rows = SlowRows()
torch.manual_seed(0)
workers_net = nn.Linear(8, 2)
"""


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_workers_of_a_killed_engine_end_and_restart_leaves_none(shell):
    assert shell.run_cell(SETUP).error_in_exec is None
    cluster = session_mod.current().cluster
    engine = psutil.Process(cluster.ranks[1]["pid"])
    workers = []

    def kill_the_engine():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(workers) < 2:
            workers[:] = engine.children()
            time.sleep(0.02)
        time.sleep(0.3)
        engine.kill()

    killer = threading.Thread(target=kill_the_engine)
    killer.start()
    res = shell.run_cell("%%distrain --model workers_net --data slow_rows --epochs 50 --batch-size 8 --workers 2 "
                         "--progress none\nx, y = batch\nloss = F.cross_entropy(model(x), y)")
    killer.join()
    assert isinstance(res.error_in_exec, RankError) and res.error_in_exec.ename == "EngineDied", res.error_in_exec
    assert len(workers) == 2
    deadline = time.monotonic() + 15  # an orphaned worker notices its rank is gone within about 5 s
    while not all(_gone(w.pid) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(w.pid) for w in workers), [w.pid for w in workers if not _gone(w.pid)]
    assert shell.run_cell("%dist restart").error_in_exec is None
    new = session_mod.current().cluster
    res = shell.run_cell("%%distrain --model workers_net --data slow_rows --batch-size 50 --workers 2 --progress none"
                         "\nx, y = batch\nloss = F.cross_entropy(model(x), y)")
    assert res.error_in_exec is None, res.error_in_exec
    assert [c for r in new.ranks for c in psutil.Process(r["pid"]).children(recursive=True)] == []
