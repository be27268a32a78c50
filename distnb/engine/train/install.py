"""Receiving a model on a rank: whole (:func:`install_model`), or as its structure, distributed first
(:func:`place_model`, :mod:`distnb.engine.strategies.materialize`)."""

from __future__ import annotations

import contextlib
import io

import torch

from distnb.core.errors import PlanError
from distnb.core.plan import TrainPlan
from distnb.core.weightfiles import provided
from distnb.engine.process import runtime
from distnb.engine.strategies.materialize import materialize, receive
from distnb.engine.train import carry, loop
from distnb.engine.train.pretrained import stored_names
from distnb.engine.transport import wire


def install_model(ns, name, payload, descs, steps, *buffers):
    """Receive a model from the kernel; start a new Run (fresh optimizer, epoch 0).

    ``steps``: the global step count the kernel's weights have had (0 for new ones); the Run's
    count goes on from it, so the checkpoints of this training sort after the older ones.
    """
    device = runtime.STATE.device
    if device.type != "cpu":  # from the kernel's bytes straight to the device, one tensor at a time (no CPU copy)
        module, pending = receive(payload, descs, buffers)
        materialize(pending, module, device)
        return install_received(ns, name, module, steps)
    module = wire.loads(payload, descs, buffers)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{name} is a {type(module).__name__}, not a torch.nn.Module")
    return install_received(ns, name, module.to(device), steps)


def install_received(ns, name, module, steps):
    """Start a new Run of ``module`` (placed, or still meta: :mod:`~distnb.engine.strategies.materialize`); its parameter count."""
    old = loop.RUNS.get(name)
    if old is not None and old.strategy is not None:
        old.strategy.close()  # the replaced model must not keep the process group referenced
    loop.RUNS[name] = loop.Run(module, steps)
    ns[name] = module
    return sum(p.numel() for p in module.parameters())


def place_model(ns, name, plan_dict, steps, payload, descs, rng, *buffers):
    """Receive a model as its structure, distribute it for the plan's strategy, then materialise this rank's part.

    The strategy is built here, on the meta module (the training cell that follows keeps it), so the
    kernel's segment is read while it is held for this call. ``rng``: the notebook's torch generator
    state as uint8 bytes, to initialise tensors that came without data; None when all have data.
    Returns the model's parameter count.
    """
    module, pending = receive(payload, descs, buffers)
    plan = TrainPlan.from_dict(plan_dict)
    if rng is not None:
        pending.rng = torch.frombuffer(bytearray(rng), dtype=torch.uint8)
        pending.skip = loaded_indices(plan, module, pending)
    old = loop.RUNS.pop(name, None) if carry.take(name) and pending.needs_init else None
    try:
        if old is not None:  # the weights the ranks trained, read before the old placement is closed
            pending.carry = carry.Carry(old)  # (it fills --load's tensors too: skip differs between ranks)
            stated = set(module.state_dict())  # a non-persistent buffer (rotary inv_freq) is no state: made anew
            if pending.carry.missing([n for n, i in pending.names.items()
                                      if not pending.source.has_data(i) and n in stated]):
                pending.carry = None  # another structure than the one trained: initialised afresh
        count = install_received(ns, name, module, steps)
        run = loop.RUNS[name]
        run.weights_stay = pending.needs_init  # a meta model in the notebook: its weights stay on the ranks
        said = io.StringIO()  # what the strategy says as it is built: shown by the training cell that follows
        try:
            with contextlib.redirect_stdout(said):
                loop.build_strategy(ns, plan, run, pending)
        except BaseException:  # half placed (tensors of uninitialised memory): never left for a pull or a save
            if loop.RUNS.get(name) is run:
                del loop.RUNS[name]
            if ns.get(name) is module:
                del ns[name]
            raise
        run.said = said.getvalue()
    finally:
        if old is not None and old.strategy is not None:
            old.strategy.close()  # after the carry: its DTensors needed the old mesh
    return count


def loaded_indices(plan, module, pending) -> frozenset:
    """The tensors of a meta model that ``--load`` fills (:func:`distnb.core.weightfiles.provided`), by source index:
    given memory without an init. A path this rank cannot read gives none (every tensor is initialised);
    the load that follows names the rank and its host (:mod:`distnb.engine.train.pretrained`)."""
    if not plan.load:
        return frozenset()
    try:
        names = provided(stored_names(plan.load), module)
    except (PlanError, OSError, ValueError):
        return frozenset()
    return frozenset(pending.names[n] for n in names if n in pending.names)
