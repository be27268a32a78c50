"""One short GPU check for a machine that has one (run by hand, or by pytest through test_check_gpu.py,
which skips where no GPU is visible; this file itself is not a test module).

    python tests/gpu/check_gpu.py            # on a GPU machine: nccl, one engine per GPU
    python tests/gpu/check_gpu.py --cpu      # the same checks on CPU/gloo (to test this script)

Checks, printing one line each and exiting non-zero on the first failure:
1. counting GPUs did not initialise CUDA in this process;
2. ``distnb.start()`` picks nccl and one engine per GPU, each engine seeing only its own GPU;
3. a DDP training cell on digits matches a single-process reference on the global batch
   (1e-4 on GPU: cuDNN/cuBLAS reductions differ slightly from the CPU);
4. the weights back in this process equal rank 0's;
5. ``--precision fp16`` trains with a ``torch.amp.GradScaler`` on every rank (GPU only), the loss falls and
   the weights back are fp32;
6. ``--sync-bn``: the ranks' BatchNorm is SyncBatchNorm, so their running statistics agree although their
   batches differ, and the kernel's model keeps plain BatchNorm with rank 0's statistics (GPU only);
7. ``--compile`` trains (torch.compile after DDP) to a falling loss and reports the compile time;
8. stop leaves no engine behind.

On a lent GPU machine without ipyparallel or IPython (one command, no network), run it through the kit:
``bash tests/gpu/wheels.sh`` here, then the device tool's call with command ``bash tests/gpu/device_run.sh``
and carry ``[".whl"]`` (device_run.sh installs the wheels, then runs this script, start_check.py and the
transformer rows on nccl; ``device_run.sh --cpu`` runs the same steps here).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="run the checks on CPU with gloo")
    args = ap.parse_args()
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="distnb-gpu-check-"))
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    import distnb
    from distnb.net import visible_gpus
    from distnb.engine import shard

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            raise SystemExit(1)

    gpus = visible_gpus()
    check(not torch.cuda.is_initialized(), f"counting {len(gpus)} GPUs left CUDA uninitialised in the kernel")
    if not args.cpu and not gpus:
        print("no GPU visible: run with --cpu to check the script itself")
        return 2

    X, y = load_digits(return_X_y=True)
    data = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    ref = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    ref.load_state_dict(net.state_dict())
    ns = {"net": net, "data": data, "F": F}

    t0 = time.perf_counter()
    s = distnb.start(ns=ns, n=None if gpus else 2)
    try:
        expect = ("nccl", "cuda", len(gpus)) if gpus else ("gloo", "cpu", 2)
        spec = s.cluster.spec
        check((spec.backend, spec.device_type, spec.num_engines) == expect,
              f"started {spec.num_engines} engines, {spec.backend} on {spec.device_type}, "
              f"in {time.perf_counter() - t0:.1f} s")
        seen = s.run("import os, torch\n(os.environ.get('CUDA_VISIBLE_DEVICES'), torch.cuda.device_count())",
                     all_output=True)
        if gpus:
            check(all(v == repr((gpus[r], 1)) for r, v in enumerate(seen)), f"each rank sees only its GPU: {seen}")
        epochs, batch, lr = 2, 32, 0.05
        r = s.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", model="net", data="data", epochs=epochs,
                    batch_size=batch, optimizer="sgd", lr=lr, progress="text")
        opt = torch.optim.SGD(ref.parameters(), lr=lr)
        x_all, y_all = data.tensors
        for epoch in range(epochs):
            for idx in shard.global_batches(len(data), s.world_size, 0, epoch, batch, False):
                opt.zero_grad()
                F.cross_entropy(ref(x_all[idx]), y_all[idx]).backward()
                opt.step()
        diff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
        tol = 1e-4 if gpus else 1e-5
        check(diff < tol, f"{r.rows[0]['steps']} steps/rank match the single-process reference (max diff {diff:.2e})")
        s.run("import torch\n_w = torch.cat([p.detach().float().cpu().flatten() for p in net.parameters()])")
        w0 = s.pull("_w", rank=0)
        check(torch.equal(w0, torch.cat([p.detach().flatten() for p in net.parameters()])),
              "weights back in the kernel equal rank 0's")
        step_checks(s, ns, data, gpus, check)
        pids = s.cluster.pids["engines"]
    finally:
        s.stop(quiet=True)
    import psutil

    time.sleep(1)
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    check(not left, "stop left no engine behind")
    return 0


BN_NET = """
import torch.nn as nn
torch.manual_seed(0)
bn_net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
"""


def step_checks(s, ns, data, gpus, check) -> None:
    """Issue 15's GPU checks: fp16 with its GradScaler, --sync-bn, --compile on nccl."""
    import torch
    import torch.nn as nn

    body = "x, y = batch\nloss = F.cross_entropy(model(x), y)"
    opts = dict(data="data", batch_size=32, optimizer="adam", lr=1e-2, progress="none", quiet=True)
    if gpus:
        torch.manual_seed(0)
        ns["net16"] = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        r = s.train(body, model="net16", epochs=3, precision="fp16", **opts)
        s.run("from distnb.engine.loop import RUNS\n_scale = float(RUNS['net16'].scaler.get_scale())")
        scales = s.pull("_scale")
        check(r.epoch_losses[-1] < r.epoch_losses[0] and all(x > 0 for x in scales),
              f"fp16 with GradScaler (scales {scales}): mean loss {r.epoch_losses[0]:.3f} -> {r.epoch_losses[-1]:.3f}")
        check(all(p.dtype == torch.float32 for p in ns["net16"].parameters()), "fp16: the weights back are fp32")
        exec(BN_NET, ns)
        s.train(body, model="bn_net", epochs=2, sync_bn=True, **opts)
        s.run("import torch\n_kinds = sorted({type(m).__name__ for m in bn_net.modules()})\n"
              "_rm = bn_net[1].running_mean.detach().float().cpu().clone()")
        kinds, means = s.pull("_kinds"), s.pull("_rm")
        check(all("SyncBatchNorm" in k for k in kinds), f"--sync-bn: the ranks hold SyncBatchNorm ({kinds[0]})")
        agree = max((m - means[0]).abs().max().item() for m in means)
        check(agree < 1e-5, f"--sync-bn: the ranks' running statistics agree (max diff {agree:.1e})")
        back = ns["bn_net"][1]
        check(type(back) is nn.BatchNorm1d and torch.allclose(back.running_mean, means[0]),
              "--sync-bn: the kernel's model keeps plain BatchNorm1d with rank 0's statistics")
    else:
        print("skip fp16 and --sync-bn: they need GPU ranks", flush=True)
    torch.manual_seed(0)
    ns["cnet"] = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    r = s.train(body, model="cnet", epochs=3, compile=True, **opts)
    check(r.epoch_losses[-1] < r.epoch_losses[0] and r.compile_seconds is not None,
          f"--compile: mean loss {r.epoch_losses[0]:.3f} -> {r.epoch_losses[-1]:.3f}, compiling took "
          f"{r.compile_seconds:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
