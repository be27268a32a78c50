"""tests/gpu/check_gpu.py from pytest: run on a machine with a GPU, skipped (with the reason) elsewhere.

check_gpu.py stays a script (its name does not match pytest's test_*.py, so it is never collected
itself) and runs here as one, in a subprocess with this tree's distnb: it parses its own command
line, starts and stops its own cluster, and exits non-zero on the first failed check.

Where pytest and ipyparallel cannot be installed (a lent GPU machine: one command, no network), the kit
runs it instead: ``bash tests/gpu/wheels.sh`` here, then ``bash tests/gpu/device_run.sh`` there with
carry ``[".whl"]`` (see device_run.sh).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("check_gpu.py")
REPO = Path(__file__).resolve().parents[2]
NUM_GPUS_NEEDED = 1  # one engine per GPU: one GPU is a world of one rank (nccl), more are a real DDP world
TIMEOUT = 420  # seconds: engines start, two epochs of digits, fp16, --sync-bn, --compile (compiling), stop


@pytest.mark.timeout(TIMEOUT + 60)
def test_check_gpu():
    import torch

    found = torch.cuda.device_count()
    if found < NUM_GPUS_NEEDED:
        pytest.skip(f"tests/gpu/check_gpu.py needs {NUM_GPUS_NEEDED} GPU, torch.cuda.device_count() is {found} "
                    "(`python tests/gpu/check_gpu.py --cpu` runs the same checks on gloo)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO,
                         env=env)
    print(out.stdout)
    assert out.returncode == 0, f"check_gpu.py exited with {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert "FAIL" not in out.stdout and out.stdout.count("ok   ") >= 11, out.stdout
