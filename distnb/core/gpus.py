"""GPUs: which a process can see and how that was found, which GPU each rank gets, and the device it names.

Stdlib only, shared by the kernel and the engines (an engine reports its GPUs before it is a rank,
:func:`distnb.core.net.whereami`, and lays out its own device at set-up, :func:`layout`). Nothing here
initialises CUDA or imports torch.

- :func:`discover`: ``CUDA_VISIBLE_DEVICES`` when set; else ``/proc/driver/nvidia/gpus``; else
  ``nvidia-smi -L`` (NVML, in a subprocess: a sandbox such as gVisor may have no
  ``/proc/driver/nvidia``, and distnb then started CPU engines without a word); else the
  ``/dev/nvidia<N>`` nodes. It says which of them answered (GPU review, finding 13).
- :func:`duplicates`: two ranks given one GPU (a one-GPU host with several engines); NCCL refuses
  such a communicator ("Duplicate GPU detected", NVIDIA/nccl#418), so it is checked before the group
  forms (finding 9).
- :func:`layout`: the ``CUDA_VISIBLE_DEVICES`` and device index of an engine such that
  ``cuda:<LOCAL_RANK>`` is its own GPU, as under torchrun, so library code that calls
  ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` works on every rank (finding 5).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

#: What :func:`discover` reads, in order.
SOURCES = ("CUDA_VISIBLE_DEVICES", "/proc/driver/nvidia/gpus", "nvidia-smi -L", "/dev/nvidia<N>")
#: Seconds ``nvidia-smi -L`` may take.
SMI_SECONDS = 10.0
_SMI_LINE = re.compile(r"^GPU (\d+):")
_DEV_NODE = re.compile(r"^nvidia(\d+)$")


def discover(env=None, proc: str = "/proc/driver/nvidia/gpus", dev: str = "/dev", smi: str | None = "nvidia-smi"):
    """The GPUs this process may use, and how they were found (no CUDA initialised, no torch).

    Parameters
    ----------
    env : mapping, optional
        The environment (default ``os.environ``).
    proc, dev, smi : str
        Where the driver's GPU list, the device nodes and ``nvidia-smi`` are (``smi=None``: not asked).

    Returns
    -------
    dict
        ``gpus`` (list of str: the ids ``CUDA_VISIBLE_DEVICES`` would name, in order), ``how`` (str: which
        of :data:`SOURCES` gave them, or ``"none"``).
    """
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return dict(gpus=[g.strip() for g in value.split(",") if g.strip() and g.strip() != "-1"],
                    how="CUDA_VISIBLE_DEVICES")
    try:
        found = sorted(os.listdir(proc))
    except OSError:
        found = []
    if found:
        return dict(gpus=[str(i) for i in range(len(found))], how=proc)
    smi_path = shutil.which(smi) if smi else None
    if smi_path:
        try:
            out = subprocess.run([smi_path, "-L"], capture_output=True, text=True, timeout=SMI_SECONDS).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        ids = [m.group(1) for m in map(_SMI_LINE.match, out.splitlines()) if m]
        if ids:
            return dict(gpus=ids, how="nvidia-smi -L")
    try:
        nodes = sorted(int(m.group(1)) for m in map(_DEV_NODE.match, os.listdir(dev)) if m)
    except OSError:
        nodes = []
    if nodes:
        return dict(gpus=[str(i) for i in range(len(nodes))], how="/dev/nvidia<N>")
    return dict(gpus=[], how="none")


def driver_present(dev: str = "/dev", smi: str | None = "nvidia-smi") -> bool:
    """Whether this machine shows an NVIDIA driver (``/dev/nvidiactl``, or ``nvidia-smi`` on the PATH)."""
    return os.path.exists(os.path.join(dev, "nvidiactl")) or bool(smi and shutil.which(smi))


def describe(found: dict) -> str:
    """``4 GPUs (found by nvidia-smi -L)``, or what was looked at when none was found."""
    n = len(found["gpus"])
    if n:
        return f"{n} GPU{'s' if n != 1 else ''} (found by {found['how']})"
    return "no GPU found (looked at " + ", ".join(SOURCES[1:]) + ")"


def host_wide(info: dict) -> bool:
    """Whether the GPU ids an engine reported (``info``: :func:`distnb.core.net.whereami`) name its host's GPUs.

    Not when a launcher narrowed the engine to GPUs of its own (Slurm's ``--gpus-per-task=1``, a
    ``CUDA_VISIBLE_DEVICES`` of one id per engine): two such engines may each call theirs ``0``.
    """
    return info.get("gpus_how", "CUDA_VISIBLE_DEVICES") != "CUDA_VISIBLE_DEVICES" or len(info.get("gpus", ())) > 1


def duplicates(places: list, gpus: list, infos: list) -> list:
    """Groups of ranks given the same GPU of the same host: ``[(node, gpu, [ranks])]``, empty when none.

    ``places``: :func:`distnb.cluster.placement.assign_ranks` entries (``node``); ``gpus``: each rank's GPU id
    (None: no GPU); ``infos``: what each rank's engine reported (``gpus``, ``gpus_how``; see
    :func:`host_wide`: ids that may name different GPUs on different engines are not compared).
    """
    seen = {}
    for rank, (p, gpu, info) in enumerate(zip(places, gpus, infos)):
        if gpu is None or not host_wide(info):
            continue
        seen.setdefault((p["node"], str(gpu)), []).append(rank)
    return [(node, gpu, ranks) for (node, gpu), ranks in seen.items() if len(ranks) > 1]


def duplicates_message(found: list, backend: str) -> str:
    """The error for :func:`duplicates`' groups: which ranks share which GPU, why that fails and the fix."""
    said = "; ".join(f"ranks {', '.join(map(str, ranks))} on {node} would all use GPU {gpu}"
                     for node, gpu, ranks in found)
    return (f"{said}: --backend {backend} needs a GPU of its own for every rank (NCCL refuses a communicator with two "
            "ranks on one GPU: 'Duplicate GPU detected'). Start at most one engine per GPU on each host "
            "(--engines-per-node, -n), or use --backend gloo")


def layout(visible: list, gpu: str, local_rank: int) -> tuple[list, int]:
    """``(CUDA_VISIBLE_DEVICES ids, device index)`` for an engine of local rank ``local_rank`` given ``gpu``.

    Its GPU is put at position ``local_rank`` of what it sees (the others keep their order), so that
    ``cuda:<local_rank>`` is its own GPU, as under torchrun, where every process sees the host's GPUs
    and ``LOCAL_RANK`` indexes them. When it sees fewer GPUs than that (a launcher gave it its own),
    it sees ``gpu`` alone, as ``cuda:0``.

    Parameters
    ----------
    visible : list of str
        The GPU ids the engine may use (:func:`discover`).
    gpu : str
        The GPU the kernel gave this rank (one of ``visible``).
    local_rank : int
        This rank's index on its host.
    """
    visible = [str(g) for g in visible]
    gpu = str(gpu)
    if gpu not in visible or local_rank >= len(visible):
        return [gpu], 0
    order = list(visible)
    i = order.index(gpu)
    order[i], order[local_rank] = order[local_rank], order[i]
    return order, local_rank
