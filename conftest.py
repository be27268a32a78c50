"""Test environment for the whole suite (tests/ and the nbval notebooks/).

Isolated IPython/Jupyter dirs (ipyparallel writes profiles there; FIELD-NOTES pitfall 6),
text progress instead of widgets, and a leak check: the run fails if any engine or
controller started from it (a descendant, or an orphan carrying this run's IPYTHONDIR)
is still alive 15 s after the last test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

_TMP = tempfile.mkdtemp(prefix="distnb-tests-")
for _var, _sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                   ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"), ("JUPYTER_DATA_DIR", "jupyter-data")):
    os.environ[_var] = os.path.join(_TMP, _sub)
    os.makedirs(os.environ[_var], exist_ok=True)
os.environ.setdefault("DISTNB_PROGRESS", "text")
# Started as a background job (`make test &`, some CI runners), a process begins with SIGINT ignored and Python
# then installs no KeyboardInterrupt handler; the tests that press "interrupt" (a SIGINT to this process, as
# Jupyter's button sends one to the kernel) need the handler a kernel has.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ.setdefault("OMP_NUM_THREADS", "1")

_STARTED: list[tuple[float, str]] = []  # (wall-clock start, nodeid) of every test, to name a leak's test


def pytest_runtest_setup(item):
    _STARTED.append((time.time(), item.nodeid))


def _describe(p) -> str:
    """One leaked process: pid, command line, and the test that was running when it was started."""
    try:
        born, cmd = p.create_time(), " ".join(p.cmdline())[:300]
        parent = p.ppid()
    except Exception as exc:  # gone or unreadable while we look
        return f"{p.pid} ({exc.__class__.__name__})"
    during = [nodeid for t, nodeid in _STARTED if t <= born]
    test = during[-1] if during else "before the first test"
    return f"{p.pid} (parent {parent}, started during {test}): {cmd}"


CLUSTER_PROCESS_MARKERS = ("ipyparallel.engine", "ipyparallel.controller", "ipengine", "ipcontroller")


def cluster_processes():
    """Engines and controllers started from this run: descendants, or orphans with our IPYTHONDIR."""
    import psutil

    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    out = []
    for p in psutil.process_iter():
        try:
            if not any(m in " ".join(p.cmdline()) for m in CLUSTER_PROCESS_MARKERS):
                continue
            if p.pid in mine or p.environ().get("IPYTHONDIR") == os.environ["IPYTHONDIR"]:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def pytest_sessionfinish(session, exitstatus):
    """Fail the run (and kill them) if engines or controllers outlive the tests that started them."""
    from distnb import session as distnb_session

    if distnb_session._CURRENT is not None:
        distnb_session._CURRENT.stop(quiet=True)
    from distnb.cluster import zygote

    zygote.stop()  # the engine template (%load_ext started it); the engines it forked are checked below
    deadline = time.monotonic() + 15
    left = cluster_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = cluster_processes()
    described = [_describe(p) for p in left]
    for p in left:
        p.kill()
    if left:
        print("\nleaked cluster processes (killed):\n  " + "\n  ".join(described))
        session.exitstatus = 1
    shutil.rmtree(_TMP, ignore_errors=True)
