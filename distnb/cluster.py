"""ipyparallel cluster lifecycle and the one place that maps engine_id <-> rank.

The controller listens on 127.0.0.1 and its heartbeat period is shortened (the
default 3 s heartbeat made a plain ``ipyparallel.Cluster`` start take ~6.6 s here;
FIELD-NOTES pitfall 2). Local CPU engines and their controller are forked from the kernel's
engine template (:mod:`distnb.zygote`), others start as fresh processes. Engines are ranked
by ascending engine id (or by placement over hosts). Each engine gets its rank's
environment, device and thread count (:func:`distnb.engine.runtime.setup`); a GPU engine
before torch is imported on it.

Security: with engines on this machine every socket the cluster listens on is bound to
127.0.0.1 (the controller's ``--ip``; the torch.distributed store and gloo's pair sockets, see
:func:`distnb.engine.runtime._init_group`); with engines on other hosts (ssh, batch, mpi with
hosts, :mod:`distnb.placement`) the controller listens on one address those hosts reach and
rank 0's store on its own such address, never on every interface; ipyparallel's HMAC-SHA256 message signing
stays on (the connection files carry a key) and every file in the profile's
``security`` folder is readable by the owner only (mode 0600).

Engine deaths are reported with how the process ended (``killed by SIGKILL``,
``exited with status 1``): the engines are children of the kernel, started by
ipyparallel's local launcher, whose wait thread reaps them; :class:`_EngineLauncher`
keeps the exit status it sees.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import ipyparallel as ipp
import psutil
from traitlets import Float, List
from ipyparallel.cluster.launcher import (LocalControllerLauncher, LocalEngineLauncher, LocalEngineSetLauncher,
                                          SSHEngineLauncher, SSHEngineSetLauncher)

from . import calls, placement, zygote
from .calls import RankFunction
from .net import check_port_free, free_port, is_loopback, visible_gpus
from .errors import ClusterError, PlanError, RankError
from .options import check_int, split_hosts
from .plan import BATCH_LAUNCHERS, ClusterSpec

HEARTBEAT_MS = 100
HEARTBEAT_MISSES = 25  # an engine is dropped after 2.5 s without a heartbeat
#: Seconds an ssh launcher keeps asking an unreachable host about its engine before giving up.
UNREACHABLE_GIVE_UP = 20.0
#: Seconds engines started by a batch system (slurm, ...) may take to register: the job may queue.
BATCH_QUEUE_WAIT = 600.0
#: Most CPU engines ``-n`` may ask for: this many per core, and at least MIN_ENGINE_CAP.
ENGINES_PER_CORE = 8
MIN_ENGINE_CAP = 16
# ipyparallel logs each dead engine's whole output; distnb reports deaths itself (naming the rank).
_log = logging.getLogger("distnb.ipyparallel")
_log.setLevel(logging.ERROR)
_log.propagate = False
_log.addHandler(logging.NullHandler())


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
ENGINE_CMD = [sys.executable, "-m", placement.ENGINE_MODULE]
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
    that a fork cannot give, :meth:`distnb.zygote.Zygote.matches`) ipyparallel's own start.
    """

    _template_main = ""  # what the template's child runs: "engine" or "controller"

    def _start_forked(self, cmd, default_cmd) -> bool:
        template = _template_of(self)
        env = os.environ.copy()
        env.update(self.get_env())
        if template is None or list(cmd) != default_cmd or not template.matches(env):
            return False
        args = self.args
        self.pid = template.fork(args[len(default_cmd):], env, os.path.abspath(self.work_dir), self.output_file,
                                 title=" ".join(args), main=self._template_main)
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
ENGINE_ENV = {"TORCH_DISTRIBUTED_DEBUG": "INFO"}


class _EngineSetLauncher(LocalEngineSetLauncher):
    """Engines start through :mod:`distnb.engine.ipengine` (torch imports overlap registration), all at once.

    The kernel's ``ipp.Cluster`` carries the engines' extra environment as ``_distnb_engine_env``.
    """

    launcher_class = _EngineLauncher
    engine_cmd = List(ENGINE_CMD, config=True)
    # no nanny process per engine: distnb signals engines by pid, and registration would wait
    # for a second Python interpreter to start (about 0.5 CPU-s per engine, more under load);
    # no IPython history database either (cells reach engines as function calls, not history)
    engine_args = List(["--IPEngine.enable_nanny=False", "--HistoryManager.enabled=False"], config=True)
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
        try:
            super().signal(sig)
        except subprocess.CalledProcessError:  # nothing can reach it: do not wait for it to exit either
            self._unreachable = True


