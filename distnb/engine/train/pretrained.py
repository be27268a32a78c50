"""Pretrained weights read on a rank (``--load PATH``): only the slices this rank holds, from its own host.

The model is distributed first (a meta model is materialised as its strategy places it), then
``torch.distributed.checkpoint.load`` fills this rank's state dict, DTensor shards included: for
safetensors through :class:`IndexedReader`, torch's ``HuggingFaceStorageReader`` (which reads each
request with safetensors' ``safe_open(...).get_slice``, so only the bytes of this rank's slice) over
the files and names the kernel found in the index; for a distnb checkpoint through DCP's own
``FileSystemReader``. DCP converts dtypes as it copies (a bf16 file into an fp32 model).

Before the collective load every rank checks that the files exist on its host with the sizes their
headers gave the kernel, and the ranks agree on the result (one ``all_gather_object``), so a path
the kernel sees and a rank does not is an error naming that rank and host, never a hang.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from distnb.core.plan import TrainPlan
from distnb.core.weightfiles import find
from distnb.engine.process import runtime
from distnb.engine.train import checkpoint, loop


class IndexedReader(HuggingFaceStorageReader):
    """torch's Hugging Face safetensors reader over the tensors the kernel found, not every file in the folder.

    Parameters
    ----------
    path : str
        The folder (or the single file) given to ``--load``.
    tensors : dict
        Stored name -> ``(file, dtype name, shape, first byte)``, from the index and the headers
        (:func:`distnb.train.pretrained.find`): a lone file, or an index naming a subset of the folder's
        files, reads exactly what it names.
    """

    def __init__(self, path: str, tensors: dict) -> None:
        super().__init__(os.path.dirname(path) if os.path.isfile(path) else path)
        self.tensors = tensors

    def _process_read_request(self, f, req, planner) -> None:
        """Rows ``a:b`` of a tensor into a contiguous target of the stored dtype (an fsdp shard, a pipeline
        stage's tensor, a ddp replica): read from the file straight into the target's memory, without
        safetensors' memory map (whose pages would count in this rank's resident set until the file closes).
        Any other slice: torch's reader (``get_slice``)."""
        file, dtype, shape, begin = self.tensors[req.storage_index.fqn]
        target = planner.resolve_tensor(req).detach()
        rows = all(o == 0 and n == full for o, n, full in zip(req.storage_offsets[1:], req.lengths[1:], shape[1:]))
        if not (rows and begin is not None and target.is_contiguous() and target.device.type == "cpu"
                and target.dtype == getattr(torch, dtype) and tuple(target.shape) == tuple(req.lengths)):
            return super()._process_read_request(f, req, planner)
        row_bytes = target.element_size() * (target[0].numel() if target.dim() else 1)
        view = memoryview(target.view(-1).view(torch.uint8).numpy()) if target.numel() else memoryview(b"")
        with open(file, "rb", buffering=0) as raw:
            raw.seek(begin + (req.storage_offsets[0] if target.dim() else 0) * row_bytes)
            done = 0
            while done < len(view):
                n = raw.readinto(view[done:])
                if not n:
                    raise RuntimeError(f"{file} ended {len(view) - done} bytes early while reading {req.storage_index.fqn}")
                done += n
        planner.commit_tensor(req, target)

    def read_metadata(self) -> Metadata:
        state, storage = {}, {}
        for key, (file, dtype, shape, _) in self.tensors.items():
            size, zero = torch.Size(shape), torch.Size([0] * len(shape))
            dtype = getattr(torch, dtype)
            state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=size,
                                               chunks=[ChunkStorageMetadata(offsets=zero, sizes=size)])
            storage[MetadataIndex(fqn=key, offset=zero)] = _HFStorageInfo(relative_path=file, shape=size, dtype=dtype)
        metadata = Metadata(state_dict_metadata=state, storage_data=storage)
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _unreadable(found: dict) -> str:
    """Why this rank cannot read ``found``'s files on its host ("" when it can)."""
    if not os.path.exists(found["path"]):
        return f"{found['path']} does not exist on this host"
    for file, size in found["sizes"].items():
        if not os.path.isfile(file):
            return f"{file} does not exist on this host"
        have = os.path.getsize(file)
        if have != size:
            return f"{file} has {have} bytes on this host, and its header says {size} (truncated or another file)"
    return ""


