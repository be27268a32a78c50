"""Rank side of ``%dist scale``: the world re-formed at a new size, and what the added ranks inherit.

The kernel (:mod:`distnb.elastic.scaling`) starts the added engines, then calls :func:`resize` on every
rank that stays (the new ones get :func:`distnb.engine.process.runtime.setup`): the process group is
formed again at the new ``world_size`` on a fresh port. :func:`share` then hands the added
ranks what the surviving ranks hold, from rank 0 over ``torch.distributed`` (one
``broadcast_object_list`` for the objects, one ``broadcast`` of every tensor's bytes), never
through the kernel: each replicated (ddp) model with its optimizer state, lr schedule,
fp16 loss scale, epoch, global step and sampler position, the notebook names pushed to
the ranks earlier, and the names ``%%dist`` cells defined on the ranks that the added ranks
lack (rank 0's values; :func:`defined_names`). A name that cannot be pickled (a lock, a
process group, a sharded DTensor) is not carried, and the scale names it. Models sharded in
place (fsdp, tensor, pipeline, ps) are not carried here: the kernel reshards them through a
DCP checkpoint or sends them again from the notebook's weights.

The sampler position of an unfinished epoch is carried as which samples were trained, not as a
count (:mod:`distnb.engine.train.epochrest`): the epoch's layout over the old data shards and the
positions each took, so the new world finishes the epoch with exactly the samples not trained yet.

Idea: elastic data parallelism (torchelastic, Horovod Elastic) re-forms the group and
broadcasts rank 0's state to joining workers; those restart the worker processes, here the
surviving engines and their Python state stay.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from distnb.core.plan import STRATEGIES, TrainPlan
from distnb.engine import strategies
from distnb.engine.process import binding, runtime
from distnb.engine.process.collectives import group_device, on_group
from distnb.engine.train import datasets, epochrest, loop, shards
from distnb.engine.transport import wire

#: Names distnb binds in every rank's namespace (the rank's identity, a training cell's objects): never the user's.
BOUND = frozenset({"rank", "world_size", "local_rank", "node_rank", "device", "model", "optimizer", "ctx", "loss",
                   "batch"})


def resize(ns: dict, rank: int, world_size: int, num_threads: int, master_addr: str, master_port: int,
           local_rank: int | None = None, bind_among: int | None = None, local_world_size: int | None = None) -> dict:
    """This (surviving) rank joins the world of ``world_size`` ranks formed on ``master_port`` as ``rank``.

    What holds the old group (strategy wrappers) is dropped first, the sampler positions are
    converted (see the module's docstring), ``RANK``/``WORLD_SIZE`` (and ``LOCAL_RANK``: one
    host) and ``rank``/``world_size``/``local_rank`` in the namespace updated and ``num_threads``
    torch threads set. ``rank`` differs from this rank's old one only when a lower rank is gone
    (``--on-failure shrink``); ``local_rank`` (this rank's index on its host; default ``rank``,
    right on one host) only then too, and never for a GPU rank: it names the rank's device,
    ``cuda:<local_rank>``, fixed when CUDA started (the kernel keeps it). ``local_world_size``: the ranks
    now on this host (``LOCAL_WORLD_SIZE``). ``bind_among``: the ranks now sharing this host's cores (see
    :func:`distnb.engine.process.runtime.setup`; more ranks than cores unbinds). Every rank of the new world calls
    this (or ``setup``, for the added ones) at once: the rendezvous waits for all of them.

    Returns
    -------
    dict
        :func:`distnb.engine.process.runtime.info` of this rank.
    """
    runtime.mark_broken(ns)
    st = runtime.STATE
    old = st.world_size
    for run in loop.RUNS.values():
        convert_position(run, old, world_size)
    local_rank = rank if local_rank is None else local_rank
    st.rank, st.world_size, st.local_rank = rank, world_size, local_rank
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS=str(num_threads))
    if local_world_size:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    torch.set_num_threads(num_threads)
    binding.bind(local_rank, bind_among)
    runtime._init_group(master_addr, master_port)
    ns.update(rank=rank, world_size=world_size, local_rank=local_rank)
    return runtime.info()


def convert_position(run, old_world: int, new_world: int) -> None:
    """``run``'s sampler position (an unfinished epoch) from ``old_world`` ranks to ``new_world``: which samples
    were trained, as a trail of the epoch's segments (:func:`distnb.engine.train.epochrest.carry`)."""
    if old_world == new_world or not (run.epoch_samples or epochrest.active(run)):
        return
    plan = (run.plan_dict or {})
    try:
        before = strategies.data_parallel_size(TrainPlan.from_dict(plan), old_world)
    except Exception:  # a plan this version cannot read (or none): ranks are the data shards
        before = old_world
    after = 1 if before == 1 else before * new_world // old_world  # (tensor, pipeline: 1; a mesh keeps its TP size)
    source = datasets.SOURCES.get((run.epoch_data or (None,))[0])
    epochrest.carry(run, before, after, exact=epochrest.exact_for(source) if source is not None else True)


