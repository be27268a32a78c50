"""Where engines run: ipyparallel's launcher settings, the controller's address, rank order over hosts.

distnb writes no launcher of its own: ``%dist start --launcher local|mpi|ssh|slurm|...``
picks one of ipyparallel's engine launchers (``ipyparallel.cluster.launcher``) and this
module only fills in its settings (traitlets config), which a user's ``--profile`` can
override key by key. Local engines keep distnb's own fast local launcher
(:mod:`distnb.cluster.launchers`).

Ranks are assigned deterministically across hosts (:func:`assign_ranks`): by the rank MPI
or Slurm gave each process when they launched it, else host by host in ``--hosts`` order
(then by address) and by engine id within a host. ``node_rank`` numbers the hosts and
``local_rank`` the engines on one host; a GPU host gives local rank ``i`` its ``i``-th GPU
(:func:`rank_gpus`), and engines on other hosts share their host's cores
(:func:`fit_to_hosts`). The functions after :func:`assign_ranks` work on what the engines
reported (``where``, :func:`distnb.core.net.whereami`); :class:`distnb.cluster.cluster.Cluster` asks them.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import ipaddress
import logging
import os
import shutil
import socket
import sys

from traitlets.config import Config

from distnb.cluster import worlds
from distnb.cluster.cpuload import AUTO_MAX_FOREIGN
from distnb.core.errors import ClusterError, PlanError
from distnb.core.gpus import duplicates, duplicates_message
from distnb.core.net import boot_id as this_boot
from distnb.core.net import check_port_free, is_loopback, route_address
from distnb.core.net import ipv4_of as interface_address
from distnb.core.plan import BATCH_LAUNCHERS

#: Launchers whose engines run on other hosts (ssh even to this host: its engines reach the
#: controller over the network).
REMOTE_LAUNCHERS = frozenset(("ssh", "sshproxy", "winhpc", "batch") + BATCH_LAUNCHERS)
#: OpenMPI refuses to start as root without both of these (containers and CI run as root).
OPENMPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
ENGINE_MODULE = "distnb.engine.ipengine"


def engine_command(python: str | None = None) -> list:
    """distnb's engine entry point (ipyparallel's engine plus the torch preload)."""
    return [python or sys.executable, "-m", ENGINE_MODULE]


def profile_config(profile: str | None) -> tuple[dict, Config]:
    """``ipp.Cluster`` keyword arguments naming the profile, and the config its ipcluster_config.py sets.

    ``profile`` is a profile name (in the IPython directory) or a profile directory.
    """
    if profile is None:  # distnb's own, where Jupyter keeps its runtime files (owner-only: distnb.cluster.worlds)
        return {"profile_dir": worlds.profile_folder()}, Config()
    import ipyparallel as ipp
    from IPython.core.profiledir import ProfileDir, ProfileDirError
    from IPython.paths import get_ipython_dir

    if os.sep in profile or os.path.isdir(profile):
        folder = os.path.abspath(profile)
        if not os.path.isdir(folder):
            raise PlanError(f"--profile {profile}: no such directory")
        kwargs = {"profile_dir": folder}
    else:
        try:  # looked up, never created (ipyparallel would create an empty one)
            ProfileDir.find_profile_dir_by_name(get_ipython_dir(), profile)
        except ProfileDirError:
            raise PlanError(f"--profile {profile}: no ipyparallel profile named {profile} in {get_ipython_dir()}; "
                            f"create it with `ipython profile create --parallel {profile}` or pass a profile "
                            "directory") from None
        kwargs = {"profile": profile}
    probe = ipp.Cluster(**kwargs, log=logging.getLogger("distnb.ipyparallel"))
    return kwargs, probe.profile_config


def launcher_name(spec, config: Config) -> str:
    """The engine launcher in use: ``--launcher``, else the profile's, else ``local``."""
    if spec.launcher is not None:
        return spec.launcher
    cls = config.get("Cluster", {}).get("engine_launcher_class", "local")
    name = cls if isinstance(cls, str) else getattr(cls, "__name__", "local")
    name = name.rsplit(".", 1)[-1].lower()
    for suffix in ("enginesetlauncher", "launcher"):
        if name.endswith(suffix) and name != suffix:
            name = name[: -len(suffix)]
    return {"mpiexec": "mpi"}.get(name, name)  # ipyparallel's deprecated MPIExec names


