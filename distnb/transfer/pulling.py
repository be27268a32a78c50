"""``%dist pull NAME.path.to.param`` (:meth:`distnb.session.Session.pull` with a dotted name): one tensor.

A model's parameter or buffer, by its ``state_dict`` name, comes back whole into the kernel for any
strategy: an fsdp or tensor-parallel shard is all-gathered on the ranks (``DTensor.full_tensor``), a
pipeline's tensor comes from the stage that holds it, a ddp replica's from one rank. Only that tensor
travels (:mod:`distnb.engine.train.pulltensor`): for a model that lives on the ranks (a model the notebook
holds on the meta device, or one bigger than the kernel wants) this reads one weight without the rest.
"""

from __future__ import annotations

import difflib

from distnb.core import calls
from distnb.core.errors import PlanError, ranks_named


def pull_value(session, name: str, ranks: list) -> list:
    """The value of the variable ``name`` on each of ``ranks`` (:meth:`distnb.session.Session.pull`).

    Raises
    ------
    PlanError
        ``name`` is not defined on one of ``ranks``: names those ranks, the nearest names they have, whether the
        notebook has ``name`` (then ``%dist push`` sends it) or its nearest, and the ranks that have it.
    """
    from distnb.engine.transport import wire  # loads numpy, torch: at first use, not when this module is imported

    cluster = session.cluster
    ars = [cluster.apply(r, calls.lookup, name) for r in ranks]
    packed = cluster.wait_all(ars, timeout=cluster.spec.timeout, what=f"pull {name}", ranks=ranks)
    missing = {r: p[1] for r, p in zip(ranks, packed) if isinstance(p[0], str) and p[0] == "missing"}
    if missing:
        raise PlanError(_not_defined(session, name, missing, [r for r in ranks if r not in missing]))
    return [wire.loads(*p) for p in packed]


def _not_defined(session, name: str, missing: dict, holders: list) -> str:
    """The error of a pull of ``name``, which ``missing`` (rank -> its nearest names) lack and ``holders`` hold."""

    near = sorted({n for names in missing.values() for n in names})
    text = f"pull {name}: {name!r} is not defined on {ranks_named(missing)}"
    text += f" (nearest there: {', '.join(near)})" if near else ""
    if holders:
        return (text + f"; {ranks_named(holders)} {'has' if len(holders) == 1 else 'have'} it: %dist pull {name} "
                f"--rank {holders[0]} reads one (rank={holders[0]} in Python)")
    if name in session.ns:
        return text + f"; the notebook has it: send it to the ranks with %dist push {name}"
    shown = [n for n in session.ns if isinstance(n, str) and not n.startswith("_")]
    close = difflib.get_close_matches(name, shown, n=3, cutoff=0.6)
    return (text + ", nor in the notebook" + (f" (nearest there: {', '.join(close)})" if close else "")
            + f": check the spelling, or define {name} on the ranks in a %%dist cell")


def pull_tensor(session, name: str, rank=None):
    """The full tensor ``name`` (``MODEL.path.to.param``) from the ranks, on the CPU.

    Parameters
    ----------
    session : distnb.session.Session
    name : str
        The model's name on the ranks, a dot, and a key of its ``state_dict`` (``net.layers.3.weight``;
        a Hugging Face model's own names, ``net.model.layers.0.mlp.up_proj.weight``, and under peft
        ``net.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``).
    rank : int or None
        For a tensor that several ranks hold whole (ddp), the rank to read it from (default: the last
        rank holding it, the pipeline stage that trains a tensor several stages hold). A sharded tensor
        is gathered from every rank whatever ``rank`` says.

    Returns
    -------
    torch.Tensor
        Detached, its dtype, its full shape.

    Raises
    ------
    PlanError
        The model is not on the ranks, or has no such parameter or buffer (the nearest names are given).
    """
    from distnb.engine.transport import wire  # imports torch: the kernel loads it at first use

    head, _, path = name.partition(".")
    if not head.isidentifier() or not path:
        raise PlanError(f"pull takes NAME or NAME.path.to.tensor (a model's parameter or buffer), got {name!r}")
    cluster = session.cluster
    where = cluster.wait_all(cluster.apply_all(calls.locate_tensor, head, path), timeout=cluster.spec.timeout,
                             what=f"pull {name}")
    _check_found(name, head, path, where)
    gathered = "dtensor" in where
    if gathered:
        source = 0
    else:
        holders = [r for r, w in enumerate(where) if w == "held"]
        source = rank if rank in holders else holders[-1]
        if rank is not None and rank not in holders:
            raise PlanError(f"rank {rank} does not hold {name} (a pipeline stage of another rank does: rank "
                            f"{holders[-1]}); leave --rank out")
    ranks = range(session.world_size) if gathered else [source]
    ars = [cluster.apply(r, calls.fetch_tensor, head, path, gathered, source) for r in ranks]
    packed = [p for p in cluster.wait_all(ars, timeout=cluster.spec.timeout, what=f"pull {name}") if p is not None]
    return wire.loads(*packed[0])


def _check_found(name, head, path, where) -> None:
    first = where[0]
    if isinstance(first, tuple) and first[0] == "not a model":
        what = "is not defined" if first[1] is None else f"is a {first[1]}, not a torch.nn.Module"
        raise PlanError(f"pull {name}: {head} {what} on the ranks; NAME.path pulls a parameter or buffer of a "
                        f"model the ranks hold (train it with %%distrain, or define it in a %%dist cell)")
    if all(isinstance(w, tuple) or w == "meta" for w in where):
        near = sorted({n for w in where if isinstance(w, tuple) for n in w[1]})
        hint = f"; nearest: {', '.join(f'{head}.{n}' for n in near)}" if near else ""
        raise PlanError(f"pull {name}: {head} has no parameter or buffer {path!r}{hint}")
