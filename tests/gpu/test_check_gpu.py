"""tests/gpu/check_gpu.py and check_two_ranks.py from pytest: run on a machine with a GPU, skipped elsewhere.

The scripts stay scripts (their names do not match pytest's test_*.py, so they are never collected
themselves) and run here as such, in a subprocess with this tree's distnb: each starts and stops
its own cluster, records every check's figures as JSON under ``$OUT/checks`` and exits non-zero
when a check failed.

Where pytest and ipyparallel cannot be installed (a lent GPU machine: one command, no network), the kit
runs them instead: ``bash tests/gpu/wheels.sh`` here, then ``bash tests/gpu/device_run.sh`` there with
carry ``[".whl"]`` (see device_run.sh); ``bash tests/gpu/device_run.sh --cpu`` runs them here on CPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.resolve().parents[1]
NUM_GPUS_NEEDED = 1  # a world of one nccl rank, and two gloo ranks sharing it
TIMEOUT = {"check_gpu.py": 300, "check_two_ranks.py": 200}  # seconds, each (device_run.sh's limits, and some)


@pytest.mark.parametrize("script", sorted(TIMEOUT))
def test_gpu_kit_script(script, tmp_path):
    import torch

    found = torch.cuda.device_count()
    if found < NUM_GPUS_NEEDED:
        pytest.skip(f"tests/gpu/{script} needs {NUM_GPUS_NEEDED} GPU, torch.cuda.device_count() is {found} "
                    "(`bash tests/gpu/device_run.sh --cpu` runs the kit on gloo)")
    env = {**os.environ, "OUT": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(HERE / script)], capture_output=True, text=True,
                         timeout=TIMEOUT[script], cwd=REPO, env=env)
    print(out.stdout)
    assert out.returncode == 0, f"{script} exited with {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert "FAIL" not in out.stdout and len(list((tmp_path / "checks").glob("*.json"))) >= 6, out.stdout