class _SSHEngineSetLauncher(SSHEngineSetLauncher):
    launcher_class = _SSHEngineLauncher


#: ipyparallel launchers distnb adjusts (by --launcher name); the others are ipyparallel's own.
LAUNCHER_CLASSES = {"ssh": _SSHEngineSetLauncher}


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


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_spec(n: int | None = None, backend: str | None = None, timeout: float = 60.0,
                 master_port: int | None = None, **where) -> ClusterSpec:
    """One engine per GPU (nccl), or with no GPU one CPU engine per core (gloo); ``n`` overrides.

    ``where`` holds the placement options of :class:`~distnb.plan.ClusterSpec` (launcher,
    hosts, nodes, engines_per_node, queue, time_limit, account, profile, interface,
    master_addr). With a launcher other than ``local``, ``n`` defaults to hosts (or nodes)
    times ``engines_per_node``, and the device is chosen once the engines report what their
    hosts have (:class:`Cluster` ``auto_device``).
    """
    where = {k: v for k, v in where.items() if v is not None}
    if "hosts" in where:
        where["hosts"] = split_hosts("--hosts", where["hosts"])
    for name in ("engines_per_node", "nodes"):  # checked before they make -n
        if name in where:
            check_int("--" + name.replace("_", "-"), where[name], 1)
    launcher = where.get("launcher", "local" if "profile" not in where else None)
    where["launcher"] = launcher
    if n is None and "profile" in where and not where.get("hosts") and not where.get("nodes"):
        n = placement.engine_count(placement.profile_config(where["profile"])[1])
    if launcher is None or placement.engines_remote(launcher, where.get("hosts")):
        hosts = len(where.get("hosts", ())) or where.get("nodes")
        if n is None:
            if not hosts and launcher not in (None, "mpi"):
                raise PlanError(f"--launcher {launcher}: say how many engines with -n (or --hosts/--nodes with "
                                "--engines-per-node)")
            n = hosts * where.get("engines_per_node", 1) if hosts else cpu_cores()
        backend = backend or "gloo"
        device_type = "cuda" if backend == "nccl" else "cpu"
        return ClusterSpec(num_engines=n, backend=backend, device_type=device_type, num_threads=1,
                           timeout=timeout, master_port=master_port, **where)
    gpus = visible_gpus()
    device_type = "cuda" if gpus else "cpu"
    if n is None:
        n = len(gpus) if gpus else cpu_cores()
    if device_type == "cuda" and isinstance(n, int) and n > len(gpus):
        raise ClusterError(f"-n {n} asks for more GPU engines than the {len(gpus)} visible GPUs")
    most = max(MIN_ENGINE_CAP, ENGINES_PER_CORE * cpu_cores())
    if device_type == "cpu" and isinstance(n, int) and not isinstance(n, bool) and n > most:
        raise PlanError(f"-n {n} asks for more than {ENGINES_PER_CORE} engines per CPU core ({cpu_cores()} cores): "
                        f"each engine is a process with its own torch; use at most -n {most}")
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    threads = max(1, cpu_cores() // n) if isinstance(n, int) and n > 0 else 1
    return ClusterSpec(num_engines=n, backend=backend, device_type=device_type, num_threads=threads,
                       timeout=timeout, master_port=master_port, **where)


@ipp.interactive
def _shim(module, fn, with_ns, *args):
    # Runs on an engine (see distnb.calls). @interactive makes globals() the engine's user namespace.
    import importlib

    f = getattr(importlib.import_module(module), fn)
    return f(globals(), *args) if with_ns else f(*args)


def _send(view, fn: RankFunction, *args):
    """``fn(*args)`` on the engine(s) of ``view``, the arguments checked against its signature first."""
    fn.check(args)
    return view.apply_async(_shim, fn.module, fn.name, fn.with_ns, *args)


class Cluster:
    """A started ipyparallel cluster whose engines form one torch.distributed process group.

    Parameters
    ----------
    spec : ClusterSpec

    Attributes
    ----------
    ranks : list of dict
        Per rank: rank, engine_id, pid, host, device, backend, num_threads.
    """

    def __init__(self, spec: ClusterSpec, auto_device: bool = False):
        self.spec = spec
        self.auto_device = auto_device  # remote engines: pick cuda/nccl or cpu/gloo from what their hosts have
        self._ipp = None
        self.client = None
        self.engine_ids: list[int] = []  # index = rank
        self.ranks: list[dict] = []
        self.master_port = None
        self.start_seconds = None
        self.num_nodes = 1
        self.remote = False
        self._procs: dict = {}  # engine pid -> _Process (its exit status once it died)
        self.note = ""  # what the start wants the user to know (e.g. why engines were not forked)

    # lifecycle -----------------------------------------------------------
    def start(self, engine_timeout: float = 60.0) -> "Cluster":
        """Start controller and engines, then form the process group. Raises ClusterError.

        Engines start through ipyparallel's launcher ``spec.launcher`` (distnb's fast local
        launcher for ``local``); see :mod:`distnb.placement`.
        """
        t0 = time.perf_counter()
        spec = self.spec
        profile_kwargs, profile = placement.profile_config(spec.profile)
        self.launcher = placement.launcher_name(spec, profile)
        self.remote = placement.engines_remote(self.launcher, spec.hosts)
        placement.check_launcher_tools(self.launcher, profile)
        if self.remote and spec.interface and is_loopback(placement.interface_address(spec.interface) or "x"):
            raise ClusterError(f"--interface {spec.interface} is loopback: engines on other hosts can reach neither "
                               "the controller nor rank 0 over it; name the network the hosts share (e.g. eth0)")
        if spec.master_addr is not None:
            try:
                socket.getaddrinfo(spec.master_addr, None)
            except OSError as exc:
                raise ClusterError(f"--master-addr {spec.master_addr}: not an address ({exc.strerror})") from None
            if self.remote and is_loopback(spec.master_addr) and len(spec.hosts) != 1:
                raise ClusterError(f"--master-addr {spec.master_addr} is loopback: ranks on other hosts cannot "
                                   "reach it; give rank 0's address on the network the hosts share")
        if spec.master_port is not None and not self.remote:  # a pinned port that is taken: say so now
            check_port_free(spec.master_port, spec.master_addr or "127.0.0.1")
        self.controller_ip = profile.get("Cluster", {}).get("controller_ip") or placement.controller_ip(
            spec, self.remote)
        # thread count fixed before torch loads; CPU engines preload DDP too (GPU ones wait for their device)
        env = {"OMP_NUM_THREADS": str(spec.num_threads),
               "DISTNB_PRELOAD": "all" if spec.device_type == "cpu" and not self.remote else "torch"}
        env.update({k: v for k, v in ENGINE_ENV.items() if k not in os.environ})
        if self.launcher == "local":
            launch = dict(engine_launcher_class=_EngineSetLauncher, controller_launcher_class=_ControllerLauncher,
                          delay=0, send_engines_connection_env=False)  # engines start with the controller
        else:
            launch = dict(config=placement.launcher_config(spec, self.launcher, profile, env))
            if spec.launcher is not None:  # else the profile's own launcher class, whatever it is
                launch["engine_launcher_class"] = LAUNCHER_CLASSES.get(self.launcher, self.launcher)
        self._ipp = ipp.Cluster(
            n=spec.num_engines,
            controller_ip=self.controller_ip,
            controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}",
                             f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"],
            log=_log,
            engine_timeout=int(engine_timeout),
            shutdown_atexit=False,  # distnb stops it (session atexit, the reaper); ipyparallel's retries hang
            **launch,
            **profile_kwargs,
        )
        self._ipp._distnb_engine_env = env
        self._ipp._distnb_zygote = None
        try:
            # local CPU engines are forked from the kernel's engine template (imports done once; distnb.zygote)
            if self.launcher == "local" and spec.device_type == "cpu":
                self._ipp._distnb_zygote = self._template({**os.environ, **env})
            self._ipp.start_cluster_sync(spec.num_engines)
            _restrict_security_files(self._ipp.profile_dir)
            for engine_set in self._ipp.engines.values():
                for launcher in getattr(engine_set, "launchers", {}).values():
                    if isinstance(getattr(launcher, "process", None), psutil.Process):
                        self._procs[launcher.process.pid] = launcher.process
            self.client = self._ipp.connect_client_sync()
            # engines register within engine_timeout; a batch job may first wait in the queue
            self._wait_for_engines(max(engine_timeout, spec.timeout,
                                       BATCH_QUEUE_WAIT if self.launcher in BATCH_LAUNCHERS else 0))
            self._place()
            self._setup_ranks()
        except BaseException as exc:
            where = self._failed_host() if self.launcher == "ssh" else ""
            self.stop()
            if isinstance(exc, (ClusterError, PlanError, KeyboardInterrupt)):
                raise
            raise ClusterError(f"could not start {spec.num_engines} engines{where}: {exc}") from exc
        self.start_seconds = time.perf_counter() - t0
        return self

    def _template(self, env: dict):
        """The kernel's engine template if it can fork these engines, else None (``self.note`` says why)."""
        template = zygote.get()
        bad = template.mismatched(env) if template is not None else []
        if bad:
            self.note = (f"engines start as fresh processes: {', '.join(bad)} differ{'s' if len(bad) == 1 else ''} "
                         "from the engine template's (read when Python or torch starts; set "
                         f"{'it' if len(bad) == 1 else 'them'} before %load_ext distnb, or %reload_ext distnb)")
            return None
        return template

    def _wait_for_engines(self, timeout: float) -> None:
        """Wait until every engine has registered; else a ClusterError naming the hosts that are missing."""
        n = self.spec.num_engines
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.wait_for_engines(n, timeout=min(1.0, max(0.0, deadline - time.monotonic())),
                                             interactive=False)
                return
            except TimeoutError:
                pass
            self._check_launcher_alive()
            if time.monotonic() >= deadline:
                break
        got = sorted(self.client.ids)
        where = self._whereami(got) if got else {}
        seen = {info["address"] for info in where.values()} | {info["host"] for info in where.values()}
        missing = [h for h in self.spec.hosts if not {placement.hostname_of(h), placement.resolve(h)} & seen]
        url = f"{self.controller_ip}:{self._registration_port()}"
        hosts = f"; none from {', '.join(missing)}" if missing else ""
        raise ClusterError(
            f"only {len(got)} of {n} engines registered with the controller at {url} within {timeout:.0f} s"
            f"{hosts}. Check that every host can reach {self.controller_ip} (routes, firewall) and start engines "
            f"({self.launcher} launcher); on several networks pick one with %dist start --interface NAME")

    def _failed_host(self) -> str:
        """`` on HOST (over ssh)`` for the host whose engine the ssh launcher was starting when it failed."""
        try:
            engine_set = next(iter(self._ipp.engines.values()))
            failed = [key for key, l in engine_set.launchers.items() if l.state != "running"]
            started = {key.rsplit("/", 1)[0] for key in engine_set.launchers}
            hosts = [key.rsplit("/", 1)[0] for key in failed]
            hosts += [h for h in self.spec.hosts if h not in started][:1] if not hosts else []
            return f" on {hosts[0]} (over ssh)" if hosts else ""
        except Exception:
            return ""

    def _launcher_processes(self) -> list:
        """The launcher processes of the engine sets that are one process (mpiexec), as psutil.Process."""
        out = []
        for engine_set in self._ipp.engines.values():
            proc = getattr(engine_set, "process", None)
            if self.launcher == "mpi" and isinstance(proc, psutil.Process):
                out.append((engine_set, proc))
        return out

    def _check_launcher_alive(self) -> None:
        """A launcher (mpiexec) that exited before its engines registered: ClusterError with what it printed."""
        for engine_set, proc in self._launcher_processes():
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                continue
            try:
                output = engine_set.get_output() or ""
            except Exception:
                output = ""
            lines = [line for line in output.strip().splitlines() if line.strip() and not line.startswith("---")]
            raise ClusterError(f"{self.launcher} launcher exited before the engines registered"
                               + (":\n" + "\n".join(lines[-12:]) if lines else ""))

    def _registration_port(self):
        try:
            with open(os.path.join(self._ipp.profile_dir, "security",
                                   f"ipcontroller-{self._ipp.cluster_id}-engine.json")) as f:
                import json

                return json.load(f)["registration"]
        except Exception:
            return "?"

    def _whereami(self, engine_ids) -> dict:
        ars = {e: _send(self.client[e], calls.whereami, self.controller_ip)
               for e in engine_ids}
        out = {}
        for e, ar in ars.items():
            try:
                out[e] = ar.get(timeout=self.spec.timeout)
            except Exception as exc:
                raise ClusterError(f"engine {e} did not answer where it runs within {self.spec.timeout:.0f} s: "
                                   f"{exc}") from None
        return out

    def _place(self) -> None:
        """Rank order over hosts, each rank's device and threads (see :func:`placement.assign_ranks`)."""
        spec = self.spec
        ids = sorted(self.client.ids)[: spec.num_engines]
        self.where = self._whereami(ids)
        self.placement = placement.assign_ranks(self.where, spec.hosts)
        self.engine_ids = [p["engine_id"] for p in self.placement]
        self.num_nodes = len({p["node_rank"] for p in self.placement})
        if not self.remote:
            return
        per_node = {}
        for p in self.placement:
            per_node[p["node_rank"]] = per_node.get(p["node_rank"], 0) + 1
        for p in self.placement:
            info = self.where[p["engine_id"]]
            p["num_threads"] = max(1, info["cores"] // per_node[p["node_rank"]])
        if spec.backend == "nccl":
            short = [p for p in self.placement if not _gpu_for(self.where[p["engine_id"]]["gpus"], p["local_rank"])]
            if short:
                raise ClusterError(f"--backend nccl needs a GPU for every rank, and host {short[0]['node']} has none "
                                   f"for local rank {short[0]['local_rank']} (it sees "
                                   f"{len(self.where[short[0]['engine_id']]['gpus'])} GPUs); use --backend gloo, "
                                   "or fewer --engines-per-node")
        if self.auto_device:  # no --backend: nccl when every rank's host has a GPU for it
            gpus = all(_gpu_for(self.where[p["engine_id"]]["gpus"], p["local_rank"]) for p in self.placement)
            device, backend = ("cuda", "nccl") if gpus else ("cpu", "gloo")
            self.spec = dataclasses.replace(spec, device_type=device, backend=backend)

    def _master_addr(self) -> str:
        """The rendezvous address: --master-addr, rank 0's on --interface, loopback on one host, else rank 0's."""
        spec = self.spec
        if spec.master_addr:
            addr = spec.master_addr
        elif spec.interface:
            addr = self.wait_all([self.apply(0, calls.interface_address,
                                             spec.interface)], timeout=spec.timeout, what="--interface")[0]
        elif self.num_nodes == 1 and self.placement[0]["local"]:
            addr = "127.0.0.1"
        else:
            addr = self.where[self.engine_ids[0]]["address"]
        if self.num_nodes > 1 and is_loopback(addr):
            raise ClusterError(f"the rendezvous address {addr} is loopback, but the ranks run on {self.num_nodes} "
                               f"hosts ({', '.join(sorted({p['node'] for p in self.placement}))}) and cannot reach "
                               "each other there; pick the network with --interface NAME or --master-addr ADDR")
        return addr

    def _free_port(self) -> int:
        """A port free on rank 0's host (asked there when rank 0 is on another host).

        A ClusterError naming ``--master-addr`` when rank 0 cannot listen on that address.
        """
        try:
            if self.placement[0]["local"]:
                return free_port(self.master_addr)
            return self.wait_all([self.apply(0, calls.free_port, self.master_addr)],
                                 timeout=self.spec.timeout, what="picking the rendezvous port")[0]
        except (OSError, RankError) as exc:
            why = exc.failures[0]["evalue"] if isinstance(exc, RankError) else str(exc)
            raise ClusterError(f"rank 0 (on {self.host_of(0)}) cannot listen on the rendezvous address "
                               f"{self.master_addr} ({why}): --master-addr must be an address of rank 0's host "
                               "(the first of --hosts); or leave it out") from None

    def _setup_ranks(self):
        spec = self.spec
        self.master_addr = self._master_addr()
        self.master_port = spec.master_port or self._free_port()
        ars = []
        local_gpus = visible_gpus() if spec.device_type == "cuda" else []
        for rank, p in enumerate(self.placement):
            gpus = self.where[p["engine_id"]]["gpus"] if self.remote else local_gpus
            gpu = _gpu_for(gpus, p["local_rank"]) if spec.device_type == "cuda" else None
            threads = p.get("num_threads", spec.num_threads)
            ars.append(self.apply(rank, calls.setup, rank, spec.num_engines,
                                  p["local_rank"], spec.backend, spec.device_type, gpu, threads, self.master_addr,
                                  self.master_port, spec.timeout, p["node_rank"], p["node"], spec.interface))
        infos = self.wait_all(ars, timeout=spec.timeout + 60, what="forming the process group")
        self.ranks = [dict(info, engine_id=p["engine_id"], local=p["local"], address=self.where[p["engine_id"]][
            "address"]) for info, p in zip(infos, self.placement)]
        self.apply_all(calls.warm_up)  # queued, not awaited
        self._start_reaper()

    def _start_reaper(self):
        """No process outlives the kernel: a watchdog stops ours if the kernel dies."""
        from .reaper import spawn

        pids = [p for p in [self.pids["controller"], *(r["pid"] for r in self.ranks if r.get("local", True))] if p]
        if self.launcher == "local":  # an ssh launcher's pid is the engine's pid on its own host
            for engine_set in self._ipp.engines.values():
                pids += [l.pid for l in getattr(engine_set, "launchers", {}).values() if getattr(l, "pid", None)]
        pids += [proc.pid for _, proc in self._launcher_processes()]
        pids += self._controller_children()
        self.family = sorted(set(pids))  # everything we started, even what a dead controller leaves behind
        self.reaper = spawn(self.family)

    def _controller_children(self) -> list:
        """The controller's own processes (its schedulers): orphaned, not stopped, if it is killed."""
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.pids["controller"]).children(recursive=True)]
        except (psutil.Error, TypeError, ValueError):
            return []

    def _kill_family(self) -> None:
        """Whatever we started that is still alive after a stop (e.g. a killed controller's schedulers)."""
        import psutil

        from .reaper import reap

        procs = []
        for pid in getattr(self, "family", []):
            try:
                proc = psutil.Process(pid)
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    procs.append(proc)
            except psutil.Error:
                pass
        if procs:
            reap(procs)

    def reform(self) -> None:
        """Form a fresh process group (new port, or the pinned --master-port) on every rank, after a failure."""
        if self.spec.master_port is not None:
            # the same port again: every rank must have left the old group (rank 0 closing the old
            # store) before any rank joins the new one, or a rank could reach the old store
            self.wait_all(self.apply_all(calls.release), timeout=self.spec.timeout,
                          what="leaving the old process group")
            if self.placement[0]["local"]:
                check_port_free(self.spec.master_port, self.master_addr, wait=5.0)
        self.master_port = self.spec.master_port or self._free_port()
        ars = [self.apply(r, calls.reform, self.master_addr, self.master_port)
               for r in range(self.world_size)]
        self.wait_all(ars, timeout=self.spec.timeout + 30, what="re-forming the process group")

    def stop(self) -> None:
        """Stop engines (cleanly leaving the process group), the controller and the client."""
        if self.client is not None:
            try:  # live registered engines leave the group and exit at once; ipyparallel stops the rest
                ids = [e for e in (self.engine_ids or self.client.ids) if e in self.client.ids]
                if ids and self.remote:  # leave the group; the launcher stops them (ssh kill, scancel, ...)
                    ar = _send(self.client[ids], calls.leave)
                    ar.wait(min(5.0, self.spec.timeout))
                elif ids:
                    _send(self.client[ids], calls.shutdown)
                    time.sleep(0.2)
            except Exception:
                pass
        try:
            if self._ipp is not None:
                try:
                    self._ipp.stop_cluster_sync()
                except Exception:
                    pass
                try:  # ipyparallel leaves it behind when a stop fails (an unreachable host)
                    os.remove(self._ipp.cluster_file)
                except OSError:
                    pass
            if self.client is not None:
                try:
                    self.client.close()
                except Exception:
                    pass
        finally:  # even when interrupted: this machine's processes are ended, the cluster is forgotten
            self.client, self._ipp = None, None
            self._kill_family()
        self._stop_reaper()

    def _stop_reaper(self) -> None:
        reaper = getattr(self, "reaper", None)
        if reaper is not None:
            try:
                reaper.wait(timeout=2)  # it exits once everything it watched is gone
            except Exception:
                reaper.kill()
                reaper.wait()
            self.reaper = None

    # mapping ------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.engine_ids)

    def host_of(self, rank: int) -> str:
        """How messages name ``rank``'s host (known from placement before the group forms)."""
        if rank < len(self.ranks):
            return self.ranks[rank]["host"]
        places = getattr(self, "placement", None) or []
        return places[rank]["node"] if rank < len(places) else ""

    @property
    def pids(self) -> dict:
        """Process ids this cluster started: {'controller': pid, 'engines': [pid per rank]}."""
        ctrl = getattr(getattr(self._ipp, "controller", None), "pid", None)
        return {"controller": ctrl, "engines": [r["pid"] for r in self.ranks]}

    def is_local(self, rank: int) -> bool:
        """Whether ``rank``'s engine runs on this machine (its pid can be signalled and watched here)."""
        return rank < len(self.ranks) and self.ranks[rank].get("local", True)

    def signal(self, signum: int, ranks=None) -> None:
        """Send ``signum`` to the engine processes of ``ranks`` (default all).

        An engine on another host gets it through its ipyparallel nanny (a control message).
        """
        for rank in range(self.world_size) if ranks is None else ranks:
            try:
                if self.is_local(rank):
                    os.kill(self.ranks[rank]["pid"], signum)
                elif self.client is not None:
                    self.client.send_signal(int(signum), targets=[self.engine_ids[rank]], block=False)
            except (ProcessLookupError, IndexError, KeyError):
                pass
            except Exception:  # the engine (or its host) is gone: the cell reports it as dead
                pass

    # calls --------------------------------------------------------------
    def describe(self, rank: int) -> str:
        """``rank R (engine E, pid P)`` (``... on HOST`` over several hosts): how messages name a rank's engine."""
        eid = self.engine_ids[rank] if rank < len(self.engine_ids) else "?"
        pid = self.ranks[rank]["pid"] if rank < len(self.ranks) else "?"
        where = f" on {self.ranks[rank]['host']}" if rank < len(self.ranks) and getattr(self, "num_nodes", 1) > 1 \
            else ""
        return f"rank {rank} (engine {eid}, pid {pid}{where})"

    def exit_status(self, rank: int, wait: float = 0.5):
        """The exit status of ``rank``'s engine once it has exited, else None.

        An int: the exit code, or minus the signal number if a signal killed it (None too
        when the process is gone but its status could not be learnt within ``wait`` s).
        """
        pid = self.ranks[rank]["pid"]
        proc = self._procs.get(pid)
        deadline = time.monotonic() + wait
        while proc is not None:
            if proc.exit_status is not None:
                return proc.exit_status
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)  # ipyparallel's wait thread reaps it within microseconds of its exit
        return None

    def dead_ranks(self) -> dict:
        """{rank: how it died} for ranks whose engine process has exited (``killed by SIGKILL``, ...)."""
        dead = {}
        ids = set(self.client.ids) if self.client is not None else set()
        for rank, info in enumerate(self.ranks):
            if not info.get("local", True):  # another host: the controller's heartbeat is what we know
                if self.engine_ids[rank] not in ids:
                    dead[rank] = (f"stopped answering the controller's heartbeat (the engine exited, or host "
                                  f"{info['host']} or its network is down)")
                continue
            proc = self._procs.get(info["pid"])
            if proc is None or proc.exit_status is None:
                try:
                    if psutil.Process(info["pid"]).status() != psutil.STATUS_ZOMBIE:
                        continue
                except psutil.NoSuchProcess:
                    pass
            dead[rank] = exit_description(self.exit_status(rank))
        return dead

    def death_message(self, rank: int, how: str) -> str:
        """``rank 1 (engine 1, pid N) died: killed by SIGKILL``."""
        return f"{self.describe(rank)} died: {how}"

    def check_alive(self, ranks=None) -> None:
        """Raise ClusterError naming every dead rank (with how it died) and the fix."""
        dead = self.dead_ranks()
        dead = {r: d for r, d in dead.items() if ranks is None or r in ranks}
        if dead:
            what = "; ".join(self.death_message(r, d) for r, d in sorted(dead.items()))
            raise ClusterError(f"{what}. Run %dist restart (or session.restart()) for a fresh world of "
                               f"{self.world_size} ranks")

    def apply(self, rank: int, fn: RankFunction, *args):
        """Call the rank function ``fn(*args)`` (a :mod:`distnb.calls` entry) on ``rank``; an AsyncResult.

        Raises ClusterError if the cluster is stopped or that rank's engine has died, TypeError
        if ``args`` do not fit ``fn``'s signature.
        """
        if self.client is None:
            raise ClusterError("the cluster is not running; start it with %dist start")
        engine_id = self.engine_ids[rank]
        proc = self._procs.get(self.ranks[rank]["pid"]) if rank < len(self.ranks) else None
        if engine_id not in self.client.ids or (proc is not None and proc.exit_status is not None):
            self.check_alive([rank])
            raise ClusterError(f"{self.describe(rank)} is no longer registered with the controller; "
                               "run %dist restart")
        return _send(self.client[engine_id], fn, *args)

    def apply_all(self, fn: RankFunction, *args):
        """``fn(*args)`` on every rank: one AsyncResult per rank, in rank order."""
        return [self.apply(r, fn, *args) for r in range(self.world_size)]

    def wait_all(self, ars, timeout: float, what: str):
        """Results of ``ars`` (one per rank, in rank order); a RankError names failing ranks."""
        deadline = time.monotonic() + timeout
        for ar in ars:
            ar.wait(max(0.0, deadline - time.monotonic()))
        if not all(ar.ready() for ar in ars):
            late = [r for r, ar in enumerate(ars) if not ar.ready()]
            raise ClusterError(f"ranks {late} did not finish {what} within {timeout:.0f} s")
        failures = self.failures(ars)
        if failures:
            raise RankError(failures, context=what)
        return [ar.get() for ar in ars]

    def failures(self, ars, progress=None, collateral=()) -> list:
        """Failed results of ``ars`` (rank order) as RankError failure dicts, root cause first.

        ``collateral`` are ranks distnb itself interrupted; they sort after the others.
        """
        out = []
        for rank, ar in enumerate(ars):
            if not ar.ready():
                continue
            try:
                ar.get(0)
            except ipp.error.RemoteError as exc:
                f = dict(rank=rank, engine_id=self.engine_ids[rank], host=self.host_of(rank), ename=exc.ename,
                         evalue=exc.evalue, traceback=_clean_tb(exc.traceback))
                msg = (progress or {}).get(rank) or {}
                f.update(epoch=msg.get("epoch"), step=msg.get("step"), failed_at=msg.get("failed_at"))
                out.append(f)
            except Exception as exc:  # engine died, aborted, ...
                out.append(dict(rank=rank, engine_id=self.engine_ids[rank], host=self.host_of(rank),
                                ename=type(exc).__name__, evalue=str(exc), traceback=""))
        for f in out:
            f["collateral"] = bool(f["rank"] in collateral or _collateral(f))
        out.sort(key=lambda f: (f["collateral"], f.get("failed_at") or float("inf"),
                                f["rank"]))
        return out


