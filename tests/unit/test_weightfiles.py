"""The kernel's checks of ``--load PATH`` (distnb/core/weightfiles.py): index and headers only, errors before training."""

import json
import os
import struct

import pytest
import torch

from distnb.core import weightfiles
from distnb.core.errors import PlanError
from support.hfmodels import build, save_sharded


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gpt2"))
    save_sharded(build("gpt2", seed=1), folder, num_files=3)
    return folder


def copy_folder(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_headers_give_every_tensor_and_the_tie_is_an_alias(gpt2_folder):
    model = build("gpt2", meta=True)
    found = weightfiles.find(gpt2_folder)
    assert found["kind"] == "safetensors" and len(set(f for f, *_ in found["tensors"].values())) >= 3
    assert found["tensors"]["transformer.wte.weight"][1:3] == ("float32", (64, 32))
    assert "lm_head.weight" not in found["tensors"]  # stored once
    matched = weightfiles.match(found, model, "net")
    assert matched == {"aliases": {"lm_head.weight": "transformer.wte.weight"}, "note": ""}


def test_kernel_reads_headers_only(gpt2_folder, monkeypatch):
    """Every read of a shard file is its 8-byte length and its header: never tensor data."""
    import builtins

    reads = []
    real_open = builtins.open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opening(file, mode="r", *args, **kw):
        f = real_open(file, mode, *args, **kw)
        return Counting(f) if str(file).endswith(".safetensors") else f

    files = [os.path.join(gpt2_folder, f) for f in os.listdir(gpt2_folder) if f.endswith(".safetensors")]
    headers = 0
    for file in files:
        with open(file, "rb") as f:
            headers += 8 + struct.unpack("<Q", f.read(8))[0]
    monkeypatch.setattr(builtins, "open", opening)
    weightfiles.find(gpt2_folder)
    assert len(reads) == 2 * len(files) and sum(reads) == headers  # the length and the header of each file
    assert headers < sum(os.path.getsize(f) for f in files) / 4


def test_another_architecture_names_the_keys_and_the_nearest(gpt2_folder):
    with pytest.raises(PlanError) as exc:
        weightfiles.match(weightfiles.find(gpt2_folder), build("llama", meta=True), "net")
    msg = str(exc.value)
    assert "a folder of another architecture (its config.json says GPT2LMHeadModel)" in msg
    assert "model.embed_tokens.weight" in msg and "transformer.h.0.attn.c_attn.weight" in msg
    assert "(nearest: " in msg


def test_other_sizes_are_named_with_both_shapes(gpt2_folder):
    import transformers

    from support.hfmodels import GPT2

    with torch.device("meta"):
        wider = transformers.GPT2LMHeadModel(transformers.GPT2Config(**dict(GPT2, n_embd=48)))
    with pytest.raises(PlanError, match=r"shapes differ: transformer.wte.weight: stored \[64, 32\], model \[64, 48\]"):
        weightfiles.match(weightfiles.find(gpt2_folder), wider, "net")


def test_truncated_shard_is_an_error_naming_the_file(gpt2_folder, tmp_path):
    folder = copy_folder(gpt2_folder, tmp_path / "cut")
    shard = os.path.join(folder, "model-00002-of-00005.safetensors")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(PlanError, match=rf"{shard} is truncated: its header describes {size} bytes and the file "
                                        rf"has {size - 100}"):
        weightfiles.find(folder)


def test_missing_index_entry_is_a_missing_tensor_with_its_nearest_names(gpt2_folder, tmp_path):
    folder = copy_folder(gpt2_folder, tmp_path / "noentry")
    index = os.path.join(folder, weightfiles.INDEX)
    with open(index) as f:
        data = json.load(f)
    del data["weight_map"]["transformer.h.1.mlp.c_fc.weight"]
    with open(index, "w") as f:
        json.dump(data, f)
    found = weightfiles.find(folder)
    assert "transformer.h.1.mlp.c_fc.weight" not in found["tensors"]  # the index decides what is read
    with pytest.raises(PlanError, match=r"1 of net's tensors are not in it: transformer.h.1.mlp.c_fc.weight "
                                        r"\(model-0000\d-of-00005.safetensors holds it, but model.safetensors."
                                        r"index.json has no entry for it"):
        weightfiles.match(found, build("gpt2", meta=True), "net")


def test_index_naming_an_absent_shard(gpt2_folder, tmp_path):
    folder = copy_folder(gpt2_folder, tmp_path / "absent")
    os.remove(os.path.join(folder, "model-00003-of-00005.safetensors"))
    with pytest.raises(PlanError, match=r"names model-00003-of-00005.safetensors, which .* does not hold"):
        weightfiles.find(folder)


def test_unexpected_tensor_and_dtype_note(tmp_path):
    from safetensors.torch import save_file

    net = torch.nn.Linear(4, 2)
    file = str(tmp_path / "w.safetensors")
    save_file({"weight": net.weight.detach().half(), "bias": net.bias.detach().half(), "biass": torch.zeros(2)}, file)
    with pytest.raises(PlanError, match=r"1 stored tensors are not in net: biass \(nearest: bias"):
        weightfiles.match(weightfiles.find(file), net, "net")
    save_file({"weight": net.weight.detach().half(), "bias": net.bias.detach().half()}, file)
    note = weightfiles.match(weightfiles.find(file), net, "net")["note"]
    assert note == f"distnb: --load {file}: 2 tensors stored as float16 become float32 (net's dtype)"


def test_not_a_weights_path(tmp_path):
    with pytest.raises(PlanError, match="no such file or folder on the kernel's host"):
        weightfiles.find(tmp_path / "nothing")
    with pytest.raises(PlanError, match="holds neither model.safetensors.index.json"):
        weightfiles.find(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(PlanError, match="is not a safetensors file"):
        weightfiles.find(tmp_path / "x.safetensors")
