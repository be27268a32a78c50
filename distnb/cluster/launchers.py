"""The processes ipyparallel starts for distnb: its launcher classes as distnb adjusts them.

Local engines and their controller are forked from the kernel's engine template
(:mod:`distnb.cluster.zygote`) when there is one (:class:`_Forkable`), else started as fresh
processes by ipyparallel's own local launchers; engines start through
:mod:`distnb.engine.ipengine` (:data:`ENGINE_CMD`). The ssh launcher gives up on a host it
cannot reach (:class:`_SSHEngineLauncher`); the Slurm launcher keeps sbatch's refusal and waits
for a cancelled job to leave the queue (:class:`_SlurmEngineSetLauncher`); other launchers are
ipyparallel's own (:data:`LAUNCHER_CLASSES`).

Engine deaths are reported with how the process ended (``killed by SIGKILL``,
``exited with status 1``, :func:`exit_description`): the engines are children of the kernel,
started by ipyparallel's local launcher, whose wait thread reaps them; :class:`_EngineLauncher`
keeps the exit status it sees (:class:`_Process`). The profile's connection files are made
owner-only once the controller wrote them (:func:`_restrict_security_files`).

The functions at the end read what a started ``ipyparallel.Cluster``'s launchers hold: the
processes they started (for the reaper, :mod:`distnb.cluster.reaper`), a launcher process that
exited early (mpiexec), the host an ssh launcher failed on, the registration port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time

import psutil
from ipyparallel.cluster.launcher import (
    LocalControllerLauncher,
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    SlurmEngineSetLauncher,
    SSHEngineLauncher,
    SSHEngineSetLauncher,
)
from traitlets import Float, List

from distnb.cluster import slurm, zygote
from distnb.cluster.placement import REGISTRATION_ARG, engine_command, hostname_of, resolve
from distnb.core.errors import ClusterError
from distnb.engine.ipengine import holds_json

#: Seconds an ssh launcher keeps asking an unreachable host about its engine before giving up.
UNREACHABLE_GIVE_UP = 20.0


def exit_description(code) -> str:
    """How a process ended, from its exit status (psutil/subprocess: minus the signal number if killed)."""
    if code is None:
        return "exited (status unknown: killed, crashed or os._exit)"
    code = int(code)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + _SIGNAL_HINTS.get(name, "")
    return f"exited with status {code}"


_SIGNAL_HINTS = {
    "SIGKILL": " (from outside the engine, or by the out-of-memory killer)",
    "SIGABRT": " (native code aborted, e.g. gloo on a collective whose tensors differ in size across ranks)",
    "SIGSEGV": " (a crash in native code)",
}


class _Process(psutil.Process):
    """A psutil.Process that keeps the exit status its first successful ``wait`` returned."""

    exit_status = None

    def wait(self, timeout=None):
        code = super().wait(timeout)
        if code is not None and self.exit_status is None:
            self.exit_status = code
        return code


#: How a local engine starts (or what a fork from the engine template stands for).
ENGINE_CMD = engine_command()
#: How the controller starts (ipyparallel's default), or what a fork from the template stands for.
CONTROLLER_CMD = [sys.executable, "-m", "ipyparallel.controller"]


def _template_of(launcher):
    """The engine template the launcher's ``ipp.Cluster`` was given (None: start a fresh process)."""
    while launcher is not None and not hasattr(launcher, "_distnb_zygote"):
        launcher = getattr(launcher, "parent", None)
    return getattr(launcher, "_distnb_zygote", None)


class _Forkable:
    """A local process launcher that forks its process from the kernel's engine template when it can.

    What the launcher would run (``cmd`` + options), with the same environment, working
    directory and log file; else (no template, another command, or variables read at start-up
    that a fork cannot give, :meth:`distnb.cluster.zygote.Zygote.matches`) ipyparallel's own start.
    """

    _template_main = ""  # what the template's child runs: "engine" or "controller"

    def _start_forked(self, cmd, default_cmd) -> bool:
        template = _template_of(self)
        env = os.environ.copy()
        env.update(self.get_env())
        if template is not None and not template.alive():  # it died since the cluster started (killed, out of
            template = zygote.get(0)  # memory): the kernel's new one if it is ready, else a fresh process
        if template is None or list(cmd) != default_cmd or not template.matches(env):
            return False
        args = self.args
        try:
            self.pid = template.fork(args[len(default_cmd):], env, os.path.abspath(self.work_dir), self.output_file,
                                     title=" ".join(args), main=self._template_main)
        except RuntimeError:
            if template.alive():
                raise
            return False  # it died while asked
        self.process = template.process(self.pid)
        self.notify_start(self.pid)
        self._start_waiting()
        return True


