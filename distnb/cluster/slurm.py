"""What Slurm says about distnb's engine job: its state, why it waits or ended, and sbatch's errors.

``%dist start --launcher slurm`` submits one batch job whose ``srun`` starts every engine
(:func:`distnb.cluster.placement.slurm_template`, :class:`distnb.cluster.launchers._SlurmEngineSetLauncher`).
This module asks Slurm's own commands about that job, in the kernel:

- while the engines are awaited, whether the job still waits in the queue and why
  (:func:`job_info`, squeue's reason: ``job 12 pending: Resources``), or ended before they
  registered;
- after an engine stopped answering, what Slurm did to the job or its node (:func:`why_gone`:
  its time limit, a node that is down, a cancel);
- when ``sbatch`` refuses the job, which option it refused (:func:`submit_error`: a partition
  that does not exist, more nodes than the partition has, an account or time limit it will not
  take, or no slurmctld to ask), with what the cluster has (``sinfo``).

Commands are found on PATH and read ``SLURM_CONF`` as Slurm's tools do; each call is bounded
(:data:`COMMAND_TIMEOUT`). Stdlib only.
"""

from __future__ import annotations

import re
import subprocess
import time

from distnb.core.errors import ClusterError

#: Seconds any one Slurm command may take (sbatch retries an unreachable slurmctld for MessageTimeout).
COMMAND_TIMEOUT = 60.0
#: Job states in which the job holds no more processes (squeue's long names).
ENDED = frozenset(("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "TIMEOUT", "SPECIAL_EXIT"))


class SubmitError(Exception):
    """``sbatch`` refused the job (or could not reach slurmctld): its command, exit status and stderr."""

    def __init__(self, command, returncode, stderr):
        self.command, self.returncode, self.stderr = list(command), returncode, (stderr or "").strip()
        super().__init__(f"{' '.join(self.command)} exited with status {returncode}: {self.stderr}")


def run(args, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    """Run a Slurm command (a list), text output captured; a missing command is exit status 127."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return subprocess.CompletedProcess(args, 127, "", f"{args[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"{args[0]} did not answer within {timeout:.0f} s")


def parse_job(text: str) -> dict:
    """The fields of one ``scontrol -o show job`` line that distnb reads.

    Returns
    -------
    dict
        ``state`` (``PENDING``, ``RUNNING``, ``TIMEOUT``, ...: the first word of JobState),
        ``reason`` (squeue's reason: ``Resources``, ``PartitionDown``, ``None``), ``nodes``
        (NodeList, ``(null)`` while pending), ``time_limit`` (TimeLimit, ``1:00`` or
        ``UNLIMITED``), ``partition``; a key is missing when the line lacks it.
    """
    out = {}
    for key, name in (("JobState", "state"), ("Reason", "reason"), ("NodeList", "nodes"),
                      ("TimeLimit", "time_limit"), ("Partition", "partition")):
        m = re.search(rf"(?:^|\s){key}=(\S*)", text)
        if m:
            out[name] = m.group(1)
    if "state" in out:
        out["state"] = out["state"].split("+")[0]
    return out


def job_info(job_id) -> dict | None:
    """Slurm's view of job ``job_id`` (:func:`parse_job`), or None once Slurm has forgotten it."""
    p = run(["scontrol", "-o", "show", "job", str(job_id)], timeout=15)
    if p.returncode or "JobId=" not in p.stdout:
        return None
    return parse_job(p.stdout)


def pending_note(job_id, info: dict) -> str:
    """``job 12 pending: Resources`` (squeue's reason, with what it means for the common ones)."""
    reason = info.get("reason") or "None"
    hint = _REASONS.get(reason, "")
    return f"job {job_id} pending: {reason}" + (f" ({hint})" if hint else "")


_REASONS = {
    "Resources": "waiting for nodes to be free",
    "Priority": "other jobs come first",
    "PartitionDown": "the partition is down",
    "PartitionNodeLimit": "more nodes than the partition allows",
    "PartitionTimeLimit": "--time beyond the partition's limit",
    "ReqNodeNotAvail": "a node it needs is unavailable",
    "BeginTime": "not before its start time",
    "Dependency": "waiting for another job",
}


def listed(job_id) -> bool:
    """Whether ``squeue`` lists job ``job_id`` (pending, running, completing, ...: holding a place or processes)."""
    p = run(["squeue", "-h", "-j", str(job_id), "-t", LIVE, "-o", "%T"], timeout=15)
    return p.returncode == 0 and bool(p.stdout.strip())


#: squeue's states of a job that still waits or holds processes (its default listing).
LIVE = "PENDING,RUNNING,SUSPENDED,COMPLETING,CONFIGURING,REQUEUED,RESIZING,SIGNALING,STAGE_OUT"


#: Pending reasons that do not pass with time: the request itself cannot be met.
NEVER = {
    "PartitionConfig": "more nodes or CPUs than the partition has: fewer --nodes or --engines-per-node",
    "BadConstraints": "no node has what the job asks for",
    "InvalidAccount": "check --account",
    "InvalidQOS": "the QOS is not allowed",
}


def wait_gone(job_id, timeout: float = 20.0) -> bool:
    """Wait until ``squeue`` no longer lists job ``job_id``; whether that happened within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while listed(job_id):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def node_state(name: str) -> tuple[str, str] | None:
    """``(state, reason)`` of Slurm node ``name`` (``('down', 'Not responding')``), or None if not a node."""
    p = run(["sinfo", "-h", "-N", "-n", name, "-o", "%T|%E"], timeout=15)
    line = p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else ""
    if not line:
        return None
    state, _, reason = line.partition("|")
    return state.rstrip("*~#!%$@^-"), (reason if reason != "none" else "")


def why_gone(job_id, time_limit: str | None, hosts=()) -> str:
    """What Slurm did to the job (or its nodes) when its engines stopped answering; "" if nothing is known.

    ``hosts``: the host names of the engines that stopped (Slurm node names, as ``hostname``
    says on the node).
    """
    info = job_info(job_id)
    deadline = time.monotonic() + 3.0
    while (info or {}).get("state") == "COMPLETING" and info.get("reason") not in _ENDED_BY:
        if time.monotonic() > deadline:  # its processes are being killed: the final state comes after
            break
        time.sleep(0.2)
        info = job_info(job_id)
    state = (info or {}).get("state")
    state = _ENDED_BY.get((info or {}).get("reason"), state) if state == "COMPLETING" else state
    down = []
    for host in dict.fromkeys(hosts):
        node = node_state(host)
        if node and node[0].startswith(("down", "drain", "fail")):
            down.append(f"node {host} is {node[0]}" + (f" ({node[1]})" if node[1] else ""))
    said = []
    if state == "TIMEOUT":
        limit = time_limit or (info or {}).get("time_limit") or "?"
        said.append(f"Slurm job {job_id} reached its time limit (--time {limit}) and was killed")
    elif state == "NODE_FAIL":
        said.append(f"Slurm job {job_id} was ended by a node failure")
    elif state in ENDED:
        said.append(f"Slurm job {job_id} ended: {state}")
    elif info is None:
        said.append(f"Slurm no longer knows job {job_id}")
    return "; ".join(said + down)


#: What a completing job's Reason says it ended by (scontrol shows JobState=COMPLETING until its
#: processes are gone, the final state only after).
_ENDED_BY = {"TimeLimit": "TIMEOUT", "NodeDown": "NODE_FAIL"}


def partitions() -> dict:
    """{partition: node count} from ``sinfo`` (hidden partitions too; empty when it cannot tell)."""
    p = run(["sinfo", "-a", "-h", "-o", "%R %D"], timeout=15)
    out = {}
    for line in p.stdout.splitlines() if p.returncode == 0 else ():
        name, _, count = line.strip().partition(" ")
        if name and count.strip().isdigit():
            out[name] = out.get(name, 0) + int(count)
    return out


def default_partition() -> str | None:
    """The partition a job without ``--partition`` goes to (``sinfo`` marks it with ``*``), if any."""
    p = run(["sinfo", "-a", "-h", "-o", "%P"], timeout=15)
    return next((ln.strip()[:-1] for ln in p.stdout.splitlines() if ln.strip().endswith("*")), None) \
        if p.returncode == 0 else None


def check_request(spec) -> str:
    """Before submitting: why the job could never start here ("" when sinfo sees no reason).

    Slurm accepts by default (without ``EnforcePartLimits``) a job that asks for a partition's
    nodes beyond what it has, and keeps it pending for ever (reason ``PartitionConfig``).
    """
    counts = partitions()
    if not counts:
        return ""
    if spec.queue and spec.queue not in counts:
        return f"--partition {spec.queue}: Slurm has no such partition (it has: {', '.join(sorted(counts))})"
    part = spec.queue or default_partition()
    if spec.nodes and part in counts and spec.nodes > counts[part]:
        per = f" x --engines-per-node {spec.engines_per_node}" if spec.engines_per_node else ""
        return (f"--nodes {spec.nodes}{per} is more than Slurm can give (partition {part} has {counts[part]} "
                f"node{'s' if counts[part] != 1 else ''})")
    return ""


def submit_error(exc: SubmitError, spec) -> str:
    """The message for a job ``sbatch`` refused: the option (or daemon) at fault, what the cluster has.

    ``spec`` is the :class:`~distnb.core.plan.ClusterSpec` that was submitted; no job is queued
    when sbatch fails.
    """
    said = re.sub(r"^\w+: error: ", "", exc.stderr, flags=re.M).strip() or f"exit status {exc.returncode}"
    said = said.splitlines()[-1].replace("Batch job submission failed: ", "")
    text = exc.stderr.lower()
    if "unable to contact slurm controller" in text or "connection refused" in text or "connect failure" in text:
        return (f"{exc.command[0]} could not reach slurmctld, the Slurm controller ({said}): is slurmctld running, and does "
                "this machine reach it (SLURM_CONF, SlurmctldHost)? no job was submitted")
    if "invalid partition" in text:
        have = ", ".join(sorted(partitions())) or "none that sinfo lists"
        return f"--partition {spec.queue}: Slurm has no such partition (it has: {have}); no job was submitted"
    if "node count" in text or "node configuration is not available" in text or "more processors" in text:
        counts = partitions()
        part = spec.queue or next((p for p in counts if p), None)
        has = f"partition {part} has {counts[part]} nodes" if part in counts else "the cluster has fewer"
        asked = f"--nodes {spec.nodes}" if spec.nodes else f"-n {spec.num_engines}"
        per = f" x --engines-per-node {spec.engines_per_node}" if spec.engines_per_node else ""
        return f"{asked}{per} is more than Slurm can give ({has}; sbatch: {said}); no job was submitted"
    if "time limit" in text or "--time" in text:
        return f"--time {spec.time_limit}: sbatch refused it ({said}); no job was submitted"
    if "account" in text:
        return f"--account {spec.account}: sbatch refused it ({said}); no job was submitted"
    return f"sbatch refused the engines' job: {said}; no job was submitted"


def controller_address() -> str | None:
    """The address of slurmctld (``SlurmctldHost``) as ``scontrol show config`` says; None if it does not say.

    Raises
    ------
    SubmitError
        When scontrol cannot reach slurmctld (nothing could be submitted either).
    """
    p = run(["scontrol", "show", "config"], timeout=COMMAND_TIMEOUT)
    if p.returncode and "slurm controller" in p.stderr.lower():
        raise SubmitError(p.args, p.returncode, p.stderr)
    m = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", p.stdout, re.M) if p.returncode == 0 \
        else None
    if not m:
        return None
    return m.group(2) or m.group(1)


class QueueWatch:
    """While the engines are awaited: say why the job waits, and fail at once if it ended without them.

    Parameters
    ----------
    job_id : str
        The engines' batch job.
    say : callable or None
        Prints a line into the cell (None: quiet).
    output_file : str or None
        The job's output file, quoted when the job ended before its engines registered.
    every : float
        Seconds between two looks at the queue.
    """

    def __init__(self, job_id, say=None, output_file=None, every=2.0):
        self.job_id, self.say, self.output_file, self.every = job_id, say, output_file, every
        self.next_look = 0.0
        self.last = None  # the last note said (a change of reason is said again)
        self.info = None

    def check(self) -> None:
        """Look at the queue (at most every ``every`` s); ClusterError when the job ended."""

        if time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + self.every
        self.info = info = job_info(self.job_id)
        state = (info or {}).get("state")
        if state == "PENDING" and info.get("reason") in NEVER:
            raise ClusterError(f"{pending_note(self.job_id, info)}: Slurm will not start it as asked "
                               f"({NEVER[info['reason']]}); cancelled")
        if state == "PENDING":
            note = pending_note(self.job_id, info)
            if note != self.last and self.say is not None:
                self.say(f"distnb: {note}; waiting (interrupt to cancel it)")
            self.last = note
            return
        self.last = None
        if info is None or state in ENDED:
            how = f"ended ({state})" if state else "is no longer known to Slurm"
            raise ClusterError(f"Slurm job {self.job_id} {how} before its engines registered" + self._output())

    def _output(self) -> str:
        try:
            with open(self.output_file, errors="replace") as f:
                lines = [ln.rstrip() for ln in f.read().splitlines() if ln.strip()]
        except (OSError, TypeError):
            return ""
        return f"; its output ({self.output_file}):\n" + "\n".join(lines[-12:]) if lines else ""

    def summary(self) -> str:
        """``job 12 still pending: Resources`` while the job waits in the queue (else "")."""
        return self.last.replace("pending", "still pending", 1) if self.last else ""
