"""engine/hfwriter.py without a process group: the files it streams are the ones torch's writer makes, and a
rank's part missing on rank 0's host (no shared file system) is an error naming the rank, never a short tensor."""

import json
import struct

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from distnb.engine.train import hfwriter


def _result(name):
    return WriteResult(index=MetadataIndex("w"), size_in_bytes=4, storage_data=_StorageInfo(name, 0, 4))


def test_a_part_missing_on_rank_0s_host_names_its_rank(tmp_path):
    writer = hfwriter.StreamingHuggingFaceWriter(str(tmp_path), save_distributed=True, enable_consolidation=True)
    (tmp_path / "sharded").mkdir(exist_ok=True)
    (tmp_path / "sharded" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"")
    results = [[_result("shard-00001-model-00001-of-00001.safetensors")],
               [_result("shard-00002-model-00001-of-00001.safetensors")]]
    with pytest.raises(RuntimeError, match="does not hold rank 1's shard-00002-model-00001-of-00001.safetensors on "
                                           "rank 0's host.*every rank shares"):
        writer.finish(None, results)


class _Planner:
    def __init__(self, tensors):
        self.tensors = tensors

    def resolve_data(self, item):
        return self.tensors[item.index.fqn]


def test_streamed_file_reads_back_with_dcps_offsets(tmp_path):
    from safetensors import safe_open
    from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.float32).to(torch.bfloat16), "c": torch.ones(0)}
    items = [_create_write_item_for_tensor(k, t) for k, t in tensors.items()]
    results = hfwriter.write_file(str(tmp_path / "f.safetensors"), "f.safetensors", items, _Planner(tensors))
    assert [r.size_in_bytes for r in results] == [60, 14, 0]
    with safe_open(str(tmp_path / "f.safetensors"), "pt") as f:
        for key, t in tensors.items():
            assert torch.equal(f.get_tensor(key), t)
        sharding = json.loads(f.metadata()["DCP_SHARDING_INFO"])
    assert sharding["a"] == {"saved_offsets": [0, 0]}
    header_len = struct.unpack("<Q", (tmp_path / "f.safetensors").read_bytes()[:8])[0]
    assert header_len % 8 == 0