class _ControllerLauncher(_Forkable, LocalControllerLauncher):
    """ipyparallel's local controller launcher; the controller is forked from the engine template when there is one."""

    _template_main = "controller"

    def start(self):
        if not self._start_forked(self.controller_cmd, CONTROLLER_CMD):
            super().start()

    async def get_connection_info(self, timeout=None):
        """ipyparallel's, once the files are complete: it looks for them every 0.1 s, this every 5-20 ms.

        A forked controller writes them about 50 ms after it starts (issue 17: a tenth of a
        2-engine ``%dist start`` was this wait). They are written in place, so a file counts
        once it parses. A controller that exits meanwhile is left to ipyparallel's wait to report.
        """
        paths = list(self.connection_files.values())
        deadline, pause = time.monotonic() + CONNECTION_FILES_WAIT, 0.005
        while not all(map(holds_json, paths)) and self.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(pause)
            pause = min(0.02, pause * 1.5)
        return await super().get_connection_info(timeout)


#: Up to this many engines the controller runs its schedulers as threads of its own process (:func:`scheduler_args`).
SCHEDULER_THREADS_UP_TO = 16


def scheduler_args(num_engines: int, launcher: str = "local") -> list:
    """The controller's option for where its schedulers run, for ``num_engines`` engines started by ``launcher``.

    By default ipyparallel's controller forks a process for each of its eight helpers (the
    direct, control and IOPub queues, the load-balancing and broadcast schedulers, the heart
    monitor) before it answers anyone. Forked from the engine template, each fork copies the
    page tables of a process that has imported torch: about 20 ms each here, 0.16 s of a 2-engine
    ``%dist start``. As threads (``IPController.use_threads``) only the heart monitor is forked; the
    queues are zmq devices either way (they run outside the GIL), and distnb sends nothing through
    the schedulers. Measured here (issue 17, benchmarks/README.md), starts of 2/8/16/32 engines took
    0.46/1.01/1.66/3.71 s with threads against 0.60/1.11/1.79/3.17 s with processes: at 32 the
    schedulers' handling of every engine's registration, all in the hub's one thread, costs more
    than the forks save. So threads up to :data:`SCHEDULER_THREADS_UP_TO` engines, processes above.
    Only for the ``local`` launcher, whose controller is the one forked from the template: with remote
    engines the controller is a fresh, small process, and its threads' internal sockets (loopback)
    would sit beside the address the engines reach.
    """
    return ["--IPController.use_threads=True"] if launcher == "local" and num_engines <= SCHEDULER_THREADS_UP_TO \
        else []


#: Seconds :meth:`_ControllerLauncher.get_connection_info` looks often before ipyparallel's own wait goes on.
CONNECTION_FILES_WAIT = 10.0


class _EngineLauncher(_Forkable, LocalEngineLauncher):
    """ipyparallel's local engine launcher, keeping the engine's exit status; forked from the template if any.

    Its wait thread reaps the engine as soon as it exits (pidfd/waitpid) but reports the
    status only through the launcher's event loop, which does not run in a plain kernel
    call; the status is kept on ``self.process.exit_status`` instead.
    """

    _template_main = "engine"

    def _start_waiting(self):
        if self.process is not None and not isinstance(self.process, (_Process, zygote.ForkedProcess)):
            self.process = _Process(self.process.pid)
        super()._start_waiting()

    def start(self):
        if not self._start_forked(self.engine_cmd, ENGINE_CMD):
            super().start()


