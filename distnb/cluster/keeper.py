"""The lease keeper: the process that decides when a world whose kernel died ends.

Started by :func:`distnb.cluster.reaper.spawn` at ``%dist start`` (a separate session, so that it
survives the kernel), it watches the owner kernel's pid (:mod:`distnb.cluster.lease` for the protocol):

1. ``watching``: the owner lives. A claim (:func:`distnb.cluster.lease.claim`) makes another process the owner.
2. The owner died. With ``--linger 0``, or when no task runs on the ranks (asked of the
   controller: ipyparallel's ``queue_status``, which counts a running ``%%distrain`` cell,
   foreground or ``--background``, as a pending task) and the world's record (:mod:`distnb.cluster.worlds`)
   shows no run whose end the kernel did not see, everything ends at once, as before the lease.
   Else ``training``: the ranks run to the end of what the kernel sent them.
3. ``lingering``: for ``--linger`` seconds a new kernel may claim the world.
4. ``saving``: no claim came. Every trained model is checkpointed by the ranks
   (:func:`distnb.engine.train.leasesave.save_trained`, ``%dist save``'s DCP checkpoint), then
   ``ended``: the engines leave, every process of the world is ended, the kernels' shared-memory
   files (``/dev/shm/distnb-<pid>-*``) and the cluster's connection files are removed.

What it did is in ``<cluster_id>.keeper.json`` (its state, ``saved``: the checkpoints, ``error``)
and ``<cluster_id>.lease.log`` in :func:`distnb.cluster.lease.lease_dir`.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from distnb.cluster import lease
from distnb.cluster.reaper import POLL_SECONDS, reap, sweep_shm
from distnb.core.calls import save_trained, shutdown

#: Seconds the keeper gives the ranks to save the trained state.
SAVE_TIMEOUT = 600.0
#: Seconds the keeper waits for the controller's answer (whether a task runs on the ranks).
ASK_SECONDS = 10.0
#: Seconds the keeper gives the engines to leave their group before it ends them.
LEAVE_SECONDS = 3.0


class Keeper:
    """One world's keeper (see the module docstring); ``run()`` returns once the world has ended."""

    def __init__(self, kernel_pid: int, pids, linger: float = 0.0, cluster_id: str = "", cluster_file: str = "",
                 engines=(), folder: str = ""):
        import psutil  # the keeper process only

        self.psutil = psutil
        self.owner, self.owners = int(kernel_pid), [int(kernel_pid)]
        self.procs = [p for p in map(self._process, pids) if p is not None]
        self.linger, self.cluster_id, self.cluster_file = float(linger), cluster_id, cluster_file
        self.engines, self.folder = list(engines), folder
        self.state, self.expires, self.saved, self.error = "watching", None, [], None
        self.client = None
        self._owner_proc = self._process(self.owner)

    # files ------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if not self.cluster_id:
            return
        path = os.path.join(lease.lease_dir(), f"{self.cluster_id}.lease.log")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as f:  # private, as keeper.json
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")

    def publish(self, state: str) -> None:
        self.state = state
        if self.cluster_id:
            lease.write_private(lease.keeper_file(self.cluster_id), dict(
                pid=os.getpid(), cluster_id=self.cluster_id, owner=self.owner, state=state, linger_s=self.linger,
                expires=self.expires, checkpoint_dir=self.folder, saved=self.saved, error=self.error))

    def take_claims(self) -> bool:
        """Make the newest live claimer the owner (its claim file removed: the acknowledgement); True if one."""
        if not self.cluster_id:
            return False
        claims = sorted(glob.glob(lease.claim_file(self.cluster_id, 0)[:-1] + "*"), key=os.path.getmtime)
        taken = False
        for path in claims:
            pid = int(path.rsplit("-", 1)[1])
            proc = self._process(pid)
            if proc is not None and self._alive(proc):
                self.owner, self._owner_proc, taken = pid, proc, True
                self.owners.append(pid)
            try:
                os.remove(path)
            except OSError:
                pass
        if taken:
            self.expires = None
            self.log(f"process {self.owner} claimed the world; it owns it now")
            self.publish("watching")
        return taken

    # processes ------------------------------------------------------------------------------
    def _process(self, pid):
        try:
            return self.psutil.Process(int(pid))
        except (self.psutil.Error, ValueError):
            return None

    def _alive(self, proc) -> bool:
        try:
            return proc.is_running() and proc.status() != self.psutil.STATUS_ZOMBIE
        except self.psutil.Error:
            return False

    def world_alive(self) -> bool:
        return any(self._alive(p) for p in self.procs)

    def owner_alive(self) -> bool:
        return self._owner_proc is not None and self._alive(self._owner_proc)

    # the lease ------------------------------------------------------------------------------
    def run(self) -> int:
        self.publish("watching")
        died = False
        try:
            while self.world_alive():
                self.take_claims()
                if not self.owner_alive():
                    self.log(f"the owner kernel (pid {self.owner}) is gone")
                    died = True
                    if self.outlive():  # a claim came: watch the new owner
                        died = False
                        continue
                    break
                time.sleep(POLL_SECONDS)
        finally:
            if died:
                self.end()
            else:  # stopped by its kernel (%dist stop): nothing left to do
                self.forget()
        return 0

    def forget(self) -> None:
        """Remove the keeper file of a world its kernel stopped."""
        if self.cluster_id:
            try:
                os.remove(lease.keeper_file(self.cluster_id))
            except OSError:
                pass

    def outlive(self) -> bool:
        """After the owner died: run, linger, save. True when a new owner claimed the world meanwhile."""
        if not self.linger or not (self.busy() or self.unfinished_run()):
            return False
        self.publish("training")
        self.log("training runs on the ranks: waiting for its end")
        while self.world_alive() and self.busy():
            if self.take_claims():
                return True
            time.sleep(POLL_SECONDS)
        self.expires = time.time() + self.linger
        self.publish("lingering")
        self.log(f"the run ended; waiting {self.linger:g} s for a new kernel (distnb.cluster.lease.claim)")
        while time.time() < self.expires and self.world_alive():
            if self.take_claims():
                return True
            time.sleep(POLL_SECONDS)
        self.publish("saving")
        self.take_claims()  # a claim that came too late is removed: claim() reports the expiry
        self.save()
        return False

    def connect(self):
        """An ipyparallel Client of the world's controller, from the connection file next to its cluster file."""
        if self.client is None:
            import ipyparallel as ipp  # the keeper process only, once the kernel died

            security = os.path.dirname(self.cluster_file)
            self.client = ipp.Client(os.path.join(security, f"ipcontroller-{self.cluster_id}-client.json"),
                                     profile_dir=os.path.dirname(security), timeout=ASK_SECONDS)
        return self.client

    def busy(self) -> bool:
        """Whether a task (a training cell) is pending or running on the world's engines (asked of the controller)."""

        pool = ThreadPoolExecutor(1)  # ipyparallel's query waits for its answer without a timeout
        try:
            status = pool.submit(lambda: self.connect().queue_status(targets=self.engines or "all")).result(
                timeout=ASK_SECONDS)
        except Exception as exc:  # no controller: nothing can run any more
            self.log(f"cannot reach the controller ({type(exc).__name__}: {exc}): ending the world")
            return False
        finally:
            pool.shutdown(wait=False)
        return bool(status.get("unassigned")) or any(
            v.get("queue") or v.get("tasks") for k, v in status.items() if isinstance(v, dict))

    def unfinished_run(self) -> bool:
        """Whether the world's record (:mod:`distnb.cluster.worlds`) still shows a training run: one that ended after its
        kernel died (or before the kernel took its result), whose trained state only the ranks hold."""
        from distnb.cluster import worlds  # read only; imported once the kernel died

        try:
            return worlds.read(worlds.record_path(self.cluster_id)).get("run") is not None
        except Exception:  # no record (stopped), or not readable: nothing to go by
            return False

    def save(self) -> None:
        """Every rank saves the trained models (collectively); the result goes to the keeper file and log."""

        try:
            client = self.connect()
            ars = [_send(client[e], save_trained, self.folder) for e in self.engines]
            deadline = time.monotonic() + SAVE_TIMEOUT
            while not all(ar.ready() for ar in ars):  # not ar.get(SAVE_TIMEOUT): the world may end meanwhile
                if not self.world_alive() or time.monotonic() > deadline:
                    raise TimeoutError(f"the ranks did not save within {SAVE_TIMEOUT:g} s" if self.world_alive()
                                       else "the world's processes ended while it saved")
                time.sleep(POLL_SECONDS)
            results = [ar.get() for ar in ars]
            self.saved = results[0] if results else []
            self.log("saved: " + (", ".join(f"{s['model']} (step {s['steps']}) to {s['path']}" for s in self.saved)
                                  or "no model was trained"))
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:2000]
            self.log(f"saving the trained state failed: {self.error}")
        self.publish("saving")

    def end(self) -> None:
        """End every process of the world, its kernels' shared-memory files and its connection files."""

        if self.client is not None and self.state == "saving" and self.world_alive():
            try:  # after a save, the engines leave their group and exit (os._exit) before the rest is ended
                before = len([p for p in self.procs if self._alive(p)])
                for e in self.engines:
                    _send(self.client[e], shutdown)
                deadline = time.monotonic() + LEAVE_SECONDS  # the controller stays: wait for the engines only
                while (before - len([p for p in self.procs if self._alive(p)]) < len(self.engines)
                       and time.monotonic() < deadline):
                    time.sleep(0.05)
            except Exception:
                pass
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
        reap([p for p in self.procs if self._alive(p)])
        for pid in self.owners:
            if self._process(pid) is None or not self._alive(self._process(pid)):  # a live kernel's files are its own
                sweep_shm(pid)
        self._remove_cluster_files()
        self.publish("ended")
        self.log("the world has ended")
        if not self.saved and not self.error:  # else the record says where the state went (claim() reports it)
            self.forget()

    def _remove_cluster_files(self) -> None:
        """The cluster file and the controller's connection and engine-state files (what a stop removes)."""
        if not self.cluster_file:
            return
        profile_dir = os.path.dirname(os.path.dirname(self.cluster_file))
        paths = [self.cluster_file, os.path.join(profile_dir, "log", f"engines{self.cluster_id}.json"),
                 *glob.glob(os.path.join(profile_dir, "security", f"ipcontroller-{self.cluster_id}-*.json"))]
        for path in paths:
            try:
                os.remove(path)
            except OSError:
                pass


def _on_rank(module, fn, with_ns, *args):
    # Runs on an engine, as distnb.cluster.cluster's shim does (made interactive by _send: globals() is the user
    # namespace, so the import must be made here, not at this module's top)
    import importlib

    f = getattr(importlib.import_module(module), fn)
    return f(globals(), *args) if with_ns else f(*args)


def _send(view, fn, *args):
    """``fn`` (a :class:`distnb.core.calls.RankFunction`) on the engine of ``view``, its arguments checked first."""
    from ipyparallel import interactive  # the keeper process only

    fn.check(args)
    return view.apply_async(interactive(_on_rank), fn.module, fn.name, fn.with_ns, *args)


def main(argv) -> int:
    """``--lease JSON KERNEL_PID PID [PID ...]``: keep the world of the pids (see :class:`Keeper`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupt button is not for us
    if argv[:1] != ["--lease"] or len(argv) < 3:
        print("usage: python -m distnb.cluster.keeper --lease JSON KERNEL_PID PID [PID ...]", file=sys.stderr)
        return 2
    return Keeper(int(argv[2]), [int(p) for p in argv[3:]], **json.loads(argv[1])).run()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
