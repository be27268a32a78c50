"""Data that lives only on the ranks: numpy files read by each rank, a worker killed mid-cell.

The data set here is larger than the kernel may grow by: the kernel (this test process) never
holds it, each rank memory-maps only its own files.
"""

import os
import signal
import threading
import time

import numpy as np
import psutil
import pytest
import torch

from distnb.core.errors import RankError

DEFINE = r'''
import glob
import numpy as np
import torch
from torch.utils.data import Dataset

class NpyShards(Dataset):
    """The rows of some .npy files (features..., label), each opened as a read-only memory map on first use."""
    def __init__(self, paths):
        self.paths = list(paths)
        self.lengths = [np.load(p, mmap_mode="r").shape[0] for p in self.paths]  # reads the headers
        self.starts = np.cumsum([0] + self.lengths)
        self.arrays = None
    def __len__(self):
        return int(self.starts[-1])
    def __getitem__(self, i):
        if self.arrays is None:
            self.arrays = [np.load(p, mmap_mode="r") for p in self.paths]
        f = int(np.searchsorted(self.starts, i, side="right")) - 1
        row = self.arrays[f][i - self.starts[f]]
        return torch.from_numpy(np.array(row[:-1])), int(row[-1])

def make_files(rank, world_size):
    """This rank's files: every world_size-th one."""
    return NpyShards(sorted(glob.glob(FOLDER + "/part-*.npy"))[rank::world_size])
'''
FEATURES, ROWS_PER_FILE, FILES = 1023, 5120, 8  # 8 files of 20 MiB (float32 rows of 1023 features + a label)
#: How much the kernel may grow while the ranks train on the 160 MiB data set.
KERNEL_GROWTH = 48 << 20


def write_files(folder):
    g = np.random.default_rng(0)
    for k in range(FILES):
        out = np.lib.format.open_memmap(os.path.join(folder, f"part-{k:02d}.npy"), mode="w+", dtype=np.float32,
                                        shape=(ROWS_PER_FILE, FEATURES + 1))
        for a in range(0, ROWS_PER_FILE, 1024):
            block = g.standard_normal((1024, FEATURES + 1), dtype=np.float32)
            block[:, -1] = block[:, 0] > 0
            out[a:a + 1024] = block
        out.flush()
        del out
    return FILES * ROWS_PER_FILE * (FEATURES + 1) * 4


class PeakRSS:
    """The kernel's peak resident memory while a block runs (psutil, sampled every 5 ms)."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self):
        return self.peak - self.start


def test_each_rank_reads_only_its_own_files_of_a_set_larger_than_the_kernel_may_grow(dist_session, shell,
                                                                                       tmp_path):
    size = write_files(str(tmp_path))
    assert size > 3 * KERNEL_GROWTH
    shell.run_cell(DEFINE).raise_error()
    ns = shell.user_ns
    ns["FOLDER"], ns["files_model"] = str(tmp_path), torch.nn.Linear(FEATURES, 2)
    body = ("if ctx.step == ctx.steps_per_epoch - 1:  # the files this rank has mapped, at its last step\n"
            "    import psutil\n"
            "    _maps = sorted({m.path for m in psutil.Process().memory_maps() if m.path.endswith('.npy')})\n"
            "x, y = batch\nloss = torch.nn.functional.cross_entropy(model(x), y)")
    with PeakRSS() as rss:
        r = dist_session.train(body, model="files_model", data="make_files", batch_size=256, optimizer="adam",
                               progress="none", quiet=True)
    assert [row["samples"] for row in r.rows] == [FILES * ROWS_PER_FILE // 2] * 2
    assert rss.growth < KERNEL_GROWTH, f"the kernel grew by {rss.growth >> 20} MiB for a {size >> 20} MiB data set"
    maps = dist_session.pull("_maps")
    for rank in (0, 1):
        assert [os.path.basename(p) for p in maps[rank]] == [f"part-{k:02d}.npy" for k in range(rank, FILES, 2)]
    assert all(row["final_loss"] == row["final_loss"] for row in r.rows)  # trained on real numbers (no NaN)


def test_a_killed_worker_is_an_error_naming_the_rank_and_the_cluster_goes_on(dist_session, shell):
    shell.run_cell("import time, torch\nfrom torch.utils.data import Dataset\n"
                   "class Slow(Dataset):\n"
                   "    def __len__(self): return 400\n"
                   "    def __getitem__(self, i):\n"
                   "        time.sleep(0.005)\n"
                   "        return torch.randn(4), i % 2\n").raise_error()
    ns = shell.user_ns
    ns["slow"], ns["lin_killed"] = ns["Slow"](), torch.nn.Linear(4, 2)
    engine = psutil.Process(dist_session.cluster.ranks[0]["pid"])
    killed = []

    def kill_a_worker():  # stands in for the out-of-memory killer
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            workers = engine.children()
            if len(workers) == 2:
                time.sleep(0.3)
                workers[0].send_signal(signal.SIGKILL)
                killed.append(workers[0].pid)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_a_worker)
    killer.start()
    body = "x, y = batch\nloss = torch.nn.functional.cross_entropy(model(x), y)"
    with pytest.raises(RankError) as err:
        dist_session.train(body, model="lin_killed", data="slow", batch_size=8, epochs=40, workers=2,
                           progress="none", quiet=True)
    killer.join()
    assert killed, "the workers never appeared"
    text = str(err.value)
    assert err.value.rank == 0 and "DataLoader worker" in text and "out-of-memory killer" in text, text
    assert "--workers" in text
    left = [c for r in dist_session.cluster.ranks for c in psutil.Process(r["pid"]).children(recursive=True)]
    assert left == []
    ns["lin_after"] = torch.nn.Linear(4, 2)
    r = dist_session.train(body, model="lin_after", data="slow", batch_size=50, workers=1, progress="none",
                           quiet=True)
    assert [row["steps"] for row in r.rows] == [4, 4]