def engines_remote(launcher: str | None, hosts=()) -> bool:
    """Whether engines may run on other hosts (the controller then listens on the network).

    None (the launcher a profile sets, not known yet) counts as remote.
    """
    return launcher is None or launcher in REMOTE_LAUNCHERS or (launcher == "mpi" and bool(hosts))


def hostname_of(host: str) -> str:
    """``host`` of ``[user@]host[:port]``."""
    host = host.rsplit("@", 1)[-1]
    if host.startswith("["):  # [v6]:port
        return host[1: host.index("]")]
    return host.split(":", 1)[0] if host.count(":") == 1 else host


def resolve(host: str) -> str | None:
    """The IPv4 address of ``[user@]host[:port]``, or None."""
    try:
        return socket.gethostbyname(hostname_of(host))
    except OSError:
        return None


def local_addresses() -> set:
    """Every address of this host's interfaces."""
    import psutil

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}


def controller_ip(spec, remote: bool, toward: str | None = None) -> str:
    """Where the controller listens: 127.0.0.1 for local engines, else an address the hosts can reach.

    In order: the address of ``--interface`` on this host; this host's address on the route
    to the first of ``--hosts``, or to ``toward`` (a host the engines' hosts reach: slurmctld's
    address for Slurm); on the default route; of its hostname. Raises ClusterError when only
    loopback is found.
    """
    if not remote:
        return "127.0.0.1"
    if spec.interface:
        addr = interface_address(spec.interface)
        if addr:
            return addr
    candidates = [route_address(hostname_of(h)) for h in [*spec.hosts[:1], *([toward] if toward else [])]]
    candidates += [route_address("192.0.2.1")]  # TEST-NET-1: only the default route is looked up
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    for addr in candidates:
        if addr and not ipaddress.ip_address(addr).is_loopback:
            return addr
    raise ClusterError("engines on other hosts need an address of this host that they can reach, and only "
                       "loopback was found; name the network with %dist start --interface NAME")


def launcher_section(launcher: str) -> str:
    """ipyparallel's engine-set launcher class name for a batch ``launcher`` (its config section)."""
    names = {"slurm": "Slurm", "pbs": "PBS", "sge": "SGE", "lsf": "LSF", "htcondor": "HTCondor"}
    return names[launcher] + "EngineSetLauncher"