#: Set in every engine's environment unless the kernel's environment sets them. INFO makes DDP's
#: "parameters that were not used in producing loss" error name the parameters (not only their
#: indices); unlike DETAIL it adds no collective checks to training.
ENGINE_ENV = {"TORCH_DISTRIBUTED_DEBUG": "INFO",
              # CUDA numbers GPUs fastest first, nvidia-smi and /proc/driver/nvidia by PCI bus: one order for both
              "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


class _EngineSetLauncher(LocalEngineSetLauncher):
    """Engines start through :mod:`distnb.engine.ipengine` (torch imports overlap registration), all at once.

    The kernel's ``ipp.Cluster`` carries the engines' extra environment as ``_distnb_engine_env``.
    """

    launcher_class = _EngineLauncher
    engine_cmd = List(ENGINE_CMD, config=True)
    # no nanny process per engine: distnb signals engines by pid, and registration would wait
    # for a second Python interpreter to start (about 0.5 CPU-s per engine, more under load);
    # no IPython history database either (cells reach engines as function calls, not history);
    # no watch on the controller's heartbeat in the engine: it wakes the engine's Python loop at every
    # ping (10 a second, HEARTBEAT_MS), about 6 CPU-ms a second per idle engine here, 0.2 of a core
    # for 32 engines (issue 20); an engine on this machine is ended by distnb instead (its pid, the reaper)
    # and a registration that waits for a busy controller (placement.REGISTRATION_WAIT)
    engine_args = List(["--IPEngine.enable_nanny=False", "--HistoryManager.enabled=False",
                        "--IPEngine.max_heartbeat_misses=0", REGISTRATION_ARG], config=True)
    delay = Float(0.0, config=True)  # ipyparallel sleeps 0.1 s between engines by default

    def start(self, n):
        self.environment = {**self.environment, **getattr(self.parent, "_distnb_engine_env", {})}
        return super().start(n)


class _SSHEngineLauncher(SSHEngineLauncher):
    """ipyparallel's ssh engine launcher, bounded when the engine's host cannot be reached.

    ipyparallel asks the host over ssh whether the engine still runs and signals it over
    ssh; when the host is unreachable, its watch thread dies with an uncaught
    CalledProcessError and stopping retries for minutes. Here the watch keeps asking for
    :data:`UNREACHABLE_GIVE_UP` seconds (the controller's heartbeat is what tells distnb the
    engine is gone), then, or as soon as a signal cannot be delivered, the engine counts as
    exited with an unknown status.
    """

    def wait_one(self, timeout):
        if getattr(self, "_exited", False):
            return 0
        if getattr(self, "_unreachable", False):
            return -1
        try:
            out = super().wait_one(timeout)
            self._unreachable_since = None
            return out
        except subprocess.CalledProcessError:
            since = getattr(self, "_unreachable_since", None) or time.monotonic()
            self._unreachable_since = since
            if time.monotonic() - since > UNREACHABLE_GIVE_UP:
                self._unreachable = True
                return -1
            stop = getattr(self, "_stop_waiting", None)
            if stop is not None and stop.wait(min(timeout or 1.0, 1.0)):
                return -1
            raise TimeoutError(f"host {self.hostname} unreachable") from None

    def signal(self, sig):
        if getattr(self, "_exited", False):  # its pid may be another process's by now
            return
        try:
            super().signal(sig)
        except subprocess.CalledProcessError:  # nothing can reach it: do not wait for it to exit either
            self._unreachable = True

    def mark_exited(self):
        """The engine is known to be gone (``%dist scale`` saw it exit): never ask its host or signal it again."""
        self._exited = True


class _SSHEngineSetLauncher(SSHEngineSetLauncher):
    launcher_class = _SSHEngineLauncher


class _SlurmEngineSetLauncher(SlurmEngineSetLauncher):
    """ipyparallel's Slurm engine launcher: sbatch's refusal kept whole, and a stop that waits for the job to go.

    The job script goes into the profile folder (ipyparallel writes it into the working
    directory). ipyparallel runs ``sbatch`` without capturing its stderr (the reason it refused the job
    goes to the kernel's terminal) and ``scancel`` without waiting: here a failed submit is a
    :class:`distnb.cluster.slurm.SubmitError` carrying sbatch's message, and :meth:`stop` returns once
    ``squeue`` no longer lists the job (its processes on every node are gone), at most
    :data:`SCANCEL_WAIT` seconds later.
    """

    def write_batch_script(self, n=1):
        # into the cluster's profile folder, not the notebook's (ipyparallel's default: the working directory)
        if self.batch_file_name == type(self).batch_file_name.default_value and self.profile_dir:
            self.batch_file = os.path.join(self.profile_dir, f"slurm_engine-{self.cluster_id}.sbatch")
        return super().write_batch_script(n)

    def _run_command(self, command, **kwargs):
        kwargs.setdefault("timeout", slurm.COMMAND_TIMEOUT)
        try:
            p = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, **kwargs)
        except FileNotFoundError as exc:
            raise slurm.SubmitError(command, 127, f"{command[0]}: {exc.strerror}") from None
        except subprocess.TimeoutExpired:
            raise slurm.SubmitError(command, 124, f"{command[0]} did not answer within "
                                                  f"{kwargs['timeout']:.0f} s") from None
        if p.returncode:
            raise slurm.SubmitError(command, p.returncode, p.stderr.decode("utf8", "replace"))
        return p.stdout.decode("utf8", "replace")

    def stop(self):
        if not self.job_id:  # never submitted
            return ""
        try:
            output = super().stop()
        except slurm.SubmitError as exc:  # slurmctld unreachable: nothing more can be done from here
            output = str(exc)
        slurm.wait_gone(self.job_id, SCANCEL_WAIT)
        return output


