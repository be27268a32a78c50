"""Memory of ``--load PATH`` into a meta model under fsdp on 2 ranks (issue 35): kernel flat, ranks at their share.

Model: ``L`` bias-free ``nn.Linear(D, D)`` in an ``nn.Sequential``, built on the meta device in the
kernel; its weights are written as a Hugging Face style sharded folder (``model-0000x-of-0000y.safetensors``
plus ``model.safetensors.index.json``; safetensors' ``save_file``), layers spread over ``--files`` files.
distnb sends the structure, the ranks place their FSDP shards (no init: the files fill them) and every
rank reads the slices it holds (``torch.distributed.checkpoint`` with the Hugging Face reader).

Figures: the kernel's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) above its
resident set before the load; each rank's the same, against its share (model / 2) plus one file's
largest tensor (one layer), the target. Wall time of the load as seen by the kernel.

Usage::

    .venv/bin/python benchmarks/load_memory.py [--layers 16] [--dim 4096] [--files 4] [--json PATH]

(16 x 4096 x 4096 fp32: 1 GiB.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

MIB = 2 ** 20

# the modules the load imports, imported before the window opens: their code is a fixed cost, not the model's
RANK_START = """
import safetensors, torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.tensor
import distnb.engine.train.pretrained, distnb.engine.strategies.fsdp
from distnb.engine.transport import peaks as _peaks
_peaks.start_cell()
_load_base = int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024
"""
RANK_END = "_load_peak = _peaks.host_peak()[0] - _load_base"


def write_folder(folder: str, layers: int, dim: int, files: int, seed: int = 0) -> dict:
    """The weights of ``layers`` Linear(dim, dim) written over ``files`` safetensors files; the weight_map."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    per_file = -(-layers // files)
    for f in range(files):
        name = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        part = {f"{i}.weight": torch.randn(dim, dim, generator=gen) for i in range(f * per_file,
                                                                                 min(layers, (f + 1) * per_file))}
        save_file(part, os.path.join(folder, name))
        weight_map.update({k: name for k in part})
        del part
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    return weight_map


def meta_model(layers: int, dim: int):
    import torch

    with torch.device("meta"):
        return torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def measure(session, name: str, model, folder: str) -> dict:
    """Load ``folder`` into the meta ``model`` (notebook name ``name``) under fsdp; the memory figures, bytes."""
    from distnb.train import kernel_memory, pretrained, training
    from distnb.core.plan import TrainPlan

    plan = TrainPlan(model=name, data=name, strategy="fsdp", load=os.path.abspath(folder))
    checked = pretrained.check(plan, model)
    session.run(RANK_START)
    since = kernel_memory.reset()
    kernel_base = kernel_memory.current()
    t0 = time.perf_counter()
    training.ensure_model(session, plan, model, quiet=True)
    pretrained.load_on_ranks(session, plan, checked, quiet=True)
    seconds = time.perf_counter() - t0
    kernel_growth = kernel_memory.peak(since)[0] - kernel_base
    session.run(RANK_END)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return dict(model=model_bytes, largest_tensor=largest, share=model_bytes // session.world_size,
                kernel_growth=kernel_growth, rank_peaks=session.pull("_load_peak"), seconds=seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import distnb

    with tempfile.TemporaryDirectory() as tmp:
        write_folder(tmp, args.layers, args.dim, args.files)
        session = distnb.start(n=2, quiet=True)
        try:
            model = meta_model(args.layers, args.dim)
            session.ns["big"] = model
            got = measure(session, "big", model, tmp)
        finally:
            session.stop(quiet=True)
    target = got["share"] + got["largest_tensor"]
    print(f"model {got['model'] / MIB:.0f} MiB in {args.files} files, largest tensor {got['largest_tensor'] / MIB:.0f} "
          f"MiB; load {got['seconds']:.1f} s")
    print(f"kernel peak above before: {got['kernel_growth'] / MIB:.1f} MiB (target < 64)")
    for rank, peak in enumerate(got["rank_peaks"]):
        print(f"rank {rank} peak above before: {peak / MIB:.1f} MiB (target < share + largest tensor = "
              f"{target / MIB:.0f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(got, layers=args.layers, dim=args.dim, files=args.files), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