def _gpu_for(gpus: list, local_rank: int):
    """The GPU of local rank ``local_rank`` among the ``gpus`` its engine sees, or None.

    The ``local_rank``-th; or the only one, when the launcher gave each engine its own GPU
    (Slurm's ``--gpus-per-task=1`` sets CUDA_VISIBLE_DEVICES per task).
    """
    if len(gpus) > local_rank:
        return gpus[local_rank]
    return gpus[0] if len(gpus) == 1 else None


def _collateral(f) -> int:
    """1 when a failure looks like a consequence of another rank's (a closed gloo connection)."""
    text = f"{f.get('evalue')}"
    markers = ("Connection closed by peer", "Connection reset", "process group is broken", "Broken pipe",
               "waiting for clients")  # rank 0's store gave up on ranks that could not reach it
    return any(m in text for m in markers)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_OWN_FRAMES = (os.sep + "ipyparallel" + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep, "File <string>")


def _clean_tb(tb: str) -> str:
    """The remote traceback as plain text, without ipyparallel's and distnb's own frames.

    IPython formats remote tracebacks as blocks ("File PATH:LINE, in FUNC" plus context
    lines) separated by blank lines; the user's cell frames (``<distrain-cell-N>``), library
    frames (torch, ...) and the exception itself are kept.
    """
    keep = []
    for block in _ANSI.sub("", tb or "").split("\n\n"):
        lines = block.split("\n")
        for i, line in enumerate(lines):
            if line.startswith("File ") and any(m in line for m in _OWN_FRAMES):
                lines = lines[:i]  # an own frame: drop it, keep a header above it
                break
        if any(line.strip() for line in lines):
            keep.append("\n".join(lines))
    return "\n\n".join(keep).strip("\n")
