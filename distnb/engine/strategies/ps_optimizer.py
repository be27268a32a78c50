"""The parameter server's optimizer side: what the training loop steps, and its state in checkpoints.

:class:`ServerOptimizer` stands for a server's real torch optimizer in the loop: its
``step()`` is the push/pull exchange of :class:`~distnb.engine.strategies.ps.ParameterServer`.
:func:`init_optimizer_state` and :func:`clone_tensors` give a checkpoint a complete,
consistent copy of a server's optimizer state.
"""

from __future__ import annotations

import collections

import torch


class ServerOptimizer(torch.optim.Optimizer):
    """The optimizer the loop steps: ``step()`` is the push/pull exchange with the servers.

    Shares ``param_groups``, ``state`` and ``defaults`` with the server's real optimizer
    (``inner``), so learning-rate changes and schedulers act on it. ``zero_grad`` clears
    the gradients of the whole model (every rank computes all of them). ``strategy`` is the
    :class:`~distnb.engine.strategies.ps.ParameterServer` that runs the exchange.
    """

    def __init__(self, inner: torch.optim.Optimizer, strategy):
        # no Optimizer.__init__: it would build its own parameter groups
        self.inner, self._strategy = inner, strategy
        self.defaults, self.state, self.param_groups = inner.defaults, inner.state, inner.param_groups
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, collections.OrderedDict())
        self._patch_step_function()

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._strategy.exchange()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._strategy.zero_grad(set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ServerOptimizer({self.inner!r})"


def clone_tensors(obj):
    """``obj`` (nested dicts and lists) with every tensor cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tensors(v) for v in obj]
    return obj


def init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state: one step with zero gradients at lr 0 (values unchanged)."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p, g in zip(params, grads):
            p.grad = g


def flat_state(optimizer, names) -> dict:
    """``optimizer``'s state by parameter name: ``state.NAME.KEY`` and ``param_groups.NAME.KEY``.

    The layout ``torch.distributed.checkpoint.state_dict`` flattens an optimizer state into
    (``flatten_optimizer_state_dict=True``, as the pipeline's checkpoints have it), so a server's
    entries are its own whatever the assignment of parameters to servers. ``names[i]``: the name
    of the optimizer's ``i``-th parameter (in ``state_dict()``'s numbering).
    """
    sd = optimizer.state_dict()
    out = {}
    for i, state in sd["state"].items():
        for key, value in state.items():
            out[f"state.{names[i]}.{key}"] = value
    for group in sd["param_groups"]:
        for i in group["params"]:
            out.update({f"param_groups.{names[i]}.{key}": value for key, value in group.items() if key != "params"})
    return out


def load_flat_state(optimizer, names, flat: dict) -> None:
    """Load :func:`flat_state`'s layout ``flat`` into ``optimizer`` (whose state is initialised: its keys are asked)."""
    sd = optimizer.state_dict()
    state = {i: {key: flat[f"state.{names[i]}.{key}"] for key in cur} for i, cur in sd["state"].items()}
    groups = []
    for group in sd["param_groups"]:
        first = names[group["params"][0]] if group["params"] else None
        groups.append({key: (value if key == "params" or first is None else
                             flat.get(f"param_groups.{first}.{key}", value)) for key, value in group.items()})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
