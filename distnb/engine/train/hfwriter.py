"""DCP's ``HuggingFaceStorageWriter``, writing each rank's files one tensor at a time.

torch 2.13's writer (``FileSystemWriter`` with the safetensors format) collects every tensor of a file
and serialises them with ``safetensors.torch.save`` into one ``bytes`` object before writing it: a rank
then holds its whole part of the file twice more (measured: a rank's peak rose by twice its fsdp shard of
a 446 MiB Llama, benchmarks/hf_save.py). :class:`StreamingHuggingFaceWriter` writes the same files (the
same header with DCP's sharding metadata, so the writer's own consolidation reads them) from the write
items' sizes and dtypes first, then each tensor's bytes straight from this rank's chunk, so a rank holds
at most one tensor more than its share (a copy only where the chunk is not contiguous or not on the CPU).
Everything else (planning, de-duplication of replicas, the index, consolidation into full tensors) is
torch's.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import (
    CUSTOM_METADATA_KEY,
    DCP_VERSION_KEY,
    DTYPE_MAP,
    FORMAT_KEY,
    FORMAT_VALUE,
    HF_DCP_VERSION,
    SAVED_OFFSETS_KEY,
    _gen_file_name,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

#: safetensors' dtype names of the dtypes the consolidation can read (floats: it sizes elements with finfo).
DTYPE_NAMES = {dtype: name for name, dtype in DTYPE_MAP.items() if dtype.is_floating_point}


class StreamingHuggingFaceWriter(HuggingFaceStorageWriter):
    """``HuggingFaceStorageWriter`` (same arguments, same files) that streams each tensor to its file."""

    def write_data(self, plan, planner) -> Future:
        """``HuggingFaceStorageWriter.write_data`` (the same file names and buckets), each file by :func:`write_file`."""
        storage = plan.storage_data or {}
        mapping = storage.get("fqn_to_index_mapping")
        highest = max(mapping.values()) if mapping is not None else 1
        results = []
        if plan.items:
            for index, items in self._split_by_storage_plan(mapping, plan.items).items():
                name = _gen_file_name(index, highest, storage.get("shard_index"))
                results += write_file(str(self.fs.concat_path(self.path, name)), name, items, planner)
        done: Future = Future()
        done.set_result(results)
        return done


    def finish(self, metadata, results) -> None:
        """Check that every rank's files are here (rank 0 runs this), then consolidate them (torch's).

        Consolidation reads what it finds: a part written on another host's disk would be left out, the
        tensor then short or holed without a word. So a missing file is an error naming its rank.
        """
        folder = str(self.path)
        missing = [f"rank {rank}'s {r.storage_data.relative_path}" for rank, written in enumerate(results)
                   for r in written if not os.path.exists(os.path.join(folder, r.storage_data.relative_path))]
        if missing:
            raise RuntimeError(f"{folder} does not hold " + ", ".join(sorted(set(missing))[:4]) + " on rank 0's host: "
                               "the ranks are on hosts that do not share this folder; save to a folder on a file "
                               "system every rank shares (or save with --format dcp, each rank its own part)")
        return super().finish(metadata, results)


def _header(items) -> bytes:
    """The safetensors header of ``items`` (this rank's chunks, in order), DCP's offsets in ``__metadata__``."""
    header, offsets, pos = {}, {}, 0
    for item in items:
        chunk, dtype = item.tensor_data.chunk, item.tensor_data.properties.dtype
        length = math.prod(chunk.sizes) * dtype.itemsize
        header[item.index.fqn] = {"dtype": DTYPE_NAMES[dtype], "shape": list(chunk.sizes),
                                  "data_offsets": [pos, pos + length]}
        offsets[item.index.fqn] = {SAVED_OFFSETS_KEY: list(chunk.offsets)}
        pos += length
    header["__metadata__"] = {CUSTOM_METADATA_KEY: json.dumps(offsets), DCP_VERSION_KEY: str(HF_DCP_VERSION),
                              FORMAT_KEY: FORMAT_VALUE}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes


def write_file(path: str, name: str, items, planner) -> list:
    """Write ``items`` (tensor write items of one file) to ``path``, one tensor at a time; their WriteResults.

    Raises
    ------
    RuntimeError
        An item is not a tensor, or the same name comes twice in one file (a layout this format cannot hold).
    """
    if any(item.type == WriteItemType.BYTE_IO for item in items):
        raise RuntimeError("a safetensors folder holds tensors only; the model's state dict has other entries")
    names = [item.index.fqn for item in items]
    if len(set(names)) != len(names):
        raise RuntimeError(f"{path}: a tensor in several chunks on one rank cannot go in one safetensors file")
    header = _header(items)
    results = []
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for item in items:
            t = planner.resolve_data(item).detach()
            t = t.to("cpu").contiguous()  # no copy for a contiguous chunk on the CPU
            offset = f.tell()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            length = f.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(relative_path=name, offset=offset, length=length)))
            del t
        f.flush()
        os.fsync(f.fileno())
    return results
