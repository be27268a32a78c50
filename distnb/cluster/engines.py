"""Engines added to and removed from a running cluster: what ``%dist scale`` and ``--on-failure shrink`` use.

:class:`Engines` is a base class of :class:`distnb.cluster.cluster.Cluster`; each public method does one
job, so :mod:`distnb.elastic.scaling` and :mod:`distnb.elastic.shrinking` never touch the cluster's launchers,
processes or engine ids themselves:

- :meth:`~Engines.check_resizable`: a PlanError, before anything changes, when this launcher
  cannot place the new world (mpiexec and batch jobs never can);
- :meth:`~Engines.add_engines`: start engines and wait until they registered (not ranks yet);
- :meth:`~Engines.add_ranks`: rank them after the running ranks;
- :meth:`~Engines.form_group`: the process group at the new size;
- :meth:`~Engines.remove_ranks` / :meth:`~Engines.stop_engines`: stop engines and wait until
  their processes are gone;
- :meth:`~Engines.snapshot` / :meth:`~Engines.restore`: the ranks as they were, after a failed grow;
- :meth:`~Engines.rewatch`: the reaper watching what runs now.

Local engines are a new ipyparallel engine set (forked from the engine template, as ``%dist
start``'s are) and are stopped by pid. With the ssh launcher the new engine set's ``engines``
names the hosts that get them: one engine at a time to the host of ``--hosts`` that runs the
fewest (the first of them on a tie), each host at most ``--engines-per-node`` engines, else 16
per core (CPU) or one per GPU (:func:`distnb.cluster.placement.spread`); they are ranked after the
running ones, wherever they run. An ssh engine is stopped on its host and its host is asked, over
ssh, until its process is gone (ipyparallel's ``ssh_waitpid``).

Idea: an ipyparallel engine set per growth step, as ``ipcluster engines`` adds engines to a
running controller; the placement rule is ``%dist start --hosts``'s (fill hosts evenly).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import signal
import time

from distnb.cluster import launchers, placement
from distnb.cluster.defaults import ENGINES_PER_CORE, cpu_cores, default_spec
from distnb.cluster.reaper import kill_after
from distnb.core import calls
from distnb.core.errors import ClusterError, PlanError
from distnb.core.net import check_port_free, visible_gpus
from distnb.core.plan import BATCH_LAUNCHERS

#: Launchers that can add engines to a running cluster.
GROWABLE = ("local", "ssh")
#: Seconds a removed engine may take to exit after its shutdown before it is killed.
EXIT_GRACE = 5.0


def _not_resizable(launcher: str, n: int) -> str:
    """Why ``%dist scale`` cannot resize a world this launcher started, and what to do instead."""
    restart = (f"use %dist restart -n {n} for a fresh world of {n} ranks (the notebook's model is then sent again "
               "with a fresh optimizer; %dist save first and %dist load after it to keep the optimizer and position)")
    if launcher == "mpi":
        return (f"%dist scale {n}: these engines are one mpiexec job (--launcher mpi), and an MPI world's size is "
                f"fixed when mpiexec starts it: no process can join it or leave it cleanly; {restart}")
    if launcher in BATCH_LAUNCHERS:
        return (f"%dist scale {n}: these engines run in one {launcher} batch job (--launcher {launcher}), whose "
                f"allocation (nodes and tasks) was fixed when the job started; {restart} (a new job, which may "
                "queue)")
    return (f"%dist scale {n}: the {launcher} launcher cannot add engines to a running cluster (the local and ssh "
            f"launchers can); {restart}")


class Engines:
    """Adding and removing the engines of a started cluster (a base class of :class:`distnb.cluster.cluster.Cluster`)."""

    # what the cluster may be asked ------------------------------------------------------
    def check_resizable(self, n: int) -> None:
        """A PlanError unless this cluster's launcher can take the world from its size to ``n`` ranks.

        Nothing changes. ``n`` is checked as ``%dist start -n`` checks it (local engines: 16 per
        core, one per GPU); on ssh hosts the added engines must fit (:meth:`ssh_growth`).

        Raises
        ------
        PlanError
            mpi and batch launchers (why, and ``%dist restart -n N``), or no room for ``n`` ranks.
        """
        if self.launcher not in GROWABLE:
            raise PlanError(_not_resizable(self.launcher, n))
        if self.launcher == "ssh":
            if n > self.world_size:
                self.ssh_growth(n - self.world_size)
            return
        try:
            default_spec(n=n, backend=self.spec.backend, timeout=self.spec.timeout)
        except ClusterError as exc:
            raise PlanError(f"%dist scale {n}: {exc}") from None
        except PlanError as exc:
            raise PlanError(f"%dist scale {n}: {str(exc).replace('-n ', 'N = ')}") from None

    def ssh_hosts(self) -> tuple:
        """The hosts this ssh cluster may start engines on: ``%dist start --hosts``, else the profile's ``engines`` keys."""
        if self.start_hosts:
            return self.start_hosts
        for engine_set in getattr(self._ipp, "engines", {}).values():
            if getattr(engine_set, "engines", None):
                return tuple(engine_set.engines)
        return ()

    def ssh_growth(self, k: int) -> dict:
        """{host: engines to start} for ``k`` more engines over :meth:`ssh_hosts` (:func:`placement.spread`).

        Raises PlanError when the hosts have no room for ``k`` more.
        """
        hosts = self.ssh_hosts()
        counts = placement.host_counts(hosts, [self.where[e] for e in self.engine_ids])
        slots = self.host_slots
        if slots is None and not self.start_hosts:  # the profile's engines = {host: n}
            engine_set = next(iter(getattr(self._ipp, "engines", {}).values()), None)
            slots = None if engine_set is None else dict(getattr(engine_set, "engines", {}))
        caps = placement.host_caps(hosts, list(self.where.values()), self.spec.device_type, slots, ENGINES_PER_CORE)
        return placement.spread(hosts, counts, caps, k, self.world_size + k)

    # adding ----------------------------------------------------------------------------
    def add_engines(self, k: int) -> list:
        """Start ``k`` engines and wait until they registered with the controller; their engine ids.

        They are not ranks yet (:meth:`add_ranks`); ``self.where`` describes them. Local engines
        are forked from the engine template like ``%dist start``'s; ssh engines start on the hosts
        :meth:`ssh_growth` picks.

        Returns
        -------
        list of int
            The new engines' ids, ascending.

        Raises
        ------
        ClusterError
            An engine did not start (naming its host, over ssh) or register within
            ``max(60, --timeout)`` s; what this call started is stopped first.
        """
        hosts = self.ssh_growth(k) if self.launcher == "ssh" else None
        known = set(self.client.ids) | set(self.engine_ids) | self._gone_ids
        sets_before, pids_before = set(self._ipp.engines), set(self._procs)
        set_id, new_pids = None, []
        try:
            try:
                self._ipp.start_engines_sync(k, **({} if hosts is None else {"engines": hosts}))
            finally:
                set_id = next(iter(set(self._ipp.engines) - sets_before), None)
            self._procs.update(launchers.engine_processes(self._ipp))
            new_pids = [p for p in self._procs if p not in pids_before]
            new_ids = self._wait_registered(known, k, new_pids)
            where = self._whereami(new_ids)
        except BaseException as exc:
            on = launchers.failed_ssh_host(self._ipp, tuple(hosts), set_id) if hosts else ""
            self._stop_set(set_id, new_pids)
            if isinstance(exc, KeyboardInterrupt):
                raise
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ClusterError(f"could not start {k} more engine{'s' if k > 1 else ''}{on}: {why}") from None
        self.where = {e: w for e, w in self.where.items() if e in self.engine_ids}  # not engines gone before
        self.where.update(where)
        return new_ids

    def _wait_registered(self, known: set, k: int, pids: list) -> list:
        """The ids of ``k`` engines not in ``known``, once registered; ClusterError if one dies or time runs out."""
        wait = max(60.0, self.spec.timeout)
        deadline = time.monotonic() + wait
        while True:
            new = sorted(set(self.client.ids) - known)
            if len(new) >= k:
                return new[:k]
            for pid in pids:
                proc = self._procs.get(pid)
                if proc is not None and proc.exit_status is not None:
                    raise ClusterError(f"a new engine (pid {pid}) {launchers.exit_description(proc.exit_status)} "
                                       "before it registered with the controller")
            if time.monotonic() >= deadline:
                raise ClusterError(f"only {len(new)} of {k} new engines registered within {wait:.0f} s")
            time.sleep(0.05)

    def _stop_set(self, set_id, pids: list) -> None:
        """Stop the engine set ``set_id`` a failed :meth:`add_engines` started, and its local processes ``pids``."""
        if set_id is not None:
            engine_set = self._ipp.engines.get(set_id)
            for key, launcher in list(getattr(engine_set, "launchers", {}).items()):
                if launcher.state != "running":  # never started (its host unreachable): nothing to stop there
                    engine_set.launchers.pop(key, None)
            try:
                self._ipp.stop_engines_sync(set_id)
            except Exception:
                pass
        self._reap_local(pids)

    def add_ranks(self, engine_ids: list) -> None:
        """Rank the registered engines ``engine_ids`` after the running ranks (:func:`placement.extend_ranks`)."""
        self.placement = placement.extend_ranks(self.placement, self.where, engine_ids, self.ssh_hosts()
                                                if self.launcher == "ssh" else self.spec.hosts)
        self.engine_ids = [p["engine_id"] for p in self.placement]

    # removing --------------------------------------------------------------------------
    def remove_ranks(self, ranks) -> list:
        """Stop the engines of ``ranks`` (each leaves the group and exits) and drop them from the ranks.

        The other ranks keep their order and are numbered again from 0 (their local ranks too, per
        host); the group is not formed again (:meth:`form_group`). A rank whose engine already
        died is only dropped.

        Returns
        -------
        list of str
            The engines whose exit could not be confirmed (``engine E on HOST``); normally empty.
        """
        ranks = sorted(set(ranks))
        for rank in ranks:
            try:
                self.apply(rank, calls.shutdown)  # destroy_process_group, then os._exit(0)
            except ClusterError:
                pass  # already dead: nothing to ask
        left = self.stop_engines([self.engine_ids[r] for r in ranks])
        keep = [r for r in range(self.world_size) if r not in ranks]
        seen = {}
        places = []
        for r in keep:
            p = self.placement[r]
            seen[p["node"]] = seen.get(p["node"], -1) + 1
            # a GPU rank keeps its local rank: its engine's CUDA_VISIBLE_DEVICES and LOCAL_RANK name its GPU by it
            places.append(p if self.spec.device_type == "cuda" else dict(p, local_rank=seen[p["node"]]))
        self.placement, self.ranks = places, [self.ranks[r] for r in keep if r < len(self.ranks)]
        self.engine_ids = [p["engine_id"] for p in places]
        return left

    def stop_engines(self, engine_ids: list) -> list:
        """Stop the engines ``engine_ids`` (ranks or not) and wait until their processes are gone.

        Local engines: waited for :data:`EXIT_GRACE` s (after a shutdown they exit by themselves),
        then killed. ssh engines: their host is asked over ssh until the pid is gone, else they
        get SIGTERM, then SIGKILL, over ssh. The engines are forgotten (never ranked again).

        Returns
        -------
        list of str
            The engines whose exit could not be confirmed (``engine E on HOST``: host unreachable).
        """
        engine_ids = list(engine_ids)
        self._gone_ids |= set(engine_ids)
        pids = {e: self._pid_of(e) for e in engine_ids}
        if self.launcher != "ssh":
            self._reap_local([p for p in pids.values() if p is not None])
            return []
        found = {e: launchers.ssh_launcher_of(self._ipp, self.where.get(e, {})) for e in engine_ids}
        left = [e for e, l in found.items() if l is None]
        todo = {e: l for e, l in found.items() if l is not None}
        if todo:
            with concurrent.futures.ThreadPoolExecutor(len(todo)) as pool:
                gone = dict(zip(todo, pool.map(_stop_over_ssh, todo.values())))
            left += [e for e, ok in gone.items() if not ok]
        return [f"engine {e} on {self.where.get(e, {}).get('host', '?')}" for e in sorted(left)]

    def _pid_of(self, engine_id):
        info = self.where.get(engine_id) if hasattr(self, "where") else None
        if info is not None:
            return info["pid"]
        return next((r["pid"] for r in self.ranks if r.get("engine_id") == engine_id), None)

    @staticmethod
    def _reap_local(pids: list) -> None:
        """Wait :data:`EXIT_GRACE` s for the local processes ``pids`` to exit, then kill the rest."""
        import psutil


        procs = []
        for pid in pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        kill_after(procs, EXIT_GRACE)

    # the group -------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """What :meth:`restore` puts back: engine ids, placement (copied), spec, ranks, rendezvous address."""
        return (list(self.engine_ids), [dict(p) for p in self.placement], self.spec, list(self.ranks),
                self.master_addr, self.num_nodes)

    def restore(self, snap: tuple) -> None:
        """The ranks as :meth:`snapshot` saw them (after a failed grow; the group is formed again separately)."""
        ids, places, self.spec, self.ranks, self.master_addr, self.num_nodes = snap
        self.engine_ids, self.placement = list(ids), [dict(p) for p in places]
        self.where = {e: w for e, w in self.where.items() if e in self.engine_ids}

    def form_group(self, n: int, old: int) -> None:
        """The process group of the ``n`` ranks placed now: ranks below ``min(old, n)`` resize, the others set up.

        Every rank that stays leaves the old group first (a pinned ``--master-port`` is free again);
        the rendezvous is on a fresh port (or the pinned one) at rank 0's address that every host
        reaches (:meth:`_master_addr`). Each rank's threads: the cores shared out again (its host's,
        on other hosts). ``ranks`` and ``spec`` (``num_engines``, ``num_threads``) are updated.

        Raises ClusterError or RankError (naming the rank) when a rank fails to join.
        """

        spec = self.spec
        keep = min(old, n)
        self._check_joining(self.engine_ids[keep:n])  # before the running ranks leave their group
        local_gpus = visible_gpus() if spec.device_type == "cuda" and not self.remote else None
        gpus = placement.rank_gpus(self.placement[:n], self.where, spec.device_type, local_gpus)
        placement.check_gpus(self.placement[:n], self.where, gpus, spec.backend)  # two ranks on one GPU: refused
        pinned = spec.master_port is not None  # rank 0 lets the old store go: the pinned port must be free again
        self.wait_all([self.apply(r, calls.release, pinned) for r in range(keep)], timeout=spec.timeout,
                      what="leaving the old process group")
        self.num_nodes = len({p["node_rank"] for p in self.placement})
        self.master_addr = self._master_addr()
        if spec.master_port is not None and self.placement[0]["local"]:
            check_port_free(spec.master_port, self.master_addr, wait=5.0)
        self.master_port = spec.master_port or self._free_port()
        threads = self._rank_threads(old, n)
        among = placement.bind_among(self.placement[:n], spec, self.foreign_cores)  # the new world's shares
        local_sizes = placement.local_world_sizes(self.placement[:n])
        ars = [self.apply(r, calls.resize, r, n, threads[r], self.master_addr, self.master_port,
                          self.placement[r]["local_rank"], among[r], local_sizes[r]) for r in range(keep)]
        for rank in range(keep, n):
            p = self.placement[rank]
            ars.append(self.apply(rank, calls.setup, rank, n, p["local_rank"], spec.backend, spec.device_type,
                                  gpus[rank], threads[rank], self.master_addr, self.master_port, spec.timeout,
                                  p["node_rank"], p["node"], spec.interface, among[rank], local_sizes[rank]))
        infos = self.wait_all(ars, timeout=spec.timeout + 60, what=f"forming the process group of {n} ranks")
        self.ranks = [dict(info, engine_id=p["engine_id"], local=p["local"], address=self.where[p["engine_id"]]
                           ["address"]) for info, p in zip(infos, self.placement)]
        self.spec = self._resized_spec(n, threads[0])
        if n > old:
            self.apply_all(calls.warm_up)  # queued, not awaited (the added engines' imports)

    def _resized_spec(self, n: int, threads: int):
        """The spec of the world of ``n`` ranks (what ``%dist restart`` starts again).

        Over ssh hosts: the hosts that run ranks now, in ``--hosts`` order, and no
        ``--engines-per-node`` (ranks need not fill them evenly); :meth:`ssh_growth` keeps the
        hosts and slots ``%dist start`` was given.
        """
        if not self.spec.hosts:
            return dataclasses.replace(self.spec, num_engines=n, num_threads=threads)
        hosts = self.start_hosts or self.spec.hosts
        counts = placement.host_counts(hosts, [self.where[e] for e in self.engine_ids])
        used = tuple(h for h, c in zip(hosts, counts) if c) or hosts[:1]
        return dataclasses.replace(self.spec, num_engines=n, num_threads=threads, hosts=used, engines_per_node=None)

    def _check_joining(self, engine_ids: list) -> None:
        """ClusterError if an engine about to join the group has died (it would stall the rendezvous)."""
        import psutil

        for eid in engine_ids:
            pid = self._pid_of(eid)
            proc = self._procs.get(pid)
            how = None
            if eid not in self.client.ids:
                how = "is no longer registered with the controller"
            elif proc is not None:
                try:
                    dead = proc.exit_status is not None or proc.status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    dead = True
                if dead:
                    code = proc.exit_status if proc.exit_status is not None else None
                    how = launchers.exit_description(code)
            if how is not None:
                raise ClusterError(f"the new engine {eid} (pid {pid}) {how} before it joined the process group")

    def _rank_threads(self, old: int, n: int) -> list:
        """Threads of each of the ``n`` ranks: on other hosts each host's cores shared by its ranks
        (:func:`placement.fit_to_hosts`); here the cores shared out again, unless ``%dist start`` was told a number."""

        if self.remote:
            placement.fit_to_hosts(self.placement, self.where, self.spec)
            return [p["num_threads"] for p in self.placement]
        spec = self.spec
        if spec.device_type != "cpu" or spec.num_threads != max(1, cpu_cores() // old):
            return [spec.num_threads] * n
        return [max(1, cpu_cores() // n)] * n

    def rewatch(self) -> None:
        """A new reaper watching every process the cluster runs now (added engines too, removed ones not)."""
        reaper = getattr(self, "reaper", None)
        if reaper is not None:
            reaper.kill()
            reaper.wait()
        self._start_reaper()


def _stop_over_ssh(launcher) -> bool:
    """Wait until the ssh engine of ``launcher`` is gone from its host (asked over ssh); TERM, then KILL it.

    Returns whether its exit was confirmed. The launcher is marked exited (never signalled again).
    """
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            try:
                launcher.signal(sig)
            except Exception:
                pass
        if launchers.wait_gone_over_ssh(launcher, EXIT_GRACE):
            mark = getattr(launcher, "mark_exited", None)
            if mark is not None:
                mark()
            return True
    return False