def _agree_readable(found: dict) -> None:
    """Every rank checks its files; all raise together, naming each rank that cannot read (never a hang)."""
    st = runtime.STATE
    why = _unreadable(found)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (st.rank, socket.gethostname(), why))
    bad = [f"rank {r} on {host}: {w}" for r, host, w in every if w]
    if bad:
        raise RuntimeError(f"rank {st.rank}: --load {found['path']} cannot be read by every rank ({'; '.join(bad)}); "
                           "the ranks read the files on their own hosts: put the folder where every host sees it "
                           "(a shared file system) or copy it to each host at the same path")


def stored_names(path: str) -> set:
    """The tensor names ``path`` holds, read on this rank's host: a distnb checkpoint's model entries (DCP's
    metadata), else the safetensors index and headers (:func:`distnb.core.weightfiles.find`)."""
    if os.path.isdir(path) and (os.path.exists(os.path.join(path, checkpoint.MARKER)) or checkpoint.latest(path)):
        metadata = dcp.FileSystemReader(checkpoint.read_meta(path)["path"]).read_metadata()
        return {k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")}
    return set(find(path)["tensors"])


def model_state(strategy) -> dict:
    """This rank's tensors by their original names (sharded ones as DTensors), as its checkpoints have them."""
    stage = getattr(strategy, "_stage_tensors", None)
    if stage is not None:  # a pipeline stage: its own tensors only
        return {k: v.detach() for k, v in stage().items() if not v.is_meta}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(strategy.module)


def _read(found: dict, state: dict) -> None:
    """``dcp.load`` of ``state`` (stored name -> this rank's tensor) from ``found``; a failure names the rank."""
    try:
        if found["kind"] == "dcp":
            dcp.load({"model": state}, storage_reader=dcp.FileSystemReader(found["path"]))
        else:
            dcp.load(state, storage_reader=IndexedReader(found["path"], found["tensors"]))
    except BaseException as exc:  # DCP's CheckpointException (a BaseException) wraps each rank's failure
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        failures = getattr(exc, "failures", None) or {}
        first = next(iter(failures.values()), exc)
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            first = first[0]
        reason = str(first).strip().splitlines()[-1] if str(first).strip() else type(first).__name__
        raise RuntimeError(f"rank {runtime.STATE.rank}: reading --load {found['path']} failed: {reason}") from None


def load_weights(ns, name, plan_dict, found, aliases):
    """Fill model ``name`` on this rank from ``found`` (:func:`distnb.train.pretrained.find`); every rank calls it.

    The model must have been sent for ``plan_dict`` just before, or be held distributed for it (a model the
    ranks trained). Afterwards it is live as a trained model is: saved (DCP, safetensors), pulled, and trained
    on by the next cell, with no optimizer until that cell makes one. ``aliases``: model name -> the stored
    name of the same tied tensor. Returns ``{"rank", "bytes"}``: the bytes this rank read.
    """
    plan = TrainPlan.from_dict(plan_dict)
    run = loop.RUNS[name]
    _agree_readable(found)
    # a whole model received (ddp) is distributed now, a placed one (meta) kept; the training cell keeps it
    loop.distribute(ns, plan, run)
    mine = model_state(run.strategy)
    state, copies = {}, []
    for key, tensor in mine.items():
        stored = aliases.get(key, key)
        if stored not in found["tensors"]:  # a peft adapter: the kernel's check let only these through
            continue
        if stored in state and state[stored] is not tensor:
            copies.append((tensor, state[stored]))  # one stored tensor, two on this rank: copied after reading
            continue
        state[stored] = tensor
    _read(found, state)
    with torch.no_grad():
        for tensor, source in copies:
            tensor.copy_(source)
    run.strategy.load_checkpoint_state(run.optimizer, mine, None)
    if run.plan_dict is None:  # distributed as the plan says: live as a trained model (save, pull, a next cell);
        run.plan_dict = plan.to_dict()  # a model the ranks trained keeps its cell's plan (its data seed, for a save)
    read = sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in state.values())
    return dict(rank=runtime.STATE.rank, bytes=read)
