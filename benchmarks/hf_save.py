"""Memory and time of ``%dist save DIR --format safetensors`` against ``%dist save DIR`` (DCP) in the same run.

A Llama built on the meta device in the notebook (the kernel holds no weights) trains one SGD step under
fsdp on 2 ranks; then, alternating which goes first round by round, the same model is saved as a DCP
checkpoint (the reference: each rank writes its shard, nothing more) and as a Hugging Face folder (each
rank writes its shard with DCP's ``HuggingFaceStorageWriter``, then rank 0 consolidates the full tensors
one at a time). Figures per save: the kernel's peak resident memory above its RSS before the save
(``VmHWM`` reset through ``/proc/self/clear_refs``), each rank's the same way, and wall seconds.

Run: ``.venv/bin/python benchmarks/hf_save.py [--layers 8] [--rounds 3]`` (prints a table; ``--json FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # benchmarks/transformers.py is ours
sys.path.insert(0, os.path.dirname(HERE))
MIB = 2 ** 20

import torch  # noqa: E402
import transformers  # noqa: E402

import distnb  # noqa: E402

INIT = """
def hf_init(module):
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif hasattr(module, "variance_epsilon"):
        module.weight.fill_(1.0)
    elif hasattr(module, "inv_freq"):
        inv_freq, _ = module.compute_default_rope_parameters(module.config)
        module.inv_freq.copy_(inv_freq)
        module.original_inv_freq.copy_(inv_freq)
"""
RESET = ("_hf_rss = int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) * 1024\n"
         "_ = open('/proc/self/clear_refs', 'w').write('5')")
RISE = "_hf_rise = int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]) * 1024 - _hf_rss"


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def one_save(s, fmt: str, directory: str) -> dict:
    s.run(RESET)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    t0 = time.perf_counter()
    s.save(directory, model="net", format=fmt, quiet=True)
    seconds = time.perf_counter() - t0
    kernel = status("VmHWM") - before
    s.run(RISE)
    return dict(seconds=seconds, kernel=kernel, ranks=s.pull("_hf_rise"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=64)
    with torch.device("meta"):
        net = transformers.LlamaForCausalLM(config)
    size = sum(t.numel() * 4 for t in net.parameters())
    largest = max(t.numel() * 4 for t in net.parameters())
    ns = {"net": net, "tokens": torch.utils.data.TensorDataset(torch.randint(0, 32000, (4, 16)))}
    s = distnb.start(n=2, ns=ns, quiet=True, timeout=600)
    results = {"dcp": [], "safetensors": []}
    try:
        exec(INIT, ns)  # noqa: S102 - the notebook's --init function, defined as a notebook cell defines it
        ns["hf_init"].__module__ = "__main__"
        s.train("x = batch[0]\nloss = model(input_ids=x, labels=x).loss", "net", "tokens", strategy="fsdp",
                epochs=1, batch_size=2, optimizer="sgd", lr=1e-3, init="hf_init", quiet=True, progress="none")
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                order = ("dcp", "safetensors") if r % 2 == 0 else ("safetensors", "dcp")
                for fmt in order:
                    results[fmt].append(one_save(s, fmt, os.path.join(tmp, f"{fmt}{r}")))
    finally:
        s.stop(quiet=True)
    rows = {}
    for fmt, runs in results.items():
        rows[fmt] = dict(seconds=statistics.median(x["seconds"] for x in runs),
                         kernel_mib=statistics.median(x["kernel"] for x in runs) / MIB,
                         rank_mib=[statistics.median(x["ranks"][i] for x in runs) / MIB for i in range(2)])
    print(f"Llama on meta, {size / MIB:.0f} MiB fp32 (largest tensor {largest / MIB:.0f} MiB), fsdp on 2 ranks, "
          f"medians of {args.rounds} rounds")
    print("| save | seconds | kernel peak rise, MiB | rank 0 / rank 1 peak rise, MiB |")
    print("|---|---|---|---|")
    for fmt, row in rows.items():
        print(f"| {fmt} | {row['seconds']:.2f} | {row['kernel_mib']:.1f} | {row['rank_mib'][0]:.0f} / "
              f"{row['rank_mib'][1]:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(size=size, largest=largest, rows=rows, runs=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
