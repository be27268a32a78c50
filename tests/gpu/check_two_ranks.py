"""The GPU kit's checks for two ranks sharing the one GPU over gloo (``CUDA_VISIBLE_DEVICES=0,0 --backend gloo``).

    python tests/gpu/check_two_ranks.py          # on a one-GPU machine: two engines on cuda:0, gloo
    python tests/gpu/check_two_ranks.py --cpu    # two CPU ranks, gloo (to test this script)

NCCL refuses two ranks on one GPU, but gloo stages CUDA tensors through the host: this exercises
distnb's CUDA-tensor paths across ranks (the weights back, the grow's broadcast, a peer's failure
with distnb's gloo machinery), not NCCL. Each check writes ``$OUT/checks/gpu2.<name>.json``:

1. ``start``: two ranks on the one GPU, gloo (each rank's device and ``CUDA_VISIBLE_DEVICES``).
2. ``ddp_matches_reference``: a ddp cell equals one process on the global batches (1e-4 on a GPU).
3. ``fsdp``: fsdp trains (gloo's reduce-scatter of CUDA tensors, what FSDP2 needs, is tried here).
4. ``scale``: ``%dist scale 1`` then ``%dist scale 2`` carry the model (a grow's broadcast), and it trains on.
5. ``one_rank_fails``: rank 1 raises while rank 0 waits in a barrier: the cell ends in seconds (not
   at ``--timeout``), the GPU memory after it, and the next cell trains.
6. ``compile_workers`` (finding 6): after a ``--compile`` cell, each engine's inductor setting and
   child processes: its share of the cores (cores / 2), not ``min(32, cores)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kit  # noqa: E402
from kit import expect  # noqa: E402
from kit_cells import BODY, OPTS, FREE, namespace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="two CPU ranks instead of two ranks on the one GPU")
    args = ap.parse_args()
    if not args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,0"  # both engines on GPU 0: visible_gpus() is ['0', '0']
    kit.prepare(args.cpu)
    from distnb import session

    checks = kit.Checks("gpu2", args.cpu)
    sh = kit.shell()
    pids = []
    try:
        t0 = time.perf_counter()
        kit.cell(sh, "%dist start -n 2 --backend gloo --timeout 60")
        s = session.current()
        s.ns.update(namespace(1024 if args.cpu else 4096))
        pids = list(s.cluster.pids["engines"])
        checks.run("start", start, s, time.perf_counter() - t0, args.cpu)
        checks.run("ddp_matches_reference", ddp_matches_reference, s, args.cpu)
        checks.run("fsdp", fsdp, s)
        checks.run("scale", scale, sh)
        checks.run("one_rank_fails", one_rank_fails, sh)
        checks.run("compile_workers", compile_workers)
    finally:
        if session._CURRENT is not None:
            pids = sorted(set(pids) | set(session._CURRENT.cluster.pids["engines"]))
        kit.cell(sh, "%dist stop", expect_error=True)
        from distnb.cluster import zygote

        zygote.stop()
    from kit_cells import nothing_left

    checks.run("stop", nothing_left, pids)
    return checks.exit_code()


def start(fig, s, seconds, cpu):
    s.run("import os, torch\n_where = (str(device), torch.distributed.get_backend(), "
          "os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('LOCAL_RANK'))")
    fig.update(start_seconds=round(seconds, 2), ranks=s.pull("_where"))
    want = "cpu" if cpu else "cuda"
    expect(all(r[0].split(":")[0] == want and r[1] == "gloo" for r in fig["ranks"]) and len(fig["ranks"]) == 2,
           f"expected two ranks on {want} with gloo")


def ddp_matches_reference(fig, s, cpu):
    import torch
    import torch.nn.functional as F

    from distnb.engine.transport import shard

    ns = s.ns
    ns["two_net"], ref = ns["make_net"](11), ns["make_net"](11)
    r = s.train(BODY, model="two_net", epochs=2, **{**OPTS, "optimizer": "sgd", "lr": 0.05})
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x, y = ns["kit_data"].tensors
    for epoch in range(2):
        for idx in shard.global_batches(len(x), 2, 0, epoch, OPTS["batch_size"], False):
            opt.zero_grad()
            F.cross_entropy(ref(x[idx]), y[idx]).backward()
            opt.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(ns["two_net"].parameters(), ref.parameters()))
    fig.update(max_diff=diff, samples_per_s=round(r.samples_per_s), steps=r.rows[0]["steps"])
    expect(diff < (1e-5 if cpu else 1e-4), f"differs from one process by {diff:.2e}")


def fsdp(fig, s):
    s.ns["two_fsdp"] = s.ns["make_net"](12)
    r = s.train(BODY, model="two_fsdp", epochs=2, strategy="fsdp", **OPTS)
    fig.update(losses=r.epoch_losses)
    expect(r.epoch_losses[-1] < r.epoch_losses[0], "fsdp's loss did not fall")


def scale(fig, sh):
    from distnb import session

    s = session.current()
    s.ns["scale_net"] = s.ns["make_net"](13)
    s.train(BODY, model="scale_net", epochs=1, **OPTS)
    for n in (1, 2):
        t0 = time.perf_counter()
        kit.cell(sh, f"%dist scale {n}")
        fig[f"scale_{n}_seconds"] = round(time.perf_counter() - t0, 2)
    s = session.current()
    r = s.train(BODY, model="scale_net", epochs=1, **OPTS)
    fig.update(world_size=s.world_size, losses=r.epoch_losses)
    expect(s.world_size == 2, "the grow did not give two ranks")


def one_rank_fails(fig, sh):
    from distnb import session

    t0 = time.perf_counter()
    error = kit.cell(sh, "%%dist\nimport torch.distributed as _d\nif rank == 1:\n    raise ValueError('kit: rank 1')\n"
                         "_d.barrier()", expect_error=True)
    fig["cell_seconds"] = round(time.perf_counter() - t0, 2)
    fig["error"] = str(error)[:300]
    s = session.current()
    s.run(FREE)
    fig["free_bytes"] = s.pull("_free")
    s.ns["after_net"] = s.ns["make_net"](14)
    r = s.train(BODY, model="after_net", epochs=2, **OPTS)
    fig["losses_after"] = r.epoch_losses
    expect(error is not None and fig["cell_seconds"] < 30, "rank 1's failure did not end the cell in seconds")
    expect(r.epoch_losses[-1] < r.epoch_losses[0], "the next cell did not train")


def compile_workers(fig):
    import psutil

    from distnb import session

    s = session.current()
    s.ns["compiled_net"] = s.ns["make_net"](15)
    r = s.train(BODY, model="compiled_net", epochs=2, compile=True, **OPTS)
    s.run("import os, torch._inductor.config as _ic\n_threads = (_ic.compile_threads, os.environ.get('OMP_NUM_THREADS'))")
    children = [len(psutil.Process(p).children(recursive=True)) for p in s.cluster.pids["engines"]]
    fig.update(compile_seconds=r.compile_seconds, threads=s.pull("_threads"), children=children,
               cores=os.cpu_count(), losses=r.epoch_losses)
    share = max(1, (os.cpu_count() or 1) // 2)
    expect(all(t[0] == share for t in fig["threads"]), f"compile_threads is not the rank's share ({share})")
    expect(all(c <= share + 3 for c in children), f"an engine has more children than its share: {children}")


if __name__ == "__main__":
    sys.exit(main())
