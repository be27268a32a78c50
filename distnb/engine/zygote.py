"""The engine template ("zygote"): one process that imports an engine's modules once and forks engines.

It forks the cluster's controller too (ipyparallel's controller, imported here as well).

Started by the kernel (:mod:`distnb.cluster.zygote`) as ``python -m distnb.engine.ipengine --zygote``:
the engine's entry point (:mod:`distnb.engine.ipengine`) calls :func:`serve` with its own
``main`` and the modules its preload thread would import. The template imports what a CPU
engine needs before its first training cell (ipyparallel's engine, torch,
``torch.distributed``, ``torch._dynamo``, which DDP's constructor imports, and distnb's
training loop: about 2.8 CPU-seconds and 300 MB on this machine), then waits. Each request
forks a child that becomes a fresh engine (its own session, environment, working directory,
argv and log file, then the entry point's ``main``) without importing anything again; pages
are shared copy-on-write. The idea is the one of Android's zygote and of Python's
``multiprocessing`` forkserver with preloaded modules (``set_forkserver_preload``); the
forkserver itself is not used because its children are ``multiprocessing.Process`` objects
(joined at the parent's exit, ``__main__`` re-imported, daemon rules for their own children).

Forking is safe here because the template never starts a thread, never runs a tensor
operation (no OpenMP pool to lose) and never touches CUDA: the kernel uses it for CPU
engines only.

Protocol (JSON, one object per line; requests on stdin, replies on stdout):

- ``{"ready": true, "pid": P, "seconds": S, "frozen_env": {...}, "frozen_env_after": {...}}`` once
  the imports are done (the variables that a fork cannot change, :func:`frozen_env`, as it
  started and after its imports, which set some themselves, e.g. ``TORCHINDUCTOR_CACHE_DIR``).
- request ``{"id": K, "main": "engine"|"controller", "args": [its options], "title": COMMAND_LINE,
  "env": {...}, "cwd": DIR, "output": FILE}`` ->
  ``{"id": K, "pid": P}`` or ``{"id": K, "error": TEXT}``.
- ``{"exit": P, "status": S}`` when a child ends: its exit code, or minus the signal number
  that killed it (the convention of ``subprocess`` and psutil).

It exits when its stdin closes (the kernel is gone); children it forked are not waited for.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import sys
import tempfile
import time
import traceback

from distnb.engine.process.lean import quiet_logger

#: Imported once in the template: the engine's and the controller's modules (then what the engine's
#: preload thread would import in every engine, given to :func:`serve`, then the runtime).
#: ``ipykernel.debugger`` is imported by the engine's kernel as it registers (it loads debugpy):
#: 0.12-0.17 CPU-s per engine, in the middle of ``%dist start``, when it was left to each engine.
PRELOAD_FIRST = ("numpy", "ipyparallel.engine.app", "ipyparallel.controller.app", "ipykernel.debugger")
PRELOAD_LAST = ("distnb.engine.process.runtime",)


def freeze_imports() -> None:
    """Move every object alive now (the imported modules) out of the garbage collector's reach.

    ``gc.freeze`` (Python >= 3.7) puts them in a permanent generation that collections skip.
    A full collection in an engine with torch imported walks about 330,000 objects, 0.6-0.9 s
    on this machine; distnb runs one on every failure (to drop what holds a broken process
    group) and Python runs them as objects pile up. Frozen, it takes about a millisecond, and
    the forked engines' pages of those objects stay shared (a collection would write to them).
    Python's ``gc`` documentation recommends exactly this before ``fork()``. Objects frozen
    are still freed when their reference count drops to zero; only cycles among them (import-time
    garbage, if any) stay. No collection runs first: it would hold the GIL for most of a second.
    """

    gc.freeze()


def warm_tracebacks() -> None:
    """Format one traceback as an engine's shell formats a failed cell's (IPython's ``AutoFormattedTB``).

    The first traceback an engine formats imports ``stack_data``/``executing`` and compiles
    pygments' Python lexer: 1.1-1.6 s of a failing rank's time to its result with 8-32 engines on
    2 cores, paid by every forked engine on its first failure. Done once here, it is shared.
    """
    # the modules ipyparallel's engine (preloaded) loaded: engine/ never imports the kernel's libraries itself
    ultratb, zmqshell = sys.modules.get("IPython.core.ultratb"), sys.modules.get("ipykernel.zmqshell")
    if ultratb is None or zmqshell is None:
        return
    try:
        shell = zmqshell.ZMQInteractiveShell
        formatter = ultratb.AutoFormattedTB(mode=shell.xmode.default_value, theme_name=shell.colors.default_value,
                                            tb_offset=0)
        try:
            raise ValueError("the engine template warms IPython's traceback formatting")
        except ValueError:
            formatter.structured_traceback(*sys.exc_info())
    except Exception:  # an engine then pays for it on its first failure, as before
        pass


def _preload(engine_modules) -> None:

    for name in (*PRELOAD_FIRST, *engine_modules, *PRELOAD_LAST):
        try:
            importlib.import_module(name)
        except Exception:  # the engine imports it again and reports what fails
            traceback.print_exc()


#: Environment variables read when Python starts or torch loads, which a fork cannot change: an
#: engine that needs other values than the template's starts as a fresh process. (TMPDIR,
#: TORCH_DISTRIBUTED_DEBUG and the thread count are re-read in the child instead.) The math
#: libraries' own variables (OMP_*, GOMP_*, KMP_*, MKL_*) are not here: scikit-learn sets KMP_*
#: when a notebook imports it, and distnb sets each engine's thread count itself.
FROZEN_ENV_PREFIXES = ("PYTHON", "LD_", "TORCH_LOGS", "TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE",
                       "PYTORCH_")


def frozen_env(env) -> dict:
    """The variables of ``env`` that a fork cannot change (:data:`FROZEN_ENV_PREFIXES`)."""
    return {k: v for k, v in env.items() if k.startswith(FROZEN_ENV_PREFIXES)}


def _reread_environment() -> None:
    """What the preloaded modules took from the template's state at import, taken again for this engine."""

    import numpy
    import torch
    import torch.distributed

    tempfile.tempdir = None  # TMPDIR and friends: found again on first use
    numpy.random.seed()  # a fresh process draws its own seeds; a fork would share the template's
    torch.seed()
    torch.distributed.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG (distnb sets INFO for engines)


def _quiet_at_start(app_class) -> None:
    """The app's logger raised to its handlers' level when it starts (:func:`distnb.engine.process.lean.quiet_logger`).

    The controller's hub logs a line per monitored request and result below the ``--log-level=WARN``
    its handler prints: a py-spy profile at 32 ranks put an eighth of its busy time in building those
    records (issue 20).
    """
    start = app_class.start

    def start_quietly(self, *args, **kwargs):

        quiet_logger(self.log)
        return start(self, *args, **kwargs)

    app_class.start = start_quietly


class _TimeWithoutSleep:
    """The ``time`` module with a ``sleep`` that returns at once (see :func:`_no_db_wait`)."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds) -> None:
        pass


def _no_db_wait(app_module) -> None:
    """The controller's hub set up without the quarter second it waits for its database.

    ipyparallel's ``IPController.init_hub`` sleeps 0.25 s after making the hub's database, before
    it writes the connection files that the client and the engines wait for: a quarter of a
    2-engine ``%dist start`` here (issue 17; a cProfile of the controller's start). distnb's
    controller keeps no database (``NoDB``, :data:`distnb.cluster.cluster.CONTROLLER_QUIET`), so there is
    nothing to wait for; with any other database the wait stays.
    """
    from ipyparallel.controller.dictdb import NoDB

    init_hub = app_module.IPController.init_hub

    def init_hub_at_once(self):
        if not (isinstance(self.db_class, type) and issubclass(self.db_class, NoDB)):
            return init_hub(self)
        app_module.time = _TimeWithoutSleep()  # the module's name for time, during this call only
        try:
            return init_hub(self)
        finally:
            app_module.time = time

    app_module.IPController.init_hub = init_hub_at_once


def _become_engine(req: dict, close_fds: list, engine_main) -> None:
    """In the forked child: turn into the engine ``req`` asks for (``engine_main``) or the controller; never returns."""
    code = 1
    try:
        os.setsid()  # like Popen(start_new_session=True): a Ctrl-C to the kernel's group is not ours
        try:  # ps shows what the child is, not the template; SPT_NOENV: /proc/PID/environ is left readable
            os.environ["SPT_NOENV"] = "1"  # (the title is then cut to the template's command-line length)
            import setproctitle

            setproctitle.setproctitle(req["title"])
        except ImportError:
            pass
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close_fds:
            os.close(fd)
        out = os.open(req["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        # ipyparallel's apps chdir to their work_dir, whose default is the cwd when ipyparallel was imported
        args = [f"--work-dir={os.getcwd()}", *req["args"]]
        _reread_environment()
        if req.get("main") == "controller":
            from ipyparallel.controller import app as controller_app

            _quiet_at_start(controller_app.IPController)
            _no_db_wait(controller_app)
            sys.argv = ["ipcontroller", *args]
            controller_app.main()
        else:
            sys.argv = ["ipengine", *args]
            engine_main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:

            atexit._run_exitfuncs()  # what a normal interpreter exit runs
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(engine_main, engine_modules=()) -> None:
    """Import, say ready, then fork engines on request until stdin closes.

    ``engine_main`` is what a forked engine runs (with its ``sys.argv`` set), and
    ``engine_modules`` what an engine would import before its first cell (imported here once).
    """
    t0 = time.perf_counter()
    started_with = frozen_env(os.environ)  # before the imports (torch sets TORCHINDUCTOR_CACHE_DIR itself)
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by imports goes to stderr, never into the protocol
    _preload(engine_modules)
    warm_tracebacks()
    freeze_imports()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd

    def send(msg):
        reply.write(json.dumps(msg) + "\n")

    send(dict(ready=True, pid=os.getpid(), seconds=time.perf_counter() - t0, frozen_env=started_with,
              frozen_env_after=frozen_env(os.environ)))
    buf = b""
    children = set()
    while True:
        try:
            readable, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while children:  # reap every child that ended and report its status
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            send(dict(exit=pid, status=os.waitstatus_to_exitcode(raw)))
        if 0 not in readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return  # the kernel is gone
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
            except OSError as exc:
                send(dict(id=req["id"], error=f"fork failed: {exc}"))
                continue
            if pid == 0:
                _become_engine(req, [wake_r, wake_w, reply.fileno()], engine_main)
            children.add(pid)
            send(dict(id=req["id"], pid=pid))