#: Seconds ``%dist stop`` waits, after scancel, for squeue to stop listing the engines' job.
SCANCEL_WAIT = 20.0
#: ipyparallel launchers distnb adjusts (by --launcher name); the others are ipyparallel's own.
LAUNCHER_CLASSES = {"ssh": _SSHEngineSetLauncher, "slurm": _SlurmEngineSetLauncher}


def batch_job_id(cluster) -> str | None:
    """The batch job id of ``cluster``'s (an ``ipp.Cluster``) engines, once submitted (slurm, pbs, ...)."""
    for engine_set in getattr(cluster, "engines", {}).values():
        job = getattr(engine_set, "job_id", "")
        if job:
            return str(job)
    return None


def batch_output_file(cluster) -> str | None:
    """Where the batch job of ``cluster``'s engines writes its output (the job script's --output)."""
    return next((getattr(e, "output_file", None) for e in getattr(cluster, "engines", {}).values()), None)


def _restrict_security_files(profile_dir: str) -> None:
    """Make every file in the profile's security folder owner-only (ipyparallel leaves the cluster file 0644)."""
    folder = os.path.join(profile_dir or "", "security")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode) and os.stat(path).st_mode & 0o077:
                os.chmod(path, 0o600)
        except OSError:
            pass


def remove_cluster_files(cluster) -> None:
    """After ``cluster`` (an ``ipp.Cluster``) stopped: remove the files it leaves in its profile.

    Its cluster file, which ipyparallel leaves when a stop fails (an unreachable host), and the
    controller's engine state file (``log/engines<cluster_id>.json``, written at every
    registration for ``ipcontroller --restore``), which ipyparallel 9 never removes: one more in
    the profile at every ``%dist start``.
    """
    log_dir = os.path.join(cluster.profile_dir or "", "log")
    for path in (cluster.cluster_file, os.path.join(log_dir, f"engines{cluster.cluster_id}.json")):
        try:
            os.remove(path)
        except (OSError, TypeError):
            pass


def engine_processes(cluster) -> dict:
    """{pid: psutil.Process} of the engines the local launchers of ``cluster`` (an ``ipp.Cluster``) started."""
    out = {}
    for engine_set in cluster.engines.values():
        for launcher in getattr(engine_set, "launchers", {}).values():
            if isinstance(getattr(launcher, "process", None), psutil.Process):
                out[launcher.process.pid] = launcher.process
    return out


