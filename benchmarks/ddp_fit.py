"""Does distnb refuse a meta model under ddp that its ranks cannot hold, before anything is sent? (issue 34)

The model: ``--layers`` bias-free ``nn.Linear(4096, 4096)`` (64 MiB each in fp32; 64 = 4 GiB), built on the
meta device in a 2-rank Session's notebook namespace. The script first asks the kernel-side check alone
(:func:`distnb.train.bigmodels.check_before_sending`, the ranks' real free memory); only if that refuses with a
margin does it run ``Session.train`` with ``--strategy ddp`` (which runs the same check before sending), so a
model the check lets through is never trained here (on a shared machine a 4 GiB ddp run takes about 17 GiB).
It prints what each rank would need, what each has, the message, and whether the ranks received anything.

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ddp_fit.py [--layers 64] [--optimizer sgd]
"""

from __future__ import annotations

import argparse

import torch

import distnb
from distnb.core import calls
from distnb.core.errors import PlanError
from distnb.core.plan import TrainPlan
from distnb.train import bigmodels



def _stack_class():
    """memory.py's ``Stack`` (bias-free ``Linear(4096, 4096)`` layers), from the model source its runs share."""
    from memory import COMMON  # benchmarks/memory.py, beside this script

    ns = {"__name__": "__main__"}  # pickled by value, as a notebook's class
    exec(COMMON, ns)
    return ns["Stack"]


Stack = _stack_class()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--optimizer", default="sgd")
    args = ap.parse_args(argv)
    Stack.__module__ = "__main__"
    ns = {}
    s = distnb.start(n=2, ns=ns, quiet=True, timeout=600)
    try:
        with torch.device("meta"):
            ns["net"] = Stack(args.layers)
        ns["data"] = torch.randn(4, 4096)
        plan = TrainPlan(model="net", data="data", strategy="ddp", optimizer=args.optimizer)
        need, how = bigmodels.rank_need(ns["net"], plan, s.world_size)
        rooms = s.cluster.wait_all(s.cluster.apply_all(calls.capacity), timeout=60, what="free memory")
        print(f"model {bigmodels.model_bytes(ns['net']) / 2**30:.2f} GiB; each rank would need {need / 2**30:.2f} GiB "
              f"({how}); the ranks' rooms: {rooms}")
        try:
            bigmodels.check_before_sending(s, plan, ns["net"])
        except PlanError as exc:
            print(f"check alone: refused: {exc}")
        else:
            print("check alone: PASSED (the model would be sent and trained; not run here)")
            return
        have = min(r["bytes"] // (2 if r["scope"] == "host" else 1) for r in rooms)
        if need < 1.2 * have:
            print("too close to the ranks' room to run Session.train safely: not run")
            return
        try:
            s.train("loss = model(batch).pow(2).mean()", "net", "data", strategy="ddp", optimizer=args.optimizer,
                    epochs=1, batch_size=1, quiet=True, progress="none")
        except PlanError as exc:
            print(f"Session.train: refused: {exc}")
        s.run("from distnb.engine.train import loop as _loop\n_held = sorted(_loop.RUNS)")
        print(f"kernel holdings.models: {sorted(s.holdings.models)}; models the ranks hold: {s.pull('_held')}")
    finally:
        s.stop(quiet=True)


if __name__ == "__main__":
    main()
