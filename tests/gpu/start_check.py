"""How long ``%dist start`` takes, and what it started: a script for tests/gpu/device_run.sh (issue 17, GPU).

    python tests/gpu/start_check.py          # on a GPU machine: %dist start, one engine per GPU, nccl
    python tests/gpu/start_check.py --cpu    # %dist start -n 2 on CPU/gloo (to test this script)

In a real IPython shell, as a notebook runs it: ``%load_ext distnb`` (its engine template starts
importing torch), then ``%dist start`` timed until it returns (engines up, the process group
formed), ``%dist status``, then each rank's ``device`` and ``torch.distributed.get_backend()``
read from the ranks, and ``%dist stop`` timed. Prints one line per figure; exits 1 when the
backend, device or number of ranks is not what this machine should get (nccl and one rank per GPU
on ``cuda:0`` of each engine's own GPU; gloo and cpu with ``--cpu``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="start 2 CPU engines with gloo instead")
    args = ap.parse_args()
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="distnb-start-check-"))
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from distnb.net import visible_gpus

    gpus = visible_gpus()
    if not args.cpu and not gpus:
        print("no GPU visible: run with --cpu to check the script itself")
        return 2
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)

    def cell(source):
        result = shell.run_cell(source)
        if not result.success:
            raise RuntimeError(f"cell failed: {source!r}: {result.error_before_exec or result.error_in_exec!r}")

    t0 = time.perf_counter()
    cell("%load_ext distnb")
    print(f"%load_ext distnb: {time.perf_counter() - t0:.2f} s", flush=True)
    t0 = time.perf_counter()
    cell("%dist start" if gpus else "%dist start -n 2")
    started = time.perf_counter() - t0
    print(f"%dist start: {started:.2f} s", flush=True)
    try:
        cell("%dist status")
        from distnb import session

        s = session.current()
        spec = s.cluster.spec
        ranks = s.run("import os, torch.distributed as _d\n(str(device), _d.get_backend(), "
                      "os.environ.get('CUDA_VISIBLE_DEVICES'))", all_output=True)
        for r, value in enumerate(ranks):
            print(f"rank {r}: (device, backend, CUDA_VISIBLE_DEVICES) = {value}", flush=True)
        if gpus:
            want = [repr(("cuda:0", "nccl", str(g))) for g in gpus]
        else:  # what CUDA_VISIBLE_DEVICES holds on CPU is not distnb's to say
            want = [repr(("cpu", "gloo", eval(v)[2])) for v in ranks]
        ok = (spec.backend, spec.num_engines) == (("nccl", len(gpus)) if gpus else ("gloo", 2)) and ranks == want
        print(f"{'ok  ' if ok else 'FAIL'} {spec.num_engines} engines, {spec.backend} on {spec.device_type}, "
              f"started in {started:.2f} s" + ("" if ok else f" (expected ranks {want})"), flush=True)
    finally:
        t0 = time.perf_counter()
        cell("%dist stop")
        print(f"%dist stop: {time.perf_counter() - t0:.2f} s", flush=True)
        from distnb import zygote

        zygote.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
