"""A /dev/shm too small for DataLoader workers: a real one (a 1 MiB tmpfs in a mount namespace of its own).

The rank-side loader (distnb.engine.train.datasets.Source) runs in a subprocess whose /dev/shm is a 1 MiB
tmpfs, with one worker and 4 MiB batches: torch's own failure must come out with distnb's
diagnosis (which folder, how full, what to change). Needs root (``unshare -m``); skipped otherwise.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CODE = r'''
import torch
from torch.utils.data import Dataset
from distnb.engine.train import datasets; from distnb.engine.process import runtime
from distnb.core.plan import TrainPlan

runtime.STATE.rank = 0

class Big(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return torch.zeros(1 << 18)  # 1 MiB of float32

source = datasets.Source("big", Big(), "dataset", 1, 0, {})
plan = TrainPlan(model="m", data="big", batch_size=4, workers=1)
try:
    for _ in source.epoch(plan, 0, 0, torch.device("cpu")):
        pass
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
else:
    print("NO ERROR")
finally:
    source.close()
'''


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m (a mount namespace for a small /dev/shm)")
def test_a_dev_shm_too_small_for_the_workers_says_so_and_how_to_fix_it():
    script = 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" -c "$1"'
    out = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable, CODE], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    text = out.stdout + out.stderr
    assert "ERROR" in out.stdout and "NO ERROR" not in out.stdout, text
    assert "[distnb] rank 0 ran out of shared memory" in text and "/dev/shm: " in text, text
    assert "MiB free of 1 MiB" in text and "--shm-size" in text and "--workers 0" in text, text