def engines_started(cluster) -> str:
    """How many engines the engine sets of ``cluster`` (an ``ipp.Cluster``) started so far, as ``"2 engines"``."""
    n = 0
    for engine_set in (cluster.engines.values() if cluster is not None else ()):
        started = len(getattr(engine_set, "launchers", None) or {})  # one launcher per local or ssh engine
        if not started and getattr(engine_set, "process", None) is not None:  # one mpiexec for the set
            started = getattr(engine_set, "n", 0) or 0
        n += started
    return f"{n} engine{'s' * (n != 1)}"


def stopped_so_far(cluster) -> str:
    """What an interrupted start stopped, for its one line: ``"stopped the 2 engines started so far"``."""
    started = engines_started(cluster)
    return "no engine had started yet" if started == "0 engines" else f"stopped the {started} started so far"


class _InterruptedTaskFilter(logging.Filter):
    """Drops what asyncio logs about the tasks an interrupted ipyparallel call leaves.

    An interrupted ``%dist start`` leaves the KeyboardInterrupt in the task of ipyparallel's
    ``start_cluster``/``connect_client`` (run by ``_async._synchronize``), or that task pending;
    asyncio logs "Task exception was never retrieved" (with a traceback) or "Task was destroyed but
    it is pending!" whenever the task is garbage-collected, in some later cell. distnb has already
    said what the interrupt did (:class:`~distnb.core.errors.Interrupted`); other task errors are still logged.
    """

    def filter(self, record) -> bool:
        exc, text = record.exc_info[1] if record.exc_info else None, str(record.msg)
        interrupted = isinstance(exc, KeyboardInterrupt) and "never retrieved" in text
        return not (interrupted or ("destroyed but it is pending" in text and "ipyparallel" in text))


if not any(isinstance(f, _InterruptedTaskFilter) for f in logging.getLogger("asyncio").filters):
    logging.getLogger("asyncio").addFilter(_InterruptedTaskFilter())


def launcher_processes(cluster, launcher: str) -> list:
    """(engine set, psutil.Process) of the engine sets that are one process (mpiexec)."""
    out = []
    for engine_set in cluster.engines.values():
        proc = getattr(engine_set, "process", None)
        if launcher == "mpi" and isinstance(proc, psutil.Process):
            out.append((engine_set, proc))
    return out


def check_launcher_alive(cluster, launcher: str) -> None:
    """A launcher (mpiexec) that exited before its engines registered: ClusterError with what it printed."""
    for engine_set, proc in launcher_processes(cluster, launcher):
        if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            continue
        try:
            output = engine_set.get_output() or ""
        except Exception:
            output = ""
        lines = [line for line in output.strip().splitlines() if line.strip() and not line.startswith("---")]
        raise ClusterError(f"{launcher} launcher exited before the engines registered"
                           + (":\n" + "\n".join(lines[-12:]) if lines else ""))


def refresh_engines(client) -> None:
    """Add to ``client`` the engines the hub has registered that the client never heard of.

    The client learns of engines from the hub's reply to its connection request and then from
    registration notifications, on a SUB socket it connects after that reply: an engine that
    registers in between is never announced to it (zmq's "slow joiner"), and ``client.ids``
    lacks it for good. Seen as ``%dist start -n 32`` finding 31 of 32 engines, all 32 registered
    (issue 20). The hub's list is asked for again (the same request, a reply of ``{id: uuid}``).
    """
    reply = client._send_recv(client._query_stream, "connection_request")
    if reply["content"].get("status") == "ok":
        client._update_engines(dict(reply["content"]["engines"]))


def controller_group(pid: int) -> list:
    """The controller processes in the process group ``pid`` (the controller's: it starts in a session of its
    own), as psutil.Process: the controller and the schedulers it forks, even orphaned ones.

    A stop that begins while the controller is still starting finds no scheduler among its children; the
    controller forks them, dies of the stop, and they live on as orphans. Matching the command line as well
    as the group leaves alone any other process that might hold a reused group id.
    """
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pid and CONTROLLER_CMD[-1] in " ".join(proc.cmdline()):
                out.append(proc)
        except (psutil.Error, OSError):
            pass
    return out


