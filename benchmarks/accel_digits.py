"""The digits training run through Accelerate's ``notebook_launcher``: the launcher reference.

``notebook_launcher(train, args, num_processes=2)`` forks the calling process (the
"kernel") into 2 workers under torch.distributed.elastic; each builds an ``Accelerator``
(CPU, gloo), prepares the model and optimizer (DDP) and runs the same loop as
``torchrun_digits.py`` and distnb: the same shards in the same order
(``distnb.engine.transport.shard``), batch size, Adam, one torch thread per worker, one loss
all-reduce per epoch. Rank 0 writes its figures (JSON) to ``out_path``, because the
launcher returns nothing. Accelerate is a benchmark-only dependency (``pip install -e .[bench]``).
"""

from __future__ import annotations

import json
import os
import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(out_path, model_cls, X, Y, epochs, batch_size, lr, seed=0, first_epoch=0):
    """The training function the launcher runs in each forked worker."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from accelerate import Accelerator

    from distnb.engine.transport import shard as sharding

    import warnings

    t_enter = time.perf_counter()
    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS")  # Accelerate's note that it sets 1 thread
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    n = len(X)
    mine = sharding.assign(n, world, seed)[rank]
    Xs, Ys = X[mine], Y[mine]
    torch.manual_seed(0)
    model = model_cls()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    dist.barrier()
    t0 = time.perf_counter()
    samples, losses = 0, []
    for epoch in range(first_epoch, first_epoch + epochs):
        order = sharding.epoch_order(n, world, rank, seed, epoch, False)
        loss_sum, num = 0.0, 0
        for idx in sharding.batches(order, batch_size, False):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(Xs[idx]), Ys[idx])
            accelerator.backward(loss)
            optimizer.step()
            loss_sum += loss.item()
            num += 1
            samples += len(idx)
        t = torch.tensor([loss_sum, num], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t[0] / t[1]))
    seconds = time.perf_counter() - t0
    figs = torch.tensor([samples, seconds, t0 - t_enter], dtype=torch.float64)
    every = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, figs)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(samples_per_s=sum(float(e[0] / e[1]) for e in every),
                           train_seconds=max(float(e[1]) for e in every),
                           setup_seconds=max(float(e[2]) for e in every), final_loss=losses[-1]), f)


def launch(model_cls, X, Y, epochs, batch_size, lr, seed=0, first_epoch=0) -> dict:
    """One ``notebook_launcher`` call (2 processes) from this process; its figures plus its wall time."""
    import contextlib
    import io
    import logging
    import tempfile

    from accelerate import notebook_launcher

    out = tempfile.mktemp(prefix="distnb-bench-accel-", suffix=".json")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    sink = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sink):
        notebook_launcher(train, args=(out, model_cls, X, Y, epochs, batch_size, lr, seed, first_epoch),
                          num_processes=2, use_port=str(free_port()))
    wall = time.perf_counter() - t0
    try:
        with open(out) as f:
            res = json.load(f)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(out)
    res["wall_seconds"] = wall
    return res
