"""Kernel side of the engine template: CPU engines forked with their imports already done.

A fresh engine process imports ipyparallel, torch and ``torch._dynamo`` (which DDP's
constructor imports) before it can train: about 2.8 CPU-seconds per engine on this
machine, paid again at every ``%dist start`` and ``%dist restart``, and most of a cold
start plus first cell (``benchmarks/cold_start.py``). ``%load_ext distnb`` starts one
template process (:mod:`distnb.engine.zygote`) in the background that imports all of it
once; local CPU engines (and their controller) are then forked from it in milliseconds. GPU engines and engines
on other hosts start as fresh processes, as before (a process that may have touched CUDA
must not fork).

The template is one per kernel, started by :func:`warm` and reused by every cluster; it
exits when the kernel does (its stdin closes), and :func:`stop` ends it
(``%unload_ext distnb``). ``DISTNB_ZYGOTE=0`` turns it off: engines then start as fresh
processes.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from distnb.engine.zygote import frozen_env

#: Seconds ``%dist start`` waits for a template that is still importing before starting fresh engines.
READY_WAIT = 60.0
#: Set in the template's own environment: if an import asks ``torch.cuda.is_available()``, NVML
#: answers, so the CUDA driver is never initialised in a process that forks.
TEMPLATE_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
#: Seconds to wait for the template to answer a fork request.
FORK_WAIT = 10.0


def enabled() -> bool:
    """Whether engines may be forked from a template (``DISTNB_ZYGOTE`` is not ``0``)."""
    return os.environ.get("DISTNB_ZYGOTE", "1").strip().lower() not in ("0", "no", "false", "off")


class ForkedProcess(psutil.Process):
    """An engine forked by the template: its exit status comes from the template, which reaps it.

    Attributes
    ----------
    exit_status : int or None
        Exit code, or minus the signal number that killed it; None while it runs.
    """

    def __init__(self, pid: int, zygote: "Zygote"):
        super().__init__(pid)
        self._zygote = zygote

    @property
    def exit_status(self):
        return self._zygote.exits.get(self.pid)

    def wait(self, timeout=None):
        """Wait for the engine to end; its exit status. Raises ``psutil.TimeoutExpired``."""
        if self._zygote.wait_exit(self.pid, timeout):
            if self.pid in self._zygote.exits:
                return self._zygote.exits[self.pid]
            return self._wait_orphan(timeout)
        raise psutil.TimeoutExpired(timeout, self.pid)

    def _wait_orphan(self, timeout):
        """The template is gone: watch the pid; a zombie counts as ended (an init that never reaps is common
        in containers). Its exit status is lost (None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self.status() == psutil.STATUS_ZOMBIE:
                    return None
            except psutil.NoSuchProcess:
                return None
            if deadline is not None and time.monotonic() >= deadline:
                raise psutil.TimeoutExpired(timeout, self.pid)
            time.sleep(0.05)


class Zygote:
    """One template process (``python -m distnb.engine.ipengine --zygote``) and its replies.

    Parameters
    ----------
    env : dict, optional
        The template's environment (default: the kernel's). Each engine gets its own
        environment at fork; only the variables read at start-up (:meth:`matches`) are fixed
        by the template's.
    """

    def __init__(self, env: dict | None = None):
        env = {**(os.environ if env is None else env), **TEMPLATE_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "distnb.engine.ipengine", "--zygote"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        self._gone = False
        self.ready_event = threading.Event()
        self.info: dict = {}
        self.exits: dict = {}
        self._replies: dict = {}
        self._abandoned: set = set()  # ids of fork requests whose caller stopped waiting (see _end_abandoned)
        self._cond = threading.Condition()
        self._next = 0
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="distnb-zygote", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None and not self._gone  # poll() first: a dead template is reaped, no zombie

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                if msg.get("ready"):
                    self.info = msg
                elif "exit" in msg:
                    self.exits[msg["exit"]] = msg["status"]
                elif "id" in msg:
                    self._replies[msg["id"]] = msg
                    self.exits.pop(msg.get("pid"), None)  # a reused pid: the old engine's status is not this one's
                    if msg["id"] in self._abandoned:
                        self._end_abandoned()
                self._cond.notify_all()
            if msg.get("ready"):
                self.ready_event.set()
        with self._cond:  # the template is gone (its stdout closed: waiters must not wait for a poll() to agree)
            self._gone = True
            self._cond.notify_all()
        self.ready_event.set()

    def ready(self, timeout: float = READY_WAIT) -> bool:
        """Wait until the template has imported everything (True), or it died or ``timeout`` s passed."""
        self.ready_event.wait(timeout)
        return bool(self.info) and self.alive()

    def matches(self, env: dict) -> bool:
        """Whether a fork can give an engine the environment ``env``: the variables read at start-up agree.

        Those are ``PYTHON*``, ``LD_*``, torch's logging and compiler switches and the math
        libraries' (:data:`distnb.engine.zygote.FROZEN_ENV_PREFIXES`), as the template started with them.
        A variable may also hold what the template's own imports set it to (torch sets
        ``TORCHINDUCTOR_CACHE_DIR``, in a fresh engine as in a kernel that imported it).
        """
        return not self.mismatched(env)

    def mismatched(self, env: dict) -> list:
        """The variables of ``env`` that a fork cannot give (see :meth:`matches`), sorted."""

        before, after = self.info.get("frozen_env", {}), self.info.get("frozen_env_after", {})
        want = frozen_env(env)
        return sorted(k for k in set(want) | set(before) | set(after)
                      if k not in TEMPLATE_ENV and want.get(k) not in (before.get(k), after.get(k)))

    def fork(self, args: list, env: dict, cwd: str, output: str, title: str, main: str = "engine") -> int:
        """Fork an engine (``main="engine"``: ``ipengine`` with ``args``) or the controller (``"controller"``).

        The child gets the environment ``env``, works in ``cwd``, logs to ``output`` and shows
        ``title`` as its command line.

        Returns
        -------
        int
            The engine's pid.

        Raises
        ------
        RuntimeError
            The template is gone, could not fork, or did not answer within :data:`FORK_WAIT` s.
        """
        with self._lock:
            self._next += 1
            rid = self._next
        line = json.dumps(dict(id=rid, main=main, args=list(args), env=dict(env), cwd=cwd, output=output, title=title))
        try:
            with self._lock:
                try:
                    self.proc.stdin.write(line.encode() + b"\n")
                    self.proc.stdin.flush()
                except (OSError, ValueError) as exc:
                    raise RuntimeError(f"the engine template (pid {self.pid}) is gone: {exc}") from None
            with self._cond:
                if not self._cond.wait_for(lambda: rid in self._replies or not self.alive(), FORK_WAIT):
                    raise RuntimeError(f"the engine template (pid {self.pid}) did not fork within {FORK_WAIT:.0f} s")
                reply = self._replies.pop(rid, None)
        except BaseException:  # Ctrl-C (or a timeout) once the request may be sent: the template forks anyway, and
            self._abandoned.add(rid)  # nobody would know that child's pid: end it when (or if) its reply comes
            self._end_abandoned()
            raise
        if reply is None:
            raise RuntimeError(f"the engine template (pid {self.pid}) exited")
        if "error" in reply:
            raise RuntimeError(f"the engine template (pid {self.pid}): {reply['error']}")
        return reply["pid"]

    def _end_abandoned(self) -> None:
        """SIGKILL the children of forks whose caller stopped waiting for the reply (an interrupted
        ``%dist start``): nobody knows their pids, so they would outlive the cluster's stop.

        Called by both the caller and the reader thread, without the lock: whichever sees both the
        abandoned request and its reply ends the child (``dict.pop`` hands the reply to one of them).
        """
        for rid in list(self._abandoned):
            reply = self._replies.pop(rid, None)
            if reply is None:
                continue
            self._abandoned.discard(rid)
            try:
                os.kill(reply["pid"], signal.SIGKILL)
            except (KeyError, OSError):  # the fork failed, or the child is gone
                pass

    def process(self, pid: int) -> ForkedProcess:
        return ForkedProcess(pid, self)

    def wait_exit(self, pid: int, timeout: float | None) -> bool:
        """Wait until the template reports ``pid``'s exit (True) or ``timeout`` s pass or it dies (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: pid in self.exits or not self.alive(), timeout)

    def close(self, timeout: float = 2.0) -> None:
        """End the template (its engines are not touched)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_ZYGOTE: Zygote | None = None
_GUARD = threading.Lock()


def warm() -> Zygote | None:
    """Start the kernel's template in the background unless it runs (or ``DISTNB_ZYGOTE=0``)."""
    global _ZYGOTE
    if not enabled():
        return None
    with _GUARD:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            _ZYGOTE = Zygote()
        return _ZYGOTE


def get(timeout: float | None = None) -> Zygote | None:
    """The kernel's template once it is ready (starting it if needed), or None (off, failed or slow)."""
    z = warm()
    if z is None or not z.ready(READY_WAIT if timeout is None else timeout):
        return None
    return z


def stop() -> None:
    """End the kernel's template (engines already forked keep running)."""
    global _ZYGOTE
    with _GUARD:
        z, _ZYGOTE = _ZYGOTE, None
    if z is not None:
        z.close()


atexit.register(stop)
