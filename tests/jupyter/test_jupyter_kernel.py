"""The "Python 3 (distnb)" Jupyter kernel: installed, listed by Jupyter, and starting with distnb's magics.

`make install` installs the kernel spec from jupyter-config/kernels/distnb into the
environment (``jupyter kernelspec install --sys-prefix``); when it is missing (an
environment made without the Makefile), the test installs it the same way first.
Runs a real ``jupyter kernelspec list --json`` and a real kernel through jupyter_client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import kernels

ROOT = Path(__file__).resolve().parents[2]
SPEC_DIR = ROOT / "jupyter-config" / "kernels" / "distnb"
JUPYTER = Path(sys.executable).parent / ("jupyter.exe" if os.name == "nt" else "jupyter")
TIMEOUT = 30


def _jupyter(*args):
    cmd = [str(JUPYTER)] if JUPYTER.exists() else [sys.executable, "-m", "jupyter"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=TIMEOUT, check=True)


def _kernelspecs():
    return json.loads(_jupyter("kernelspec", "list", "--json").stdout)["kernelspecs"]


@pytest.fixture(scope="module")
def kernelspecs():
    specs = _kernelspecs()
    if "distnb" not in specs:
        _jupyter("kernelspec", "install", "--sys-prefix", "--name", "distnb", str(SPEC_DIR))
        specs = _kernelspecs()
    return specs


def test_kernelspec_is_listed(kernelspecs):
    assert "distnb" in kernelspecs, f"kernels found: {sorted(kernelspecs)}"
    spec = kernelspecs["distnb"]["spec"]
    assert spec["display_name"] == "Python 3 (distnb)"
    assert spec["language"] == "python"
    assert "--ext=distnb" in spec["argv"]
    # The installed spec is the one in the repository, not a stale copy.
    assert spec["argv"] == json.loads((SPEC_DIR / "kernel.json").read_text())["argv"]


def _execute(kc, code, timeout=TIMEOUT):
    """(stdout, stderr, error content or None) of ``code`` run in the kernel."""
    return kernels.execute(kc, code, timeout)


@pytest.fixture(scope="module")
def distnb_kernel(kernelspecs):
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="distnb")
    km.shutdown_wait_time = 5
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=TIMEOUT)
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
        assert not km.is_alive()


def test_kernel_has_magics_without_load_ext(distnb_kernel):
    out, _, error = _execute(distnb_kernel, "\n".join([
        "import json, sys",
        "mm = get_ipython().magics_manager.magics",
        "print(json.dumps({'line': sorted(k for k in mm['line'] if k.startswith('dist')),",
        "                  'cell': sorted(k for k in mm['cell'] if k.startswith('dist')),",
        "                  'loaded': 'distnb' in get_ipython().extension_manager.loaded,",
        "                  'torch_imported': 'torch' in sys.modules}))",
    ]))
    assert error is None, error
    state = json.loads(out)
    assert state["line"] == ["dist", "distrain"]  # %distrain alone prints the help
    assert state["cell"] == ["dist", "distrain"]
    assert state["loaded"]
    # Loading the extension stays light: torch is imported only when a cluster is used.
    assert not state["torch_imported"]


def test_magic_runs_in_kernel(distnb_kernel):
    # Real magic calls. With no cluster started, %dist status says how to start one
    # (IPython shows a UsageError as a message on stderr, not as an error reply).
    out, err, error = _execute(distnb_kernel, "%dist status")
    assert "UsageError" in err and "%dist start" in err, (out, err, error)
    out, err, error = _execute(distnb_kernel, "%dist")
    assert error is None, error
    assert "%dist start" in out and "%%dist" in out
