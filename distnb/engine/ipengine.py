"""Engine entry point: ``python -m distnb.engine.ipengine [ipengine options]`` (distnb's ipengine).

It runs the ipyparallel engine exactly as ``python -m ipyparallel.engine`` does, with two
changes that shorten ``%dist start`` (measured in ``benchmarks/cold_start.py``):

- **Imports overlap the start-up.** Right after the engine's own modules are loaded, a
  background thread imports torch (and, on CPU engines, ``torch._dynamo``, which DDP
  needs, and distnb's training loop). Meanwhile the main thread waits for the controller,
  registers and waits for its heartbeat; ``runtime.setup`` waits only for torch and
  torch.distributed (on the import lock), forms the process group and lets the thread go on
  (:data:`RESUME`), so ``%dist start`` returns about one CPU-second per engine earlier while
  the rest loads; the first training cell finds DDP loaded. ``DISTNB_PRELOAD`` says how much: ``all`` (CPU engines), ``torch`` (GPU
  engines: the rest is left to the first cell, after ``CUDA_VISIBLE_DEVICES`` is set for
  the rank) or ``none``.
- **No early read of a half-written connection file.** The kernel starts the engines
  together with the controller instead of after it; an engine waits here until the
  controller's engine connection file exists *and* parses (the controller writes it in
  place, not atomically), then hands over to ipyparallel.

The environment (``OMP_NUM_THREADS``, ``DISTNB_PRELOAD``) is set by the kernel when it
launches the engine (:mod:`distnb.cluster.cluster`), so the thread count is fixed before torch loads.
The module is called ``ipengine`` so that process listings that look for engines by that
name (``ps``, the test suite's leak check, the benchmarks' clean-up) still find them.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time

from distnb.engine import zygote
from distnb.engine.zygote import freeze_imports

#: Seconds to wait for the controller's connection file before leaving it to ipyparallel.
CONNECTION_WAIT = 60.0
PRELOADED = threading.Event()
#: Set by ``runtime.setup`` once the process group is formed: the rest of the preload waits for it,
#: so that forming the group does not queue for the GIL and import locks behind ``torch._dynamo``.
RESUME = threading.Event()
#: Seconds the preload waits for the group before importing the rest anyway.
RESUME_WAIT = 30.0
#: Wall-clock times (``time.time()``) of this engine's start-up steps, for profiling ``%dist start``.
TIMES = {}


#: What the preload thread imports before the process group forms (torch first; runtime.setup needs the rest) ...
PRELOAD_BEFORE_GROUP = ("torch", "torch.distributed", "torch.distributed.distributed_c10d")
#: ... and after it, on CPU engines: ``torch._dynamo``, which DDP's constructor imports (about 1 CPU-second,
#: see :func:`warm_up`), and distnb's training loop (DDP, the strategies' base, the reporter).
PRELOAD_AFTER_GROUP = ("torch._dynamo", "distnb.engine.train.loop")


def warm_up() -> float:
    """Import the training loop (DDP) ahead of the first training cell; returns seconds taken.

    The kernel queues this right after start-up without waiting for it; distnb's engines
    have usually imported it already, in the preload thread, while the group formed.
    ``torch._dynamo`` (about 1 CPU-second, imported by DDP) is among those imports: a module
    imported while a group exists can capture it (torch has functions whose default argument
    is ``group=dist.group.WORLD``) and keep it alive after ``destroy_process_group``, so that a
    failed rank's peers would wait for the full timeout instead of failing at once;
    :func:`distnb.engine.process.runtime.drop_captured_group` undoes that before every destroy.
    """
    t0 = time.perf_counter()
    from distnb.engine.train import loop  # noqa: F401

    return time.perf_counter() - t0


def _preload(level: str) -> None:

    try:
        importlib.import_module("torch")
        TIMES["torch"] = time.time()

        freeze_imports()  # before any process group exists: collections stay cheap (see freeze_imports)
        if level == "all":
            for name in PRELOAD_BEFORE_GROUP[1:]:
                importlib.import_module(name)
            RESUME.wait(RESUME_WAIT)
            TIMES["resume"] = time.time()
            for name in PRELOAD_AFTER_GROUP:
                importlib.import_module(name)
                TIMES[name.rsplit(".", 1)[-1].lstrip("_")] = time.time()  # "dynamo", "loop"
    except BaseException:  # setup() imports again and reports what fails
        pass
    finally:
        PRELOADED.set()


def connection_file() -> str | None:
    """The controller's engine connection file for this engine (from ipyparallel's launch environment)."""
    profile = os.environ.get("IPP_PROFILE_DIR")
    if not profile:
        return None
    cluster_id = os.environ.get("IPP_CLUSTER_ID", "")
    name = f"ipcontroller-{cluster_id}-engine.json" if cluster_id else "ipcontroller-engine.json"
    return os.path.join(profile, "security", name)


def holds_json(path: str) -> bool:
    """Whether ``path`` exists and parses as JSON (the controller writes its connection files in place)."""
    try:
        with open(path) as f:
            json.load(f)
        return True
    except (OSError, ValueError):
        return False


def wait_for_connection_file(path: str | None, timeout: float = CONNECTION_WAIT) -> bool:
    """Wait until ``path`` holds complete JSON (True), or ``timeout`` s pass (False)."""
    if not path or os.environ.get("IPP_CONNECTION_INFO"):
        return True
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        if holds_json(path):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(0.05, delay * 1.5)


def main() -> None:
    if sys.argv[1:] == ["--zygote"]:  # the engine template (distnb.engine.zygote): forks engines on request

        zygote.serve(main, (*PRELOAD_BEFORE_GROUP, *PRELOAD_AFTER_GROUP))
        return
    TIMES["main"] = time.time()
    import numpy  # noqa: F401  shared by both threads' imports: loaded here once, first
    from ipyparallel.engine.app import main as engine_main

    TIMES["engine_imported"] = time.time()
    level = os.environ.get("DISTNB_PRELOAD", "torch")
    if level in ("torch", "all"):
        threading.Thread(target=_preload, args=(level,), name="distnb-preload", daemon=True).start()
    else:
        PRELOADED.set()
    if "--mpi" in sys.argv:  # started by mpiexec: an engine shut down alone must not wait in MPI_Finalize
        try:                  # for every other rank (ipyparallel's --mpi joins MPI through mpi4py)
            import mpi4py

            mpi4py.rc.finalize = False
        except ImportError:
            pass
    wait_for_connection_file(connection_file())
    TIMES["connection_file"] = time.time()
    sys.argv[0] = "ipengine"
    engine_main()


if __name__ == "__main__":
    sys.modules.setdefault("distnb.engine.ipengine", sys.modules[__name__])  # one module: TIMES visible to cells
    main()
