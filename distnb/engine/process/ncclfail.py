"""One rank's failure on nccl: the others' communicators are aborted, not left to NCCL's watchdog (review, finding 1).

On gloo a failing rank's peers are freed by shutting their connections (:mod:`distnb.engine.process.abort`).
NCCL has no socket to shut: its collectives are queued on a CUDA stream, and a peer of a failed rank
runs on until its next host synchronisation (``loss.item()``, ``torch.cuda.synchronize()``), where it
blocks in a CUDA call with the GIL released, deaf to SIGINT. torch's default
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) then takes the whole process down at the group's timeout, and
every engine dies with it. What is done instead:

- :data:`ENV`, set in every nccl engine before its group forms (:func:`set_env`; a value the user set
  stays): ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (at a timeout NCCL's watchdog aborts the communicators
  and keeps the process: the blocked call returns, the next one raises, the cell fails and the group is
  re-formed), and ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (NCCL's flight recorder, which :func:`pending` reads
  for ``%dist where``).
- The group's store is armed on nccl too (:func:`distnb.engine.process.abort.arm`): a failing rank announces
  itself there, and every other rank's watchdog thread, which runs while the main thread waits in CUDA,
  calls :func:`abort_groups` (``distributed_c10d._abort_process_group``: every communicator aborted at
  once, inside one ``ncclGroupStart/End``, pytorch#119797), so its blocked call returns within a look
  (:data:`distnb.engine.process.where.INTERVAL`), not at ``--timeout``.
- A failed rank aborts rather than destroys (:func:`distnb.engine.process.runtime.mark_broken`): NCCL's
  ``destroy_process_group`` finalises the communicators, a flush that waits for the peers and hangs
  when one is gone (pytorch#141510, #132696).

torch APIs used (all in torch 2.11 and 2.13): ``distributed_c10d._abort_process_group`` (since 2.5, pytorch#132291),
``torch._C._distributed_c10d._dump_nccl_trace`` (CUDA builds, since 2.4; looked up, never assumed).
Nothing here can run without a GPU; tests/gpu/REVIEW-ANSWERS.md lists what a 2-GPU machine must show.
"""

from __future__ import annotations

import pickle
import threading

#: The environment of an nccl engine (set before its group forms, unless the user set it).
ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
#: One abort at a time: the watchdog thread's (a peer's failure) and the cell's own (mark_broken) may meet.
_LOCK = threading.Lock()


def set_env(environ) -> dict:
    """Set :data:`ENV` in ``environ`` where the user did not; returns what ``environ`` holds of it now."""
    for key, value in ENV.items():
        environ.setdefault(key, value)
    return {key: environ[key] for key in ENV}


def abort_groups() -> bool:
    """Abort every process group of this process (nccl: its communicators, at once); True if it did.

    Called from the watchdog thread while the main thread may be blocked in a CUDA call or an NCCL
    collective: that call then returns with an error (the group's state is torch's to clear: after the
    abort it knows no group, and the kernel forms a new one). Never raises.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    with _LOCK:
        if not dist.is_initialized():
            return False
        aborter = getattr(c10d, "_abort_process_group", None)
        try:
            if aborter is not None:
                aborter()
            else:  # a torch without it: shut the communicators down as destroy does
                dist.destroy_process_group()
        except Exception:
            return False
        return True


def pending(limit: int = 1) -> list:
    """NCCL's flight recorder: the oldest collectives this rank queued that have not completed.

    Returns
    -------
    list of dict
        Up to ``limit`` entries, oldest first: ``op`` (``"nccl:all_reduce"``), ``seq`` (the group's collective
        sequence number), ``state`` (``"scheduled"``: queued, not started; ``"started"``: waiting for the
        peers), ``sizes`` (input shapes), ``group`` (its description). Empty when torch has no flight
        recorder (a CPU build, ``TORCH_NCCL_TRACE_BUFFER_SIZE`` 0) or nothing is pending.
    """
    try:
        import torch

        dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
        if dump is None:
            return []
        trace = pickle.loads(dump(includeCollectives=True, includeStackTraces=False, onlyActive=True))
    except Exception:
        return []
    return entries(trace, limit)


def entries(trace: dict, limit: int = 1) -> list:
    """:func:`pending`'s rows from an unpickled flight-recorder dump (its ``entries``, format 2.x)."""
    rows = []
    for entry in trace.get("entries", ()):
        if entry.get("state") == "completed" or entry.get("retired"):
            continue
        group = entry.get("process_group") or ("", "")
        rows.append(dict(op=entry.get("profiling_name", "?"), seq=entry.get("collective_seq_id"),
                         state=entry.get("state"), sizes=entry.get("input_sizes"),
                         group=group[1] if isinstance(group, (tuple, list)) and len(group) > 1 else str(group)))
    rows.sort(key=lambda r: (r["seq"] is None, r["seq"] or 0))
    return rows[:limit]


def describe(row: dict) -> str:
    """``nccl:all_reduce #42 (started, waiting for the peers)`` for a :func:`pending` row."""
    how = {"scheduled": "queued on the GPU, not started", "started": "started, waiting for the peers"}.get(
        row.get("state"), row.get("state") or "pending")
    return f"{row['op']} #{row['seq']} ({how})"
