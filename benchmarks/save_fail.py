"""A ``%dist save`` into a folder the ranks cannot write, and a good one: seconds, with the distnb on PYTHONPATH.

A meta model (``Linear(12, 16), Tanh, Linear(16, 3)``) trained one cell under fsdp on a real 2-rank world, then
saved ROUNDS times as safetensors to good folders (the median) and once below a file (the failure: before the
ranks were asked first, the ranks failed and the group was re-formed, losing the model; now the kernel names
the ranks and nothing fails on them). Run it once per tree to compare, e.g. main's files unpacked elsewhere.

Usage: ``cd TREE && PYTHONPATH=$PWD python benchmarks/save_fail.py [ROUNDS]`` (TREE: the root whose distnb runs;
the engines import it from their working folder, so run it from there).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 21


def main() -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from distnb import session

    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    shell.run_line_magic("load_ext", "distnb")
    shell.run_line_magic("dist", "start -n 2 --timeout 30")
    s, ns = session.current(), shell.user_ns
    torch.manual_seed(7)
    with torch.device("meta"):
        ns["net"] = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    ns["data"] = torch.utils.data.TensorDataset(torch.randn(203, 12), torch.randint(0, 3, (203,)))
    ns["F"] = F
    s.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", model="net", data="data", epochs=1, batch_size=16,
            optimizer="sgd", lr=0.1, strategy="fsdp", progress="none", quiet=True)
    scratch = tempfile.mkdtemp(prefix="save-fail-bench-")
    open(os.path.join(scratch, "a_file"), "w").close()
    good, ranks = [], []
    for i in range(ROUNDS):
        t0 = time.perf_counter()
        ranks.append(s.save(os.path.join(scratch, f"ok{i}"), format="safetensors", quiet=True)["seconds"])
        good.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    try:
        s.save(os.path.join(scratch, "a_file", "out"), format="safetensors", quiet=True)
    except Exception as exc:
        failed, error = time.perf_counter() - t0, type(exc).__name__
    print(f"good save: median {statistics.median(good) * 1e3:.1f} ms of {ROUNDS} (rank 0's write "
          f"{statistics.median(ranks) * 1e3:.1f} ms); failed save: {failed * 1e3:.1f} ms "
          f"({error})", flush=True)
    s.stop(quiet=True)


if __name__ == "__main__":
    main()
