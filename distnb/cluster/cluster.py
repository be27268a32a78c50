"""ipyparallel cluster lifecycle and the one place that maps engine_id <-> rank.

The controller listens on 127.0.0.1 and its heartbeat period is shortened (the
default 3 s heartbeat made a plain ``ipyparallel.Cluster`` start take ~6.6 s here;
FIELD-NOTES pitfall 2). Local CPU engines and their controller are forked from the kernel's
engine template (:mod:`distnb.cluster.zygote`), others start as fresh processes (ipyparallel's
launchers as distnb adjusts them: :mod:`distnb.cluster.launchers`). Engines are ranked by ascending
engine id (or by placement over hosts, :mod:`distnb.cluster.placement`). Each engine gets its rank's
environment, device and thread count (:func:`distnb.engine.process.runtime.setup`); a GPU engine
before torch is imported on it. What ``%dist start`` picks when not told (engine count,
backend, device, threads) is :func:`distnb.cluster.defaults.default_spec`.

Security: with engines on this machine every socket the cluster listens on is bound to
127.0.0.1 (the controller's ``--ip``; the torch.distributed store and gloo's pair sockets, see
:func:`distnb.engine.process.runtime._init_group`); with engines on other hosts (ssh, batch, mpi with
hosts, :mod:`distnb.cluster.placement`) the controller listens on one address those hosts reach and
rank 0's store on its own such address, never on every interface; ipyparallel's HMAC-SHA256 message signing
stays on (the connection files carry a key) and every file in the profile's
``security`` folder is readable by the owner only (mode 0600).

A Slurm job's engines are awaited while the job queues (squeue's reason said in the cell,
:class:`distnb.cluster.slurm.QueueWatch`); sbatch's refusals name the option (:func:`distnb.cluster.slurm.submit_error`).

Engine deaths are reported with how the process ended (``killed by SIGKILL``,
``exited with status 1``, :func:`distnb.cluster.launchers.exit_description`; for a Slurm job, what Slurm
did: its time limit, a node down, :func:`distnb.cluster.slurm.why_gone`); failed ranks as
:class:`~distnb.core.errors.RankError` with their tracebacks cleaned (:mod:`distnb.core.tracebacks`).
"""

from __future__ import annotations

import logging
import os
import time

import ipyparallel as ipp
import psutil
from ipyparallel.serialize import PrePickled

from distnb.cluster import cpuload, fanout, hub, launchers, lease, placement, slurm, zygote
from distnb.cluster.engines import Engines
from distnb.cluster.reaper import reap, spawn
from distnb.core import calls, tracebacks
from distnb.core.calls import RankFunction
from distnb.core.errors import ClusterError, Interrupted, PlanError, RankError
from distnb.core.net import check_port_free, free_port, is_loopback, visible_gpus
from distnb.core.plan import BATCH_LAUNCHERS, ClusterSpec

HEARTBEAT_MS = 100
HEARTBEAT_MISSES = 25  # an engine is dropped after 2.5 s without a heartbeat
#: The controller keeps no record of each call and result (its in-memory DictDB: distnb never asks the hub
#: for a past result) and logs no INFO line for each request and reply: two log lines and a database record per
#: engine and call, which cost the controller's one Python thread about a third of its time for a cell on
#: every rank (issue 20; benchmarks/README.md).
CONTROLLER_QUIET = ("--IPController.db_class=NoDB", "--log-level=WARN")
#: Seconds engines started by a batch system (slurm, ...) may take to register: the job may queue.
BATCH_QUEUE_WAIT = 600.0
# ipyparallel logs each dead engine's whole output; distnb reports deaths itself (naming the rank).
_log = logging.getLogger("distnb.ipyparallel")
_log.setLevel(logging.ERROR)
_log.propagate = False
_log.addHandler(logging.NullHandler())


@ipp.interactive
def _shim(module, fn, with_ns, *args):
    # Runs on an engine (see distnb.core.calls). @interactive makes globals() the engine's user namespace.
    import importlib

    f = getattr(importlib.import_module(module), fn)
    return f(globals(), *args) if with_ns else f(*args)


def _send(view, fn: RankFunction, *args):
    """``fn(*args)`` on the engine(s) of ``view``, the arguments checked against its signature first."""
    fn.check(args)
    return view.apply_async(*_packed(fn, args))


_SHIM = []  # [_shim pickled once] (ipyparallel's PrePickled), made on first use


