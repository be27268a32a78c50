"""A real Slurm cluster on this machine: slurmctld and one slurmd per node, each in a test host (hosts.py).

:class:`SlurmCluster` builds :class:`~tests.multihost.hosts.TestHosts` with one host more than it has
nodes: host 0 (``dnb-<tok>-h1``) runs ``slurmctld``, every other host runs one ``slurmd`` whose
NodeName is that host's name and whose NodeAddr is its bridge address. Every daemon runs inside its
host's network and UTS namespaces (``ip netns exec`` + ``nsenter -u``), so each listens only there
(Slurm binds every address of its namespace: the host's bridge address and its own loopback) and
nothing listens in the machine's own namespace. One ``munged`` (Unix socket only, with a fresh key)
serves them all: the hosts share the machine's filesystem.

The ``slurm.conf`` (written into a fresh temporary folder with the state, spool, pid and log files)
is minimal: ``proctrack/linuxproc`` and ``task/none`` (no cgroups; ``cgroup.conf`` names
``cgroup/v1`` only because slurmd 22.05 loads a cgroup plugin regardless), no accounting, root as
SlurmUser and SlurmdUser, the nodes' size from the configuration (``config_overrides``), no requeue,
short timeouts, and a node set DOWN stays down until resumed (``ReturnToService=1``). Partitions:
``debug`` (the default, every node, up) and ``down`` (every node, state DOWN: jobs queue there and
never start). :meth:`start` points ``SLURM_CONF`` of this process at it, so
``sbatch``, ``squeue`` and ``scancel`` (the kernel's, in the tests) use this cluster; :meth:`stop` puts
it back.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import psutil

from .hosts import TestHosts

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "sinfo", "scontrol")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def _find(name):
    found = shutil.which(name)
    if found:
        return found
    for folder in SBIN:
        if os.access(os.path.join(folder, name), os.X_OK):
            return os.path.join(folder, name)
    return None


class SlurmCluster:
    """munged, slurmctld and ``nodes`` slurmds on network-namespace hosts; see the module docstring.

    Attributes
    ----------
    hosts : TestHosts
        The hosts (host 0: slurmctld; hosts 1..: the nodes).
    nodes : list of str
        NodeNames (= the hosts' hostnames), in order.
    conf : str
        Path of the slurm.conf.
    tmpdir : str
        The cluster's folder (conf, munge key and socket, state, spools, logs); removed by :meth:`stop`.
    """

    __test__ = False

    def __init__(self, nodes=2, *, cpus=2, idle_timeout=60.0):
        self.n_nodes, self.cpus, self.idle_timeout = nodes, cpus, idle_timeout
        self.hosts = None
        self.tmpdir = None
        self.conf = None
        self.nodes = []
        self._procs = {}  # name -> Popen
        self._old_conf = None
        self._started = False

    @staticmethod
    def available():
        """``(True, "")`` or ``(False, reason)``: root, namespaces and Slurm's and munge's programs."""
        ok, reason = TestHosts.available()
        if not ok:
            return ok, reason
        missing = [name for name in (*DAEMONS, *CLIENTS) if _find(name) is None]
        if missing:
            return False, f"{', '.join(missing)} not found (run .ci/install-slurm.sh: munge, slurmctld, slurmd, " \
                          "slurm-client)"
        return True, ""

    # ------------------------------------------------------------------ lifecycle

    def start(self):
        """Build the hosts, start the daemons, wait until ``sinfo`` shows every node idle. Returns ``self``."""
        self._started = True
        try:
            self.hosts = TestHosts(self.n_nodes + 1).start()
            self.nodes = self.hosts.namespaces[1:]
            self.tmpdir = tempfile.mkdtemp(prefix="dnb-slurm-")
            self._munged()
            self._write_conf()
            self._old_conf = os.environ.get("SLURM_CONF")
            os.environ["SLURM_CONF"] = self.conf
            self._daemon("slurmctld", 0, [_find("slurmctld"), "-D", "-i", "-f", self.conf])
            for i, name in enumerate(self.nodes, start=1):
                self._daemon(f"slurmd-{name}", i, [_find("slurmd"), "-D", "-N", name, "-f", self.conf])
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        """Cancel every job, stop every daemon, remove the hosts and the folder.

        Returns
        -------
        list of str
            What was left to clean up (jobs still queued, daemons that had to be killed): empty
            when the tests left nothing behind.
        """
        if not self._started:
            return []
        self._started = False
        left = []
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            jobs = self.jobs()
            if jobs:
                left.append(f"jobs still in squeue: {jobs}")
                self.squeue_cmd("scancel", "--full", *jobs)
        for name in sorted(self._procs, key=lambda n: n == "munged"):  # munged last: slurm needs it to stop
            p = self._procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self._procs.items():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                left.append(f"{name} did not stop on SIGTERM")
                p.kill()
                p.wait(timeout=10)
        self._procs = {}
        if self.hosts is not None:
            self.hosts.stop()  # also every slurmstepd and engine still in a namespace
        strays = self.daemon_processes()
        for p in strays:
            left.append(f"stray {p.name()} (pid {p.pid})")
            p.kill()
        if self._old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._old_conf
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        return left

    # ------------------------------------------------------------------ using it

    def squeue_cmd(self, *args, timeout=30, check=False):
        """Run a Slurm client command (``squeue``, ``scontrol``, ...) against this cluster."""
        env = {**os.environ, "SLURM_CONF": self.conf}
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=check, env=env)

    def jobs(self):
        """Ids of the jobs squeue lists (pending, running, completing)."""
        return self.squeue_cmd("squeue", "-h", "-o", "%i").stdout.split()

    def node_states(self):
        """{NodeName: state} from ``sinfo``."""
        out = self.squeue_cmd("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
        return dict(line.split() for line in out if line.strip())

    def job_processes(self):
        """``name (pid) on NODE`` of every process on a node but its sshd and slurmd: what jobs left running."""
        daemons = {p.pid for p in self._procs.values()} | set(self.hosts.sshd_pids)
        out = []
        for i, node in enumerate(self.nodes, start=1):
            for pid in set(self.hosts.pids(i)) - daemons:
                try:
                    out.append(f"{psutil.Process(pid).name()} ({pid}) on {node}")
                except psutil.NoSuchProcess:
                    pass
        return out

    def wait_idle(self, timeout=None):
        """Wait until every node is idle (a node resumed after DOWN, or the cluster just started)."""
        deadline = time.monotonic() + (timeout or self.idle_timeout)
        while True:
            states = self.node_states()
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle ({states}; exited: {dead}):\n{self.logs()}")
            time.sleep(0.2)

    def set_node(self, name, state, reason="distnb test"):
        """``scontrol update NodeName=name State=state`` (DOWN, RESUME, ...)."""
        args = ["scontrol", "update", f"NodeName={name}", f"State={state}"]
        if state.upper() in ("DOWN", "DRAIN"):
            args.append(f"Reason={reason}")
        self.squeue_cmd(*args, check=True)

    def daemon_processes(self):
        """Live munged/slurmctld/slurmd/slurmstepd processes of this cluster (its folder in their command or
        in their SLURM_CONF)."""
        out = []
        for p in psutil.process_iter(["name", "cmdline"]):
            try:
                if p.info["name"] not in (*DAEMONS, "slurmstepd") or not self.tmpdir:
                    continue
                if self.tmpdir in " ".join(p.info["cmdline"] or []) or \
                        self.tmpdir in p.environ().get("SLURM_CONF", ""):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return out

    def logs(self):
        """The end of each daemon's log (for failure messages)."""
        parts = []
        for name in sorted(os.listdir(self.tmpdir)) if self.tmpdir else []:
            if name.endswith(".log"):
                with open(os.path.join(self.tmpdir, name), errors="replace") as f:
                    parts.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
        return "\n".join(parts)

    # ------------------------------------------------------------------ building blocks

    def _munged(self):
        """munged with a fresh key, its socket in the cluster's folder; waits for the socket."""
        d = os.path.join(self.tmpdir, "munge")
        os.mkdir(d, 0o700)
        key = os.path.join(d, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        self.munge_socket = os.path.join(d, "munge.socket")
        log = open(os.path.join(self.tmpdir, "munged.log"), "w")
        self._procs["munged"] = subprocess.Popen(
            [_find("munged"), "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={os.path.join(d, 'munged.pid')}", f"--seed-file={os.path.join(d, 'munged.seed')}",
             f"--log-file={os.path.join(self.tmpdir, 'munged.log')}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not os.path.exists(self.munge_socket):
            if self._procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.logs()}")
            time.sleep(0.05)

    def _write_conf(self):
        t = self.tmpdir
        for sub in ("state", "spool"):
            os.mkdir(os.path.join(t, sub))
        ctl, ctl_addr = self.hosts.namespaces[0], self.hosts.addresses[0]
        lines = [
            "ClusterName=distnbtest",
            f"SlurmctldHost={ctl}({ctl_addr})",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={t}/state", f"SlurmdSpoolDir={t}/spool/%n",
            f"SlurmctldPidFile={t}/slurmctld.pid", f"SlurmdPidFile={t}/slurmd-%n.pid",
            f"SlurmctldLogFile={t}/slurmctld.log", f"SlurmdLogFile={t}/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin",
            "SlurmdParameters=config_overrides", "ReturnToService=1", "JobRequeue=0",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "MessageTimeout=5", "InactiveLimit=0", "KillWait=2",
            "MinJobAge=60", "OverTimeLimit=0", f"PlugStackConfig={t}/plugstack.conf",
        ]
        for name, addr in zip(self.nodes, self.hosts.addresses[1:]):
            os.mkdir(os.path.join(t, "spool", name))
            lines.append(f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN")
        nodes = ",".join(self.nodes)
        lines += [f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP",
                  f"PartitionName=down Nodes={nodes} MaxTime=INFINITE State=DOWN"]
        open(os.path.join(t, "plugstack.conf"), "w").close()  # none of the machine's SPANK plugins
        # slurmd 22.05 loads a cgroup plugin whatever else it uses; autodetection fails in `ip netns exec`
        # (a fresh sysfs on /sys: no /sys/fs/cgroup mounts), cgroup/v1 named loads and, unused, does nothing
        with open(os.path.join(t, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")
        self.conf = os.path.join(t, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _daemon(self, name, host, cmd):
        """Start ``cmd`` in host ``host``'s network and UTS namespaces, its output in ``NAME.out``."""
        out = open(os.path.join(self.tmpdir, f"{name}.out"), "w")
        ns, sshd = self.hosts.namespaces[host], self.hosts.sshd_pids[host]
        env = {**os.environ, "SLURM_CONF": self.conf}
        self._procs[name] = subprocess.Popen(
            ["ip", "netns", "exec", ns, "nsenter", "-t", str(sshd), "-u", "--", *cmd],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