def started_pids(cluster, launcher: str) -> list:
    """Pids of this machine's processes that ``cluster``'s launchers started, beside the engines and controller.

    The local engines' launchers, a launcher process (mpiexec) and the controller's own
    processes (its schedulers: orphaned, not stopped, if it is killed).
    """
    pids = []
    if launcher == "local":  # an ssh launcher's pid is the engine's pid on its own host
        for engine_set in cluster.engines.values():
            pids += [l.pid for l in getattr(engine_set, "launchers", {}).values() if (getattr(l, "pid", None) or 0) > 0]
    pids += [proc.pid for _, proc in launcher_processes(cluster, launcher)]
    controller = getattr(getattr(cluster, "controller", None), "pid", None)
    try:
        pids += [c.pid for c in psutil.Process(controller).children(recursive=True)]
    except (psutil.Error, TypeError, ValueError):
        pass
    return pids


def failed_ssh_host(cluster, hosts, set_id=None) -> str:
    """`` on HOST (over ssh)`` for the host whose engine the ssh launcher was starting when it failed.

    ``set_id``: the engine set to look at (default: the first).
    """
    try:
        engine_set = cluster.engines[set_id] if set_id is not None else next(iter(cluster.engines.values()))
        failed = [key for key, l in engine_set.launchers.items() if l.state != "running"]
        started = {key.rsplit("/", 1)[0] for key in engine_set.launchers}
        names = [key.rsplit("/", 1)[0] for key in failed]
        names += [h for h in hosts if h not in started][:1] if not names else []
        return f" on {names[0]} (over ssh)" if names else ""
    except Exception:
        return ""


def ssh_launcher_of(cluster, info: dict):
    """The ssh launcher of ``cluster`` (an ``ipp.Cluster``) that started the engine ``info`` describes, or None.

    ``info``: the engine's :func:`distnb.core.net.whereami` dict; matched by its pid on the launcher's host.
    """

    for engine_set in getattr(cluster, "engines", {}).values():
        for launcher in getattr(engine_set, "launchers", {}).values():
            host = getattr(launcher, "hostname", None)
            if host is None or getattr(launcher, "pid", None) != info.get("pid"):
                continue
            if hostname_of(host) in (info.get("host"), info.get("address")) or resolve(host) == info.get("address"):
                return launcher
    return None


def wait_gone_over_ssh(launcher, timeout: float) -> bool:
    """Whether the ssh engine of ``launcher`` exits within ``timeout`` s: its host asked over ssh until its pid is gone.

    An unreachable host counts as not confirmed (False) once ``timeout`` has passed.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            launcher.wait_one(timeout=max(0.1, min(2.0, left)))
            return not getattr(launcher, "_unreachable", False)
        except (TimeoutError, subprocess.CalledProcessError, RuntimeError):
            if left <= 0:
                return False


def registration_port(cluster):
    """The port engines register at, from the controller's engine connection file ("?" if unknown)."""
    try:
        with open(os.path.join(cluster.profile_dir, "security", f"ipcontroller-{cluster.cluster_id}-engine.json")) as f:
            return json.load(f)["registration"]
    except Exception:
        return "?"


def connect_client(ipp_cluster):
    """The cluster's ``ipyparallel.Client``, without the parallel magics it registers in the notebook.

    A Client made in an IPython kernel that has no ``%px`` yet registers ``%px``, ``%%px``, ``%autopx``,
    ``%pxresult`` (``%result``) and ``%pxconfig`` for itself. distnb's engines are its ranks, driven by
    ``%dist``/``%%dist``; with IPython's automagic, a bare undefined ``result`` (the README's ``-o result``)
    then ran ``%pxresult`` ("recalls last %px result, which has not yet been used") instead of a NameError,
    and ``autopx`` sent every later cell, ``%dist stop`` included, to the engines as code. Magics the notebook
    had before (a Client of the user's own) stay.
    """
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    before = {kind: dict(table) for kind, table in shell.magics_manager.magics.items()} if shell is not None else {}
    client = ipp_cluster.connect_client_sync()
    for kind, table in before.items():
        now = shell.magics_manager.magics[kind]
        for name in [n for n in now if n not in table and type(getattr(now[n], "__self__", None)).__name__
                     == "ParallelMagics"]:
            del now[name]
    return client
