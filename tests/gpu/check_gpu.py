"""The GPU kit's checks for a world of one nccl rank (one GPU), in the GPU review's priority order.

    python tests/gpu/check_gpu.py            # on a GPU machine: %dist start (one engine, nccl, cuda:0)
    python tests/gpu/check_gpu.py --cpu      # the same cells on one CPU/gloo rank (to test this script)

NCCL needs a distinct GPU per rank, so one GPU is a world of one rank: its collectives complete
locally, no peer can fail or lag (tests/gpu/REVIEW-ANSWERS.md lists what needs 2 GPUs). Each
check writes ``$OUT/checks/gpu1.<name>.json`` (:mod:`kit`) and prints one line; a failed check
does not stop the next. The exit status is 1 when any check failed. The checks:

1. ``start``: ``%dist start`` timed; the rank's device and backend, the ``TORCH_NCCL_*`` and
   ``NCCL_*`` variables it sees; ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
   ``torch.cuda.current_device()`` (finding 5); no CUDA context in the kernel.
2. ``cpu_tensors_on_nccl`` (finding 2): after a ddp cell, ``calls.share`` (what a grow runs)
   broadcasts the model's state over the group; a stream empty on the only rank ends with
   distnb's error, not "No backend type associated with device type cpu".
3. ``failure_cycles`` (findings 1 and 7, the world-of-one half): three failing ``%%dist`` cells
   and a ``%%distrain`` raising at step 3, each timed, with ``torch.cuda.mem_get_info`` and the
   group's generation after each (free memory must not fall; a kept group keeps its
   generation), then a cell that trains.
4. ``nan_stop`` (finding 4): a loss that is NaN at step 3 ends the cell with the FloatingPointError
   naming step 3, and the notebook's weights stay finite.
5. ``strategies``: ddp and fsdp with bf16 and fp16, tensor, fsdp+tensor ``--mesh 1x1``: the loss
   falls, the weights back are fp32 on the CPU; the cell's start note (bf16 emulation).
6. ``peak_per_cell`` (finding 10): a cell that holds about 2 GiB, then a small one: the second's
   peak is small; ``max_memory_reserved`` and nvidia-smi beside it.
7. ``checkpoints``: ``--checkpoint-dir`` then ``%dist restart`` and a resume equal an unbroken
   run; ``%dist save`` then ``%dist load`` restores the weights.
8. ``data_syncs`` (finding 8): samples/s of the tensor path, a Dataset with ``--workers 2``,
   ``--clip-grad-norm``, ``--nan skip``, a stream; host syncs per step counted with
   ``torch.cuda.set_sync_debug_mode("warn")`` (each sync is a warning naming its line).
9. ``where_and_interrupt``: a ``%%distrain --background`` step in a long CUDA kernel, what
   ``%dist where`` says; an interrupt 2 s into a ``%%dist`` cell running a long kernel, and when
   the cell ends.
10. ``offload_cpu`` (issue 34): the GPU capped below a 2 GiB model with
    ``torch.cuda.set_per_process_memory_fraction``, fsdp ``--offload cpu`` trains it (skipped,
    saying so, while the option does not exist).
11. ``no_cuda_outside``: nvidia-smi's compute processes are the engine's only; then a CUDA
    tensor pulled into the kernel (does that make a context there?), last since it may.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kit  # noqa: E402
import kit_cells  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="one CPU rank with gloo instead of one GPU rank with nccl")
    args = ap.parse_args()
    kit.prepare(args.cpu)
    import torch

    from distnb import session
    from distnb.core.net import visible_gpus

    gpus = visible_gpus()
    if not args.cpu and not gpus:
        print("no GPU visible: run with --cpu to check the script itself")
        return 2
    checks = kit.Checks("gpu1", args.cpu)
    sh = kit.shell()
    try:
        t0 = time.perf_counter()
        kit.cell(sh, "%dist start -n 1 --timeout 60")
        start_s = time.perf_counter() - t0
        s = session.current()
        ns = sh.user_ns
        ns.update(kit_cells.namespace(1024 if args.cpu else 4096))
        checks.run("start", kit_cells.start, s, start_s, torch)
        checks.run("cpu_tensors_on_nccl", kit_cells.cpu_tensors_on_group, s)
        checks.run("failure_cycles", kit_cells.failure_cycles, sh, s)
        checks.run("nan_stop", kit_cells.nan_stop, sh, s)
        for strategy, precision in (("ddp", "bf16"), ("ddp", "fp16"), ("fsdp", "bf16"), ("fsdp", "fp16"),
                                    ("tensor", "fp32"), ("fsdp+tensor", "fp32")):
            checks.run(f"strategy_{strategy.replace('+', '_')}_{precision}", kit_cells.strategy, sh, s, strategy,
                       precision, cuda=precision == "fp16")
        checks.run("peak_per_cell", kit_cells.peak_per_cell, sh, s)
        checks.run("checkpoints", kit_cells.checkpoints, sh)
        checks.run("data_syncs", kit_cells.data_syncs, sh, args.cpu)
        checks.run("where_and_interrupt", kit_cells.where_and_interrupt, sh, args.cpu)
        checks.run("offload_cpu", kit_cells.offload, sh, cuda=True)
        checks.run("no_cuda_outside", kit_cells.no_cuda_outside, sh, args.cpu)
    finally:
        pids = session._CURRENT.cluster.pids["engines"] if session._CURRENT is not None else []
        kit.cell(sh, "%dist stop", expect_error=True)
        from distnb.cluster import zygote

        zygote.stop()
    checks.run("stop", kit_cells.nothing_left, pids)
    return checks.exit_code()


if __name__ == "__main__":
    sys.exit(main())