def _packed(fn: RankFunction, args: tuple) -> tuple:
    """``(shim, *arguments)`` for ``apply_async``, each serialized once (ipyparallel's ``PrePickled``).

    A call sent to every rank is then pickled once, not once per engine: ipyparallel serializes
    a function and its arguments in every ``apply_async`` (the shim's code object alone is
    about 0.1 ms), and a ``%%dist`` cell is one ``apply_async`` per engine (issue 20).
    Zero-copy buffers stay zero-copy: ``PrePickled`` keeps the extracted buffers, which each
    send references.
    """
    if not _SHIM:
        shim = PrePickled(_shim)
        shim.__name__ = _shim.__name__  # how ipyparallel names the call (AsyncResult's repr)
        _SHIM.append(shim)
    return (_SHIM[0], *(PrePickled(a) for a in (fn.module, fn.name, fn.with_ns, *args)))


class Cluster(Engines):
    """A started ipyparallel cluster whose engines form one torch.distributed process group.

    Engines are added and removed while it runs (``%dist scale``) through the methods of
    :class:`distnb.cluster.engines.Engines`.

    Parameters
    ----------
    spec : ClusterSpec

    Attributes
    ----------
    ranks : list of dict
        Per rank: rank, engine_id, pid, host, device, backend, num_threads.
    """

    def __init__(self, spec: ClusterSpec, auto_device: bool = False, say=None):
        self.spec = spec
        self.say = say  # prints a line into the cell while starting (a queued batch job), or None
        self.job_id = None  # the batch job of the engines (slurm), once submitted
        self._gone_note = (None, "", 0.0)  # (dead ranks, what Slurm said about them, when)
        self.auto_device = auto_device  # remote engines: pick cuda/nccl or cpu/gloo from what their hosts have
        self._ipp = None
        self.client = None
        self.engine_ids: list[int] = []  # index = rank
        self.ranks: list[dict] = []
        self.master_port, self.generation = None, 0  # generation: the re-forms so far (the group's key prefix)
        self.start_seconds = None
        self.num_nodes = 1
        self.remote = False
        self._procs: dict = {}  # engine pid -> _Process (its exit status once it died)
        self._views: dict = {}  # engine_id -> its DirectView of self.client, made once (see _view)
        self._gone_ids: set = set()  # engines stopped or lost: never ranked again (their ids stay registered a while)
        # where %dist scale may add engines: the hosts and per-host slots %dist start was given (the spec
        # follows the live world)
        self.start_hosts, self.host_slots = tuple(spec.hosts), spec.engines_per_node
        self.note = ""  # what the start wants the user to know (e.g. why engines were not forked)
        self.foreign_cores = 0.0  # cores other processes used during the start (--cpu-bind auto)

    # lifecycle -----------------------------------------------------------
    def start(self, engine_timeout: float = 60.0) -> "Cluster":
        """Start controller and engines, then form the process group. Raises ClusterError.

        Engines start through ipyparallel's launcher ``spec.launcher`` (distnb's fast local
        launcher for ``local``, :mod:`distnb.cluster.launchers`); see :mod:`distnb.cluster.placement`.
        """
        t0 = time.perf_counter()
        cpuload.mark()  # --cpu-bind auto: other processes' load is measured over the start
        spec = self.spec
        profile_kwargs, profile = placement.profile_config(spec.profile)
        self.launcher = placement.launcher_name(spec, profile)
        self.remote = placement.engines_remote(self.launcher, spec.hosts)
        placement.check_launcher_tools(self.launcher, profile)
        placement.check_addresses(spec, self.remote)
        # Slurm's nodes reach slurmctld: the controller listens on this host's address toward it, by default
        try:
            toward = slurm.controller_address() if self.launcher == "slurm" and not spec.interface else None
        except slurm.SubmitError as exc:  # no slurmctld to submit to
            raise ClusterError(slurm.submit_error(exc, spec)) from None
        refused = slurm.check_request(spec) if self.launcher == "slurm" else ""
        if refused:  # a job that could never start is not submitted
            raise ClusterError(f"{refused}; no job was submitted")
        self.controller_ip = profile.get("Cluster", {}).get("controller_ip") or placement.controller_ip(
            spec, self.remote, toward)
        # thread count fixed before torch loads; CPU engines preload DDP too (GPU ones wait for their device)
        env = {"OMP_NUM_THREADS": str(spec.num_threads),
               "DISTNB_PRELOAD": "all" if spec.device_type == "cpu" and not self.remote else "torch"}
        env.update({k: v for k, v in launchers.ENGINE_ENV.items() if k not in os.environ})
        try:
            self._ipp = self._new_ipp(env, profile, profile_kwargs, engine_timeout)  # an interrupt here too: one line
            # local CPU engines are forked from the kernel's engine template (imports done once; distnb.cluster.zygote)
            if self.launcher == "local" and spec.device_type == "cpu":
                self._ipp._distnb_zygote = self._template({**os.environ, **env})
            self._ipp.start_cluster_sync(spec.num_engines)
            self.job_id = launchers.batch_job_id(self._ipp)
            launchers._restrict_security_files(self._ipp.profile_dir)
            self._procs.update(launchers.engine_processes(self._ipp))
            self.client = launchers.connect_client(self._ipp)  # without ipyparallel's %px magics in the notebook
            # engines register within engine_timeout; a batch job may first wait in the queue
            self._wait_for_engines(max(engine_timeout, spec.timeout,
                                       BATCH_QUEUE_WAIT if self.launcher in BATCH_LAUNCHERS else 0))
            self._place()
            self._setup_ranks()
        except BaseException as exc:
            where = launchers.failed_ssh_host(self._ipp, self.spec.hosts) if self.launcher == "ssh" else ""
            started = launchers.stopped_so_far(self._ipp)  # "stopped the 2 engines ...", before the stop forgets them
            self.stop()
            if isinstance(exc, KeyboardInterrupt) or isinstance(exc.__context__, KeyboardInterrupt):  # Ctrl-C
                raise Interrupted(f"%dist start interrupted: {started}") from None
            if isinstance(exc, (ClusterError, PlanError)):
                raise
            if isinstance(exc, slurm.SubmitError):
                raise ClusterError(slurm.submit_error(exc, spec)) from None
            raise ClusterError(f"could not start {spec.num_engines} engines{where}: {exc}") from exc
        self.start_seconds = time.perf_counter() - t0
        return self

    def _new_ipp(self, env: dict, profile, profile_kwargs: dict, engine_timeout: float) -> ipp.Cluster:
        """The ``ipp.Cluster`` to start: distnb's local launchers, or ipyparallel's ``self.launcher`` configured."""
        spec = self.spec
        if self.launcher == "local":
            launch = dict(engine_launcher_class=launchers._EngineSetLauncher,
                          controller_launcher_class=launchers._ControllerLauncher,
                          delay=0, send_engines_connection_env=False)  # engines start with the controller
        else:
            launch = dict(config=placement.launcher_config(spec, self.launcher, profile, env))
            if spec.launcher is not None:  # else the profile's own launcher class, whatever it is
                launch["engine_launcher_class"] = launchers.LAUNCHER_CLASSES.get(self.launcher, self.launcher)
        cluster = ipp.Cluster(
            n=spec.num_engines,
            controller_ip=self.controller_ip,
            controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}",
                             f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}", *CONTROLLER_QUIET,
                             *launchers.scheduler_args(spec.num_engines, self.launcher)],
            log=_log,
            engine_timeout=int(engine_timeout),
            shutdown_atexit=False,  # distnb stops it (session atexit, the reaper); ipyparallel's retries hang
            **launch,
            **profile_kwargs,
        )
        cluster._distnb_engine_env = env  # read by the launchers (distnb.cluster.launchers)
        cluster._distnb_zygote = None
        return cluster

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
        queue = None  # a Slurm job may wait in the queue: say why, and stop waiting once it ended
        if self.launcher == "slurm" and self.job_id:
            queue = slurm.QueueWatch(self.job_id, self.say, launchers.batch_output_file(self._ipp))
        while True:
            try:
                self.client.wait_for_engines(n, timeout=min(1.0, max(0.0, deadline - time.monotonic())),
                                             interactive=False)
                return
            except TimeoutError:  # perhaps registered, but never announced to the client
                launchers.refresh_engines(self.client)
            launchers.check_launcher_alive(self._ipp, self.launcher)
            if queue is not None and len(self.client.ids) < n:
                queue.check()
            if time.monotonic() >= deadline:
                break
        got = sorted(self.client.ids)
        missing = placement.missing_hosts(self.spec.hosts, self._whereami(got) if got else {})
        url = f"{self.controller_ip}:{launchers.registration_port(self._ipp)}"
        hosts = f"; none from {', '.join(missing)}" if missing else ""
        if queue is not None and queue.last:  # never left the queue
            raise ClusterError(f"{queue.summary()} after {timeout:.0f} s: cancelled (a longer --timeout waits longer)")
        raise ClusterError(
            f"only {len(got)} of {n} engines registered with the controller at {url} within {timeout:.0f} s"
            f"{hosts}. Check that every host can reach {self.controller_ip} (routes, firewall) and start engines "
            f"({self.launcher} launcher); on several networks pick one with %dist start --interface NAME")

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
        if self.remote:  # threads from each host's cores; the device from its GPUs
            self.spec = placement.fit_to_hosts(self.placement, self.where, spec, self.auto_device)

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
        """A port free on rank 0's host (asked there when rank 0 is on another host); a ClusterError naming
        ``--master-addr`` when rank 0 cannot listen on that address."""
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
        local_gpus = None if self.remote or spec.device_type != "cuda" else visible_gpus()
        gpus = placement.rank_gpus(self.placement, self.where, spec.device_type, local_gpus)
        placement.check_gpus(self.placement, self.where, gpus, spec.backend)  # before any rank waits for the group
        self.foreign_cores = cpuload.foreign_cores() if (spec.cpu_bind, spec.device_type) == ("auto", "cpu") else 0.0
        among = placement.bind_among(self.placement, spec, self.foreign_cores)
        local_sizes = placement.local_world_sizes(self.placement)
        ars = [self.apply(rank, calls.setup, rank, spec.num_engines, p["local_rank"], spec.backend, spec.device_type,
                          gpu, p.get("num_threads", spec.num_threads), self.master_addr, self.master_port, spec.timeout,
                          p["node_rank"], p["node"], spec.interface, among[rank], local_sizes[rank])
               for rank, (p, gpu) in enumerate(zip(self.placement, gpus))]
        infos = self.wait_all(ars, timeout=spec.timeout + 60, what="forming the process group")
        self.ranks = [dict(info, engine_id=p["engine_id"], local=p["local"], address=self.where[p["engine_id"]][
            "address"]) for info, p in zip(infos, self.placement)]
        self.apply_all(calls.warm_up)  # queued, not awaited
        self._start_reaper()

    def _start_reaper(self):
        """No process outlives the kernel: a watchdog stops ours if the kernel dies."""
        pids = [p for p in [self.pids["controller"], *(r["pid"] for r in self.ranks if r.get("local", True))] if p]
        pids += launchers.started_pids(self._ipp, self.launcher)
        self.family = sorted(set(pids))  # everything we started, even what a dead controller leaves behind
        self.reaper = spawn(self.family, **lease.keeper_args(self))  # the world's lease keeper (distnb.cluster.keeper)

    def _kill_family(self, controller=None) -> None:
        """Whatever we started that is still alive after a stop (e.g. a killed controller's schedulers, also
        those it forked after the stop began: they are in the process group of ``controller``, its pid)."""
        procs = launchers.controller_group(controller) if controller else []
        for pid in getattr(self, "family", []):
            try:
                proc = psutil.Process(pid)
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    procs.append(proc)
            except (psutil.Error, ValueError):  # gone, or the -1 of a launcher interrupted before it had a pid
                pass
        if procs:
            reap(procs)

    def reform(self) -> None:
        """A fresh process group on every rank after a failure, on the same port (a pinned one: a new store)."""
        if self.spec.master_port is not None:
            # the same port again: every rank must have left the old group (rank 0 closing the old
            # store) before any rank joins the new one, or a rank could reach the old store
            self.wait_all(self.apply_all(calls.release, True), timeout=self.spec.timeout,
                          what="leaving the old process group")
            if self.placement[0]["local"]:
                check_port_free(self.spec.master_port, self.master_addr, wait=5.0)
        self.generation += 1
        ars = [self.apply(r, calls.reform, self.master_addr, self.master_port, self.generation)
               for r in range(self.world_size)]
        self.wait_all(ars, timeout=self.spec.timeout + 30, what="re-forming the process group")

    def stop(self) -> None:
        """Stop engines (cleanly leaving the process group), the controller and the client."""
        controller = self.pids["controller"] if self._ipp is not None else None
        if self._ipp is not None and not getattr(self, "family", None):  # a start that failed before the reaper:
            self.family = [p for p in [self.pids["controller"], *launchers.started_pids(self._ipp, self.launcher)]
                           if p]  # the controller's own processes, found while it still runs
        try:  # an interrupt anywhere in here still ends this machine's processes (the finally)
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
            if self._ipp is not None:
                try:
                    self._ipp.stop_cluster_sync()
                except Exception:
                    pass
                launchers.remove_cluster_files(self._ipp)
            if self.client is not None:
                try:
                    self.client.close()
                except Exception:
                    pass
        finally:  # even when interrupted: this machine's processes are ended, the cluster is forgotten
            self.client, self._ipp, self._views = None, None, {}
            self._kill_family(controller)
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
            dead[rank] = launchers.exit_description(self.exit_status(rank))
        return self._slurm_says(dead)

    def _slurm_says(self, dead: dict) -> dict:
        """``dead`` with what Slurm did to the engines' job or nodes (time limit, node down) added to remote deaths.

        Slurm is asked once for each set of dead ranks (the liveness check runs every second).
        """
        remote = sorted(r for r in dead if not self.ranks[r].get("local", True))
        if getattr(self, "launcher", None) != "slurm" or not self.job_id or not remote:
            return dead
        known, note, when = self._gone_note
        if known != remote or (not note and time.monotonic() - when > 1.0):
            hosts = [info["host"] for info in self.ranks]  # a node that is down stops every rank of the job
            note = slurm.why_gone(self.job_id, self.spec.time_limit, hosts)
            self._gone_note = (remote, note, time.monotonic())
        return {r: f"{how}; {note}" if note and r in remote else how for r, how in dead.items()}

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
        """Call the rank function ``fn(*args)`` (a :mod:`distnb.core.calls` entry) on ``rank``; an AsyncResult.

        Raises ClusterError if the cluster is stopped or that rank's engine has died, TypeError
        if ``args`` do not fit ``fn``'s signature.
        """
        self.check_sendable([rank])
        return _send(self._view(self.engine_ids[rank]), fn, *args)

    def check_sendable(self, ranks=None) -> None:
        """ClusterError unless the cluster runs and every engine of ``ranks`` (default: all) is alive and registered."""
        if self.client is None:
            raise ClusterError("the cluster is not running; start it with %dist start")
        hub.check_controller(self)  # a dead controller: any call would wait forever
        for rank in range(self.world_size) if ranks is None else ranks:
            proc = self._procs.get(self.ranks[rank]["pid"]) if rank < len(self.ranks) else None
            if self.engine_ids[rank] not in self.client.ids or (proc is not None and proc.exit_status is not None):
                self.check_alive(ranks)  # every dead one of them named, with how it died
                raise ClusterError(f"{self.describe(rank)} is no longer registered with the controller; run %dist restart")

    def _view(self, engine_id: int):
        """The DirectView of one engine, made once per client (``client[i]`` builds a new view at each call)."""
        view = self._views.get(engine_id)
        if view is None or view.client is not self.client:
            view = self._views[engine_id] = self.client[engine_id]
        return view

    def apply_all(self, fn: RankFunction, *args):
        """``fn(*args)`` on every rank: one AsyncResult per rank, in rank order. Checked and serialized once
        (:func:`_packed`), one message per engine, all handed to the client's I/O thread at once
        (:func:`distnb.cluster.fanout.apply_each`); ipyparallel's broadcast view was slower at 32 ranks (issue 20)."""
        fn.check(args)
        self.check_sendable()
        packed = _packed(fn, args)
        return fanout.apply_each(self.client, self.engine_ids, packed[0], packed[1:])

    def wait_all(self, ars, timeout: float, what: str, ranks=None):
        """Results of ``ars`` (one per rank; ``ranks``: theirs, default 0, 1, ...); a RankError names failing ranks."""
        deadline = time.monotonic() + timeout
        for ar in ars:
            ar.wait(max(0.0, deadline - time.monotonic()))
        ranks = list(range(len(ars))) if ranks is None else list(ranks)
        if not all(ar.ready() for ar in ars):
            late = [r for r, ar in zip(ranks, ars) if not ar.ready()]
            raise ClusterError(f"{tracebacks.ranks_named(late)} did not finish {what} within {timeout:.0f} s")
        failures = self.failures(ars, ranks=ranks)
        if failures:
            raise RankError(failures, context=what)
        return [ar.get() for ar in ars]

    def failures(self, ars, progress=None, collateral=(), ranks=None) -> list:
        """Failed results of ``ars`` (in order; ``ranks``: theirs) as RankError failure dicts, root cause first.

        ``collateral`` are ranks distnb itself interrupted; they sort after the others.
        """
        out = []
        for rank, ar in zip(range(len(ars)) if ranks is None else ranks, ars):
            if not ar.ready():
                continue
            try:
                ar.get(0)
            except ipp.error.RemoteError as exc:
                f = dict(rank=rank, engine_id=self.engine_ids[rank], host=self.host_of(rank),
                         **tracebacks.remote_error(exc))
                msg = (progress or {}).get(rank) or {}
                f.update(epoch=msg.get("epoch"), step=msg.get("step"), failed_at=msg.get("failed_at"))
                out.append(f)
            except Exception as exc:  # engine died, aborted, ...
                out.append(dict(rank=rank, engine_id=self.engine_ids[rank], host=self.host_of(rank),
                                ename=type(exc).__name__, evalue=str(exc), traceback=""))
        return tracebacks.order_failures(out, collateral)
