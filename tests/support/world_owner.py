"""A first kernel for the attach tests (issue 38): it starts a world, starts a background training run,
says so on stdout, then waits for orders on stdin.

Run as ``python -m support.world_owner EPOCHS SLEEP GATE`` from tests/ (PYTHONPATH with distnb). Prints one JSON line
``{"cluster_id": ..., "record": path}`` once the run trains, then for each stdin line: ``exit`` ends it (the
session's atexit stop, bounded), ``weights`` prints rank 0's live weights' checksum.
"""

from __future__ import annotations

import json
import sys

import distnb
from distnb import session as sessions
from distnb.cluster import worlds
from support.data import blobs, mlp

#: A step: slow (``SLEEP`` seconds) until the file GATE exists, so the run trains while a test attaches.
BODY = ("import os, time\nimport torch\nif not os.path.exists({gate!r}):\n    time.sleep({sleep})\nx, y = batch\n"
        "loss = torch.nn.functional.cross_entropy(model(x), y)")


def main(argv) -> int:
    epochs, sleep, gate = int(argv[0]), float(argv[1]), argv[2]
    ns = {"net": mlp(12, 16, 3, seed=1), "train": blobs(64, seed=0)}
    s = distnb.start(n=2, ns=ns, timeout=30, quiet=True)
    s.train(BODY.format(sleep=sleep, gate=gate), model="net", data="train", epochs=epochs, batch_size=8, optimizer="sgd",
            lr=0.1, background=True, quiet=True, progress="text")
    cid = s.cluster._ipp.cluster_id
    print(json.dumps({"cluster_id": cid, "record": worlds.record_path(cid)}), flush=True)
    for line in sys.stdin:
        order = line.strip()
        if order == "exit":
            break
        if order == "running":
            print(json.dumps({"running": sessions._CURRENT is not None and sessions._CURRENT.running}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
