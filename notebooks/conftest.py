"""Environment for the nbval notebook tests, also when they run alone (``pytest notebooks/``).

nbval starts each notebook's kernel from this pytest process, so the kernel (and the
ipyparallel controller and engines it starts) inherits the environment set here:
temporary IPython/Jupyter dirs (FIELD-NOTES pitfall 6) and text progress instead of the
widget dashboard. When tests/conftest.py is loaded too it sets the same variables.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

_TMP = None
if "distnb-tests-" not in os.environ.get("IPYTHONDIR", ""):
    _TMP = tempfile.mkdtemp(prefix="distnb-tests-nb-")
    for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                     ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"), ("JUPYTER_DATA_DIR", "jupyter-data")):
        os.environ[var] = os.path.join(_TMP, sub)
        os.makedirs(os.environ[var], exist_ok=True)
os.environ.setdefault("DISTNB_PROGRESS", "text")
os.environ.setdefault("OMP_NUM_THREADS", "1")

_MARKERS = ("ipyparallel.engine", "ipyparallel.controller", "ipengine", "ipcontroller")


def _cluster_processes():
    """Engines/controllers started from this run: our descendants, or orphans with our IPYTHONDIR."""
    import psutil

    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    ipythondir = os.environ["IPYTHONDIR"]
    out = []
    for p in psutil.process_iter():
        try:
            if not any(m in " ".join(p.cmdline()) for m in _MARKERS):
                continue
            if p.pid in mine or p.environ().get("IPYTHONDIR") == ipythondir:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def pytest_sessionfinish(session, exitstatus):
    """Kill (and report) any engine or controller a notebook kernel left behind."""
    deadline = time.monotonic() + 15
    left = _cluster_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _cluster_processes()
    for p in left:
        p.kill()
    if left:
        print(f"\nnotebooks: killed leaked cluster processes {[p.pid for p in left]}")
        session.exitstatus = 1
    if _TMP is not None:
        shutil.rmtree(_TMP, ignore_errors=True)
