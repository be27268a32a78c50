"""Shared fixtures: isolated Jupyter/IPython dirs, one real 2-rank cluster per session, leak checks."""

from __future__ import annotations

import os
import shutil
import tempfile

import psutil
import pytest

_TMP = tempfile.mkdtemp(prefix="distnb-tests-")
# ipyparallel and Jupyter write profiles, runtime files and kernels here (FIELD-NOTES pitfall 6).
for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                 ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"), ("JUPYTER_DATA_DIR", "jupyter-data")):
    os.environ[var] = os.path.join(_TMP, sub)
    os.makedirs(os.environ[var], exist_ok=True)
os.environ.setdefault("DISTNB_PROGRESS", "text")
os.environ.setdefault("OMP_NUM_THREADS", "1")

CLUSTER_PROCESS_MARKERS = ("ipyparallel.engine", "ipyparallel.controller", "ipengine", "ipcontroller")


def cluster_processes(root_pid=None):
    """Descendant processes of this test run that are ipyparallel engines or controllers."""
    me = psutil.Process(root_pid or os.getpid())
    out = []
    for p in me.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(m in cmd for m in CLUSTER_PROCESS_MARKERS):
            out.append(p)
    return out


@pytest.fixture(scope="session")
def shell():
    """A real IPython shell with distnb loaded and a real 2-rank gloo cluster started by ``%dist start``."""
    from IPython.core.interactiveshell import InteractiveShell

    from distnb import session

    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    sh = InteractiveShell.instance(config=config)
    sh.run_line_magic("load_ext", "distnb")
    sh.run_line_magic("dist", "start -n 2 --timeout 30")
    assert session._CURRENT is not None, "the cluster did not start"
    yield sh
    if session._CURRENT is not None:
        session._CURRENT.stop(quiet=True)


@pytest.fixture(scope="session")
def dist_session(shell):
    """The running :class:`distnb.session.Session` of the shared shell."""
    from distnb import session

    return session.current()


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_processes():
    """Fail the run if any engine or controller outlives the tests that started it."""
    yield
    import time

    deadline = time.monotonic() + 15
    left = cluster_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = cluster_processes()
    for p in left:
        p.kill()
    shutil.rmtree(_TMP, ignore_errors=True)
    assert not left, f"leaked cluster processes: {[p.pid for p in left]}"