def _carried(run) -> bool:
    """Whether ``run`` reaches added ranks by broadcast (its module is whole on every rank: ddp)."""
    key = run.strategy_key or ((run.plan_dict or {}).get("strategy", "ddp"),)
    return not STRATEGIES[key[0]][1]


def _run_state(run) -> dict:
    """What rank 0 sends of a model: the module, counters, optimizer, schedule and loss scale."""
    scheduler = None
    if run.scheduler is not None:
        scheduler = dict(name=run.schedule_name, total=run.schedule_total, state=run.scheduler.state_dict())
    return dict(module=run.module, epoch=run.epoch, epoch_step=run.epoch_step, epoch_samples=run.epoch_samples,
                epoch_trail=run.epoch_trail, epoch_data=run.epoch_data,
                steps=run.steps, optimizer_steps=run.optimizer_steps, plan_dict=run.plan_dict,
                eager_step_time=run.eager_step_time, cell_first_epoch=run.cell_first_epoch,
                optimizer_key=run.optimizer_key,
                optimizer=None if run.optimizer is None else run.optimizer.state_dict(), scheduler=scheduler,
                scaler=None if run.scaler is None else run.scaler.state_dict())


def share(ns: dict, names: list, old_world: int, defined: bool = True) -> dict:
    """Rank 0 gives ranks ``old_world`` and above its models' state, the pushed ``names`` and the names they lack.

    A collective: every rank of the new world calls it right after the group is formed.

    Parameters
    ----------
    names : list of str
        Notebook names pushed to the ranks earlier (``%dist push``, the names a training body
        read); those rank 0 holds are sent.
    old_world : int
        The world size before the scale: ranks below it keep what they hold.
    defined : bool
        Also send the names ``%%dist`` cells defined on rank 0 that a receiving rank lacks
        (:func:`defined_names`; ``%dist scale``). ``--on-failure shrink``'s survivors hold
        their own (False).

    Returns
    -------
    dict
        ``models`` (names carried), ``names`` (pushed names carried), ``defined`` (names
        defined on the ranks carried), ``unpicklable`` ({name: why} of those that could not
        be sent), ``bytes`` (tensor bytes broadcast), ``positions`` (model -> (epoch,
        epoch_samples, steps, the epoch its last cell started at) on this rank now, every model).
    """
    st = runtime.STATE
    wanted = _lacking(ns, names, old_world) if defined else []
    head = [None]
    if st.rank == 0:
        own, unpicklable = _picklable(ns, wanted)
        state = dict(runs={k: _run_state(r) for k, r in loop.RUNS.items() if _carried(r)},
                     names={k: ns[k] for k in names if k in ns}, defined=own)
        payload, descs, buffers = wire.pack(state)
        head = [(payload, descs, [len(b) for b in buffers], sorted(state["runs"]), sorted(state["names"]),
                 sorted(own), unpicklable)]
        flat = on_group(torch.from_numpy(_concat(buffers)))  # nccl's group has no backend for a CPU tensor
    dist.broadcast_object_list(head, src=0)
    payload, descs, sizes, models, carried_names, carried_defined, unpicklable = head[0]
    if st.rank != 0:
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=group_device())
    if sizes:
        dist.broadcast(flat, src=0)
    if st.rank >= old_world:
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        raw = flat.cpu().numpy()
        _adopt(ns, wire.loads(payload, descs, [raw[a:b] for a, b in zip(offsets, offsets[1:])]))
    positions = {k: (r.epoch, r.epoch_samples, r.steps, r.cell_first_epoch) for k, r in loop.RUNS.items()}
    return dict(models=models, names=carried_names, defined=carried_defined, unpicklable=unpicklable,
                bytes=int(sum(sizes)), positions=positions)