def engines_per_host(spec) -> int:
    hosts = len(spec.hosts) or spec.nodes or 1
    return spec.engines_per_node or -(-spec.num_engines // hosts)


#: Seconds an engine waits for the controller's answer to its registration before it gives up and exits.
#: ipyparallel's default (``IPEngine.timeout``, 5 s) can be shorter than a busy controller takes to answer
#: many engines registering at once; distnb itself waits at least 60 s for registration and stops the
#: engines when it gives up. (The 31-of-32 starts of issue 20 were another cause: see
#: :func:`distnb.cluster.launchers.refresh_engines`.)
REGISTRATION_WAIT = 120.0
REGISTRATION_ARG = f"--IPEngine.timeout={REGISTRATION_WAIT:g}"


def launcher_config(spec, launcher: str, profile: Config, env: dict) -> Config:
    """traitlets config for ipyparallel's ``launcher``: distnb's engine command, environment, placement.

    A key the user's profile sets is left to the profile, except where an option given on
    the command line sets it (``--hosts``, ``--queue``, ...).
    """
    c = Config()

    def default(section, key, value):
        if key not in profile.get(section, {}):
            c[section][key] = value

    env = dict(env)
    if launcher != "mpi" and os.environ.get("IPYTHONDIR"):  # remote shells start with their login environment
        env.setdefault("IPYTHONDIR", os.environ["IPYTHONDIR"])
    if launcher == "mpi" and os.geteuid() == 0:
        env = {**OPENMPI_ROOT_ENV, **env}
    # the profile's variables are added to distnb's (a variable both set: the profile's value)
    c.EngineLauncher.environment = {**env, **_profile_value(profile, "environment", "EngineLauncher", {})}
    # on other hosts the nanny process forwards signals (the interrupt) to the engine and reports its exit;
    # engines on this host are signalled by pid and need none
    nanny = [] if engines_remote(launcher, spec.hosts) else ["--IPEngine.enable_nanny=False"]
    default("EngineLauncher", "engine_args", nanny + ["--HistoryManager.enabled=False", REGISTRATION_ARG])
    per_host = engines_per_host(spec)
    if launcher == "ssh":
        python = _profile_value(profile, "remote_python", "SSHEngineLauncher", "SSHEngineSetLauncher",
                                "SSHLauncher", None) or sys.executable
        default("SSHLauncher", "remote_python", python)
        # never wait at a password prompt no one can answer; an unreachable host fails in seconds
        default("SSHLauncher", "ssh_args", ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"])
        default("SSHLauncher", "scp_args", ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"])
        default("SSHEngineSetLauncher", "engine_cmd", engine_command(python))
        default("SSHEngineLauncher", "engine_cmd", engine_command(python))
        if spec.hosts:
            c.SSHEngineSetLauncher.engines = {h: per_host for h in spec.hosts}
    elif launcher == "mpi":
        default("MPIEngineSetLauncher", "engine_cmd", engine_command())
        args = list(_profile_value(profile, "mpi_args", "MPIEngineSetLauncher", "MPILauncher", mpi_default_args()))
        if spec.hosts:
            args += ["--host", ",".join(f"{hostname_of(h)}:{per_host}" for h in spec.hosts)]
            for name in [*env, "IPP_CONNECTION_INFO", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR"]:
                args += ["-x", name]  # Open MPI forwards only what -x names to other hosts
        c.MPIEngineSetLauncher.mpi_args = args
    elif launcher in BATCH_LAUNCHERS:
        section = launcher_section(launcher)
        default(section, "engine_cmd", engine_command())
        if spec.queue:
            c[section].queue = spec.queue
        if launcher == "slurm":
            if spec.time_limit:
                c[section].timelimit = spec.time_limit
            if spec.account:
                c[section].account = spec.account
            if spec.nodes or spec.engines_per_node:
                if _profile_value(profile, "batch_template", section, "SlurmLauncher", "") or \
                        _profile_value(profile, "batch_template_file", section, "SlurmLauncher", ""):
                    raise PlanError("--nodes and --engines-per-node go into distnb's Slurm job script, but the "
                                    "profile sets its own batch_template: put #SBATCH --nodes/--ntasks-per-node "
                                    "there and leave out these options")
                c[section].batch_template = slurm_template(spec, per_host)
        elif spec.time_limit or spec.account or spec.nodes:
            raise PlanError(f"--time, --account and --nodes are passed to slurm only; for --launcher {launcher} "
                            f"set them in the batch template of an ipyparallel profile ({section}.batch_template) "
                            "and use --profile NAME")
    return c


def _profile_value(profile: Config, key: str, *sections_then_default):
    """``key`` from the first of ``sections`` that sets it in the profile, else the default (last argument)."""
    *sections, fallback = sections_then_default
    for section in sections:
        if key in profile.get(section, {}):
            return profile[section][key]
    return fallback


def slurm_template(spec, per_host: int) -> str:
    """The engines' sbatch script (ipyparallel's template syntax) for ``--nodes``/``--engines-per-node``.

    ipyparallel's own script only asks for ``--ntasks``, so Slurm could place every engine on
    one node; this one fixes nodes and tasks per node. ``srun`` starts the engines (Slurm sets
    SLURM_PROCID, which becomes the rank).
    """
    # --no-requeue: a job Slurm restarts (after a node failure) would start engines no session waits for
    lines = ["#!/bin/sh", "#SBATCH --export=ALL", "#SBATCH --job-name=ipengine-{cluster_id}", "#SBATCH --no-requeue",
             "#SBATCH --ntasks={n}", f"#SBATCH --ntasks-per-node={per_host}", "#SBATCH --output={output_file}"]
    if spec.nodes:
        lines.append(f"#SBATCH --nodes={spec.nodes}")
    if spec.queue:
        lines.append(f"#SBATCH --partition={spec.queue}")
    if spec.time_limit:
        lines.append(f"#SBATCH --time={spec.time_limit}")
    if spec.account:
        lines.append(f"#SBATCH --account={spec.account}")
    return "\n".join(lines + ["srun {program_and_args}", ""])


def engine_count(profile: Config) -> int | None:
    """How many engines a profile asks for (``SSHEngineSetLauncher.engines``, ``Cluster.n``), if it says."""
    engines = _profile_value(profile, "engines", "SSHEngineSetLauncher", None)
    if engines:
        return sum(v if isinstance(v, int) else int(v.get("n", 1)) for v in engines.values())
    n = _profile_value(profile, "n", "Cluster", "IPClusterEngines", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def mpi_default_args() -> list:
    """Open MPI mpiexec options for engines.

    ``--oversubscribe``: more engines than cores is allowed (engines mostly wait).
    ``--bind-to none``: otherwise, with 2 ranks or fewer, each rank's torch threads are pinned
    to one core. ``--enable-recovery``: one engine that dies (or is shut down) does not make
    mpiexec abort every other rank, so a lost engine is reported as for any launcher.
    """
    return ["--oversubscribe", "--bind-to", "none", "--enable-recovery"]


def check_launcher_tools(launcher: str, profile: Config) -> None:
    """PlanError naming what is missing for ``launcher`` on this machine (mpiexec and mpi4py for mpi)."""

    if launcher == "mpi":
        mpiexec = (_profile_value(profile, "mpi_cmd", "MPIEngineSetLauncher", "MPILauncher", None) or ["mpiexec"])[0]
        if shutil.which(mpiexec) is None:
            raise PlanError(f"--launcher mpi needs {mpiexec} on PATH (Debian/Ubuntu: apt install openmpi-bin)")
        if importlib.util.find_spec("mpi4py") is None:
            raise PlanError("--launcher mpi needs mpi4py in this environment (pip install mpi4py), which the "
                            "engines use to join MPI")
    elif launcher in ("slurm", "pbs", "sge", "lsf", "htcondor"):
        submit = {"slurm": "sbatch", "pbs": "qsub", "sge": "qsub", "lsf": "bsub", "htcondor": "condor_submit"}
        section = launcher_section(launcher)
        command = _profile_value(profile, "submit_command", section, section.replace("EngineSet", ""), None)
        if command:
            submit[launcher] = command[0]
        if shutil.which(submit[launcher]) is None:
            raise PlanError(f"--launcher {launcher} needs {submit[launcher]} on PATH (run the kernel on a login "
                            "node of the cluster)")


def assign_ranks(where: dict, hosts: tuple = ()) -> list[dict]:
    """Rank order for the engines described by ``where`` ({engine_id: :func:`distnb.core.net.whereami` dict}).

    Returns one dict per rank (rank order) with engine_id, node_rank, local_rank, node (a
    label for the host: its hostname, or its address when hostnames repeat) and local (True
    when the engine runs on this machine, so its pid can be signalled and watched here).
    """
    def node_key(info):
        return (info["host"], info["address"])

    nodes = {}
    for eid, info in where.items():
        nodes.setdefault(node_key(info), []).append(eid)
    launch = [info.get("launch_rank") for info in where.values()]
    by_launch = None not in launch and sorted(launch) == list(range(len(launch)))
    if by_launch:  # mpiexec / srun numbered the processes: that is the rank
        order = sorted(where, key=lambda e: where[e]["launch_rank"])
        node_order = []
        for eid in order:
            if node_key(where[eid]) not in node_order:
                node_order.append(node_key(where[eid]))
    else:
        position = _host_position(hosts)
        node_order = sorted(nodes, key=lambda k: (position(*k), k[0], _addr_key(k[1])))
        order = [eid for key in node_order for eid in sorted(nodes[key])]
    hostnames = [k[0] for k in node_order]
    unique = len(set(hostnames)) == len(hostnames)
    mine = local_addresses() | {"127.0.0.1", "::1"}
    boot_id = this_boot()
    seen = {}
    out = []
    for eid in order:
        info = where[eid]
        key = node_key(info)
        local_rank = seen.get(key, 0)
        seen[key] = local_rank + 1
        if by_launch and info.get("launch_local_rank") is not None:
            local_rank = info["launch_local_rank"]
        out.append(dict(engine_id=eid, node_rank=node_order.index(key), local_rank=local_rank,
                        node=key[0] if unique else (key[1] or key[0]),
                        local=info.get("boot_id") == boot_id and info["address"] in mine))
    return out


def _host_position(hosts):
    """``position(hostname, address)``: the index in ``hosts`` of the entry naming that host, else ``len(hosts)``."""
    wanted = [hostname_of(h) for h in hosts]
    resolved = {resolve(h): h for h in wanted}

    def position(host, address):
        for i, h in enumerate(wanted):
            if h in (host, address) or resolved.get(address) == h:
                return i
        return len(wanted)

    return position


def extend_ranks(places: list, where: dict, engine_ids, hosts: tuple = ()) -> list:
    """``places`` (the running ranks, unchanged) followed by the engines ``engine_ids``, ranked after them.

    Each added engine (in ascending engine id) gets its host's node_rank (a host new to the world:
    the next one), the smallest local_rank no rank of its host has (GPU ranks keep theirs when others
    leave, :meth:`distnb.cluster.engines.Engines.remove_ranks`: the freed one names the freed GPU), and the node label and ``local`` flag
    :func:`assign_ranks` gives it among all of ``where``'s engines. ``%dist scale`` uses this so
    that growing never renumbers a running rank (ranks of one host are then not always contiguous).
    """
    running = [p["engine_id"] for p in places]
    full = {p["engine_id"]: p for p in assign_ranks({e: where[e] for e in [*running, *engine_ids]}, hosts)}
    out = [dict(p) for p in places]
    node_ranks = {p["node"]: p["node_rank"] for p in out}
    taken = {}
    for p in out:
        taken.setdefault(p["node"], set()).add(p["local_rank"])
    for eid in sorted(engine_ids):
        p = dict(full[eid])
        node = p["node"]
        if node not in node_ranks:
            node_ranks[node] = max(node_ranks.values(), default=-1) + 1
        used = taken.setdefault(node, set())
        local = next(i for i in range(len(used) + 1) if i not in used)  # a GPU rank's freed slot: its GPU is free
        used.add(local)
        out.append(dict(p, node_rank=node_ranks[node], local_rank=local))
    return out


def host_counts(hosts: tuple, infos: list) -> list:
    """How many of the engines described by ``infos`` (:func:`distnb.core.net.whereami` dicts) run on each of ``hosts``."""
    position = _host_position(hosts)
    counts = [0] * len(hosts)
    for info in infos:
        i = position(info["host"], info["address"])
        if i < len(hosts):
            counts[i] += 1
    return counts


def host_caps(hosts: tuple, infos: list, device_type: str, slots=None, per_core: int = 16) -> list:
    """The most engines each of ``hosts`` may run (None: not known, no engine reported from it yet).

    ``slots``: ``--engines-per-node`` (an int), or a profile's ``{host: n}``; else ``per_core``
    engines per core on CPU hosts (:data:`distnb.cluster.defaults.ENGINES_PER_CORE`, as ``%dist start -n``
    on this machine) and one per GPU on GPU hosts, from what the host's engines reported (``infos``).
    """
    position = _host_position(hosts)
    caps = [None] * len(hosts)
    for info in infos:
        i = position(info["host"], info["address"])
        if i < len(hosts):
            caps[i] = len(info["gpus"]) if device_type == "cuda" else per_core * info["cores"]
    if isinstance(slots, int):
        caps = [slots] * len(hosts)
    elif isinstance(slots, dict):
        caps = [slots.get(h) if isinstance(slots.get(h), int) else c for h, c in zip(hosts, caps)]
    return caps


def spread(hosts: tuple, counts: list, caps: list, k: int, n: int) -> dict:
    """``{host: engines to start}`` for ``k`` more engines: each to the host with the fewest (first on a tie).

    ``counts``: engines each host runs now; ``caps``: the most it may run (None: no limit known).
    Raises PlanError, naming each host's room, when the hosts cannot take ``k`` more (``n`` in all).
    """
    if not hosts:
        raise PlanError(f"%dist scale {n}: the ssh launcher was given no hosts to start engines on (--hosts)")
    before, counts, add = list(counts), list(counts), {}
    for _ in range(k):
        room = [i for i in range(len(hosts)) if caps[i] is None or counts[i] < caps[i]]
        if not room:
            have = ", ".join(f"{h}: {c} of {cap}" for h, c, cap in zip(hosts, before, caps))
            raise PlanError(f"%dist scale {n}: the hosts have room for {sum(caps) - sum(before)} more engines "
                            f"({have}: --engines-per-node, else 16 per CPU core or one per GPU); scale to at most "
                            f"{n - k + sum(caps) - sum(before)}, or %dist restart with more --hosts")
        i = min(room, key=lambda j: (counts[j], j))
        counts[i] += 1
        add[hosts[i]] = add.get(hosts[i], 0) + 1
    return add


def _addr_key(address):
    try:
        return (0, int(ipaddress.ip_address(address)))
    except (ValueError, TypeError):
        return (1, str(address))


def missing_hosts(hosts, where: dict) -> list:
    """The entries of ``hosts`` that none of the engines described by ``where`` runs on."""
    seen = {info["address"] for info in where.values()} | {info["host"] for info in where.values()}
    return [h for h in hosts if not {hostname_of(h), resolve(h)} & seen]


def _gpu_for(gpus: list, local_rank: int):
    """The GPU of local rank ``local_rank`` among the ``gpus`` its engine sees, or None.

    The ``local_rank``-th; or the only one, when the launcher gave each engine its own GPU
    (Slurm's ``--gpus-per-task=1`` sets CUDA_VISIBLE_DEVICES per task).
    """
    if len(gpus) > local_rank:
        return gpus[local_rank]
    return gpus[0] if len(gpus) == 1 else None


def rank_gpus(places: list, where: dict, device_type: str, local_gpus=None) -> list:
    """The GPU of each rank of ``places`` (None on CPU).

    Among the GPUs its engine's host reports in ``where``, or with ``local_gpus`` (engines on
    this machine) among those.
    """
    if device_type != "cuda":
        return [None] * len(places)
    return [_gpu_for(where[p["engine_id"]]["gpus"] if local_gpus is None else local_gpus, p["local_rank"])
            for p in places]


def local_world_sizes(places: list) -> list:
    """Per rank of ``places``: how many ranks its host runs (``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
    per_node = collections.Counter(p["node"] for p in places)
    return [per_node[p["node"]] for p in places]


def gpu_duplicates(places: list, where: dict, gpus: list) -> list:
    """Ranks of ``places`` given one GPU of one host (:func:`distnb.core.gpus.duplicates`); ``gpus``: :func:`rank_gpus`."""
    return duplicates(places, gpus, [where.get(p["engine_id"], {}) for p in places])


def check_gpus(places: list, where: dict, gpus: list, backend: str) -> None:
    """Before a group forms: a ClusterError when ``backend`` is nccl and two ranks would share a GPU (NCCL refuses
    it only at its communicator's init, "Duplicate GPU detected", after every rank waited for it)."""
    shared = gpu_duplicates(places, where, gpus) if backend == "nccl" else []
    if shared:
        raise ClusterError(duplicates_message(shared, backend))


def bind_among(places: list, spec, foreign_cores: float = 0.0) -> list:
    """Per rank of ``places``: how many ranks share its host's cores, each bound to its share; None where the
    rank is not bound. Not with ``--cpu-bind none`` nor GPU engines; with ``auto``, ranks on this host only
    while other processes use less than :data:`distnb.cluster.cpuload.AUTO_MAX_FOREIGN` cores (``foreign_cores``).
    Each engine binds itself: :mod:`distnb.engine.process.binding`."""

    if spec.cpu_bind == "none" or spec.device_type != "cpu":
        return [None] * len(places)
    per_node = collections.Counter(p["node_rank"] for p in places)
    here = spec.cpu_bind == "cores" or foreign_cores < AUTO_MAX_FOREIGN
    return [per_node[p["node_rank"]] if here or not p.get("local", True) else None for p in places]


def fit_to_hosts(places: list, where: dict, spec, auto_device: bool = False):
    """Engines on other hosts: share each host's cores among its ranks, and check or pick the device.

    Sets ``num_threads`` in each of ``places``. Returns ``spec``, with cuda/nccl when
    ``auto_device`` and every rank's host has a GPU for it, else cpu/gloo. Raises ClusterError
    when ``--backend nccl`` leaves a rank without a GPU.
    """
    per_node = {}
    for p in places:
        per_node[p["node_rank"]] = per_node.get(p["node_rank"], 0) + 1
    for p in places:
        p["num_threads"] = max(1, where[p["engine_id"]]["cores"] // per_node[p["node_rank"]])
    gpus = rank_gpus(places, where, "cuda")
    shared = gpu_duplicates(places, where, gpus)
    if spec.backend == "nccl" and shared:
        raise ClusterError(duplicates_message(shared, "nccl"))
    if spec.backend == "nccl" and not all(gpus):
        short = next(p for p, gpu in zip(places, gpus) if not gpu)
        raise ClusterError(f"--backend nccl needs a GPU for every rank, and host {short['node']} has none "
                           f"for local rank {short['local_rank']} (it sees "
                           f"{len(where[short['engine_id']]['gpus'])} GPUs); use --backend gloo, "
                           "or fewer --engines-per-node")
    if auto_device:  # no --backend: nccl when every rank's host has a GPU of its own for it
        device, backend = ("cuda", "nccl") if all(gpus) and not shared else ("cpu", "gloo")
        return dataclasses.replace(spec, device_type=device, backend=backend)
    return spec


def check_addresses(spec, remote: bool) -> None:
    """ClusterError when ``--interface`` or ``--master-addr`` cannot serve, or ``--master-port`` is taken.

    With engines on other hosts, neither may be loopback (``--master-addr`` may, with one
    host); a pinned port is checked here when rank 0 runs on this machine.
    """
    if remote and spec.interface and is_loopback(interface_address(spec.interface) or "x"):
        raise ClusterError(f"--interface {spec.interface} is loopback: engines on other hosts can reach neither "
                           "the controller nor rank 0 over it; name the network the hosts share (e.g. eth0)")
    if spec.master_addr is not None:
        try:
            socket.getaddrinfo(spec.master_addr, None)
        except OSError as exc:
            raise ClusterError(f"--master-addr {spec.master_addr}: not an address ({exc.strerror})") from None
        if remote and is_loopback(spec.master_addr) and len(spec.hosts) != 1:
            raise ClusterError(f"--master-addr {spec.master_addr} is loopback: ranks on other hosts cannot "
                               "reach it; give rank 0's address on the network the hosts share")
    if spec.master_port is not None and not remote:  # a pinned port that is taken: say so now
        check_port_free(spec.master_port, spec.master_addr or "127.0.0.1")