def defined_names(ns: dict) -> list:
    """The names ``%%dist`` cells bound in this rank's namespace that are there now (:data:`runtime.CELL_NAMES`).

    Not: names starting with ``_`` (IPython's and distnb's), :data:`BOUND`, the models and data
    sets distnb installed (:data:`distnb.engine.train.loop.RUNS`, :data:`~distnb.engine.train.shards.SHARDS`, data
    sets loaded on the ranks): those reach the added ranks by their own ways. Nor what training bodies leave in the
    namespace (``x, y = batch``): a ``%%distrain`` cell is not a ``%%dist`` cell.
    """
    skip = BOUND | set(loop.RUNS) | set(shards.SHARDS) | set(datasets.SOURCES)
    return sorted(k for k in runtime.CELL_NAMES if k in ns and isinstance(k, str) and k.isidentifier()
                  and not k.startswith("_") and k not in skip)


def _lacking(ns: dict, names: list, old_world: int) -> list:
    """Rank 0's :func:`defined_names` (not pushed) that some rank ``old_world`` or above lacks; a collective."""
    st = runtime.STATE
    offer = [defined_names(ns) if st.rank == 0 else None]
    dist.broadcast_object_list(offer, src=0)
    pushed = set(names)
    mine = [k for k in offer[0] if k not in ns and k not in pushed] if st.rank >= old_world else []
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted(set().union(*every))


def _picklable(ns: dict, wanted: list) -> tuple[dict, dict]:
    """({name: value} of ``wanted`` that :func:`distnb.engine.transport.wire.pack` can send, {name: why not} of the others)."""
    own, unpicklable = {}, {}
    for k in wanted:
        try:
            wire.pack(ns[k])  # tensors are cut out, not copied: this costs the pickle of the rest
        except Exception as exc:
            unpicklable[k] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
            continue
        own[k] = ns[k]
    return own, unpicklable


def _concat(buffers):
    import numpy as np

    return np.concatenate(buffers) if buffers else np.empty(0, dtype=np.uint8)


def _adopt(ns: dict, state: dict) -> None:
    """An added rank takes rank 0's names and models; each optimizer is rebuilt at the model's next cell
    (:func:`distnb.engine.train.stepping.adopt_optimizer`)."""
    ns.update(state["defined"])
    runtime.CELL_NAMES.update(state["defined"])  # as if its cells had run here (it may be rank 0 one day)
    ns.update(state["names"])
    device = runtime.STATE.device
    for name, held in state["runs"].items():
        module = held.pop("module").to(device)
        old = loop.RUNS.get(name)
        if old is not None and old.strategy is not None:
            old.strategy.close()
        run = loop.Run(module)
        for key in ("epoch", "epoch_step", "epoch_samples", "epoch_trail", "epoch_data", "steps", "optimizer_steps",
                    "plan_dict", "eager_step_time", "cell_first_epoch"):
            setattr(run, key, held[key])
        if held["scaler"] is not None:
            run.scaler = torch.amp.GradScaler(device.type)
            run.scaler.load_state_dict(held["scaler"])
        run.inherited = dict(optimizer_key=held["optimizer_key"], optimizer=held["optimizer"],
                             scheduler=held["scheduler"])
        loop.RUNS[name] = run
        ns[name] = module

