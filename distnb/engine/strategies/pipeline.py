"""Pipeline parallelism with ``torch.distributed.pipelining``: one stage per rank.

The model is cut into ``world_size`` consecutive *stages*; rank ``r`` holds stage ``r`` only
(the other stages' parameters and buffers are freed on it: replaced by ``meta`` tensors;
tensors a module spanning several stages holds itself, e.g. a parameter of the root, stay on
every rank and are trained by the stage the trace puts them in). Each batch
is cut into ``--microbatches M`` equal microbatches that flow through the stages, and
``--schedule`` picks the order of the forward and backward passes:

- ``gpipe``: all forwards, then all backwards (GPipe, Huang et al., "GPipe: Efficient
  Training of Giant Neural Networks using Pipeline Parallelism", NeurIPS 2019);
- ``1f1b``: after a warm-up, one forward then one backward, which bounds the activations
  kept per stage by the number of stages instead of M (PipeDream-Flush, Narayanan et al.,
  "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021). Needs ``M >= world_size``.

Both flush the pipeline every step (synchronous): a step equals one process training on
the whole batch. Every rank trains on the same batches (``data_parallel = False``: the
data set is not sharded).

Stages
------
Default split: the top-level children of the model (descending through a wrapper that
holds a single child and no tensors of its own, e.g. ``self.net = nn.Sequential(...)``; an
``nn.ModuleList`` or ``nn.ModuleDict`` child counts as its elements, ``blocks.0``, ...)
balanced by parameter count into ``world_size`` contiguous, non-empty groups (the largest
group as small as possible). ``--split NAME,...`` gives the ``world_size - 1`` submodules
(names as in ``model.named_modules()``) that each begin a new stage
(:mod:`distnb.engine.strategies.pipeline_split`).

A plain ``nn.Sequential`` cut at top-level children is split directly: stage ``r`` is an
``nn.Sequential`` of its children under their original names, so its ``state_dict`` keys
are the model's own. Any other model is traced with ``torch.distributed.pipelining.pipeline``
(``torch.export``) with ``SplitPoint.BEGINNING`` at each split point; the trace runs on a
``meta`` copy (no memory, no compute) and the rank's real parameters and buffers are then
put into its stage (non-persistent buffers and plain tensor attributes, e.g. a causal mask,
too: export lifts them into the stage as buffers; they are not in the weights that come back). Traced stages always run in training mode (dropout and batch norm as
traced), and the model's forward must be traceable by ``torch.export``. The input of each
stage has a fixed shape per microbatch size: a batch of a new size (the last, partial
batch of an epoch) builds a new schedule once.

The step body
-------------
The body is the same as for ddp (``x, y = batch; loss = F.cross_entropy(model(x), y)``);
tensors never move between stages by hand. On the first stage, the body runs with
``model`` bound to a recorder that captures the arguments of ``model(...)`` (positional
tensors whose first dimension is the batch) and stops the body there; they are fed to the
schedule. On the last stage, the schedule's loss function runs the body once per
microbatch with ``batch`` = that microbatch's slice of the batch and ``model(...)``
returning the last stage's output for it (a traced model's tuple, list or dict as the
model returns it: the stage's flattened tensors are put back into the structure of a meta
forward's output; a tensor returned from an earlier stage is an error), and takes its ``loss`` (or, with ``--loss
NAME``, calls ``NAME(output, target)`` with ``target`` the last element of the
microbatch). Each microbatch loss is weighted by its share of the batch (``n_mb / n``, the
schedule's own scaling is off), so the gradients are those of the batch's mean loss. The
batch loss (mean over microbatches) is broadcast from the last stage, so every rank
reports it.

A batch of ``n`` samples uses ``M`` microbatches when ``M`` divides ``n`` (checked for
``--batch-size`` before anything runs), else the largest divisor of ``n`` below ``M``
(the last, partial batch; 1F1B falls back to GPipe there when that is fewer than the
stages).

Errors
------
Kernel side (:class:`~distnb.engine.strategies.StrategyError`, before anything runs):
``--split`` with a number of names other than ``world_size - 1``, a name that is not a
submodule, names out of forward order or one inside another, a stage left empty; fewer
blocks than ranks; ``--microbatches`` not dividing ``--batch-size``; 1F1B with fewer
microbatches than stages; parameters tied across stages. On the ranks, every error raised
during a step is prefixed with ``pipeline stage S of W (rank R)``.
"""

from __future__ import annotations

import functools
import itertools
import math
import types
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from distnb.engine.process.collectives import group_device, on_group
from distnb.engine.strategies import Strategy, StrategyError, check_loss, tensor_bytes
from distnb.engine.strategies.pipeline_split import is_plain_sequential, num_microbatches, split_points, tensor_owners
from distnb.engine.strategies.pipeline_trace import (
    check_first_stage_inputs,
    meta_copy,
    output_structure,
    plain_tensors,
    restructure,
)
from distnb.engine.transport import stateout, wire


# -- rank side -----------------------------------------------------------------------------
class _Captured(BaseException):
    """Raised by the first stage's recorder: the body called ``model(...)`` (aborts the body)."""

    def __init__(self, args, kwargs):
        super().__init__()
        self.call_args, self.call_kwargs = args, kwargs


class _ModelStandIn:
    """What the body sees as ``model`` inside a pipeline step: ``fn`` when called, the stage otherwise."""

    def __init__(self, stage_module, fn):
        self._stage_module, self._fn = stage_module, fn

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    def __getattr__(self, name):
        if name in ("_stage_module", "_fn"):  # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self._stage_module, name)


def _set_tensor(root, name, value):
    owner, _, attr = name.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    setattr(mod, attr, value)


def _get_tensor(root, name):
    owner, _, attr = name.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    return getattr(mod, attr)


def _batch_size(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    raise TypeError(f"a pipeline batch must hold tensors, got {type(batch).__name__}")


def _slice_batch(batch, start, stop):
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: _slice_batch(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice_batch(v, start, stop) for v in batch)
    return batch


def _target_of(batch):
    """The target of a microbatch: the last element of a tuple or dict (None for one tensor)."""
    if isinstance(batch, dict):
        return list(batch.values())[-1] if batch else None
    if isinstance(batch, (tuple, list)) and len(batch) > 1:
        return batch[-1]
    return None


def _annotate(exc: BaseException, where: str) -> None:
    """Prefix ``exc``'s message with ``where`` (the stage and rank)."""
    if not isinstance(exc, Exception):
        return
    if exc.args and isinstance(exc.args[0], str):
        if not exc.args[0].startswith(where):
            exc.args = (f"{where}: {exc.args[0]}",) + exc.args[1:]
    elif not exc.args:
        exc.args = (where,)
    else:
        exc.add_note(where)


class _Schedule:
    """A built stage and schedule for one batch size (``structure``: the model's output, see :func:`~.pipeline_trace.output_structure`)."""

    def __init__(self, stage, schedule, microbatches, submodule, structure=None):
        self.stage, self.schedule, self.microbatches, self.submodule = stage, schedule, microbatches, submodule
        self.structure = structure


class Pipeline(Strategy):
    """Stage ``rank`` of the model on each rank; microbatches flow through a GPipe or 1F1B schedule."""

    name = "pipeline"
    data_parallel = False
    supports_loop = False
    grads_partitioned = True
    shards_first = True  # split on the meta device, then this rank materialises its part

    # kernel side ---------------------------------------------------------------------
    @classmethod
    def check(cls, plan, module, world_size: int) -> None:
        super().check(plan, module, world_size)
        m = plan.microbatches or world_size
        if plan.batch_size % m:
            how = f"--microbatches {m}" if plan.microbatches else f"the default --microbatches {m} (one per stage)"
            raise StrategyError(f"{how} does not divide --batch-size {plan.batch_size}: every microbatch must "
                                f"have the same size; choose a --batch-size that is a multiple of {m} or pass "
                                "--microbatches M dividing it")
        if plan.schedule == "1f1b" and m < world_size:
            raise StrategyError(f"--schedule 1f1b needs at least as many microbatches as stages ({world_size}), got "
                                f"--microbatches {m}; raise it or use --schedule gpipe")
        points = split_points(module, world_size, plan.split)
        owners = tensor_owners(module, points)
        params = {n for n, p in module.named_parameters() if p.requires_grad}
        empty = [s for s in range(world_size) if not any(owners.get(n) == s for n in params)]
        if empty:
            raise StrategyError(f"pipeline stage {empty[0]} of {world_size} would hold no trainable parameters "
                                f"(stages start at {', '.join(points)}): use fewer ranks (-n) or give --split so "
                                "every stage holds a layer with parameters")

    # rank side -----------------------------------------------------------------------
    def __init__(self, module, plan, device, ns):
        super().__init__(module, plan, device, ns)
        self.ns = ns
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.where = f"pipeline stage {self.rank} of {self.world_size} (rank {self.rank})"
        self.points = split_points(module, self.world_size, plan.split)
        self.owners = tensor_owners(module, self.points)
        self.microbatches = plan.microbatches or self.world_size
        self.sequential = is_plain_sequential(module) and all("." not in p for p in self.points)
        self._schedules: dict[int, _Schedule] = {}
        self._mb = None  # the step in progress (batch, code, ctx, losses)
        if self.sequential:
            names = [n for n, _ in module.named_children()]
            starts = [0] + [names.index(p) for p in self.points] + [len(names)]
            self.groups = [names[starts[s]:starts[s + 1]] for s in range(self.world_size)]
            meta = meta_copy(module)
            self._meta_stages = [nn.Sequential(OrderedDict((n, meta.get_submodule(n)) for n in group))
                                 for group in self.groups]
            self.model = nn.Sequential(OrderedDict((n, module.get_submodule(n)) for n in self.groups[self.rank]))
        else:
            self.model = module  # until the first step traces the stage
        # free the other stages' parameters and buffers (meta tensors keep their shapes)
        for name, owner in self.owners.items():
            if owner is not None and owner != self.rank:
                t = _get_tensor(module, name)
                if t is not None and not t.is_meta:
                    meta = torch.empty_like(t, device="meta")
                    _set_tensor(module, name, nn.Parameter(meta, requires_grad=t.requires_grad)
                                if isinstance(t, nn.Parameter) else meta)
        # this stage's parameters, and those held directly by modules spanning stages (they go to
        # whichever stage the trace puts them in; elsewhere they get no gradient and stay unchanged)
        self._params = [p for name, p in module.named_parameters() if self.owners.get(name) in (self.rank, None)]

    def keeps(self, name: str) -> bool:
        """This stage's tensors and those of modules spanning stages (every rank holds those)."""
        return self.owners.get(name) in (self.rank, None)

    def placed(self) -> None:
        self._params = [p for name, p in self.module.named_parameters() if self.owners.get(name) in (self.rank, None)]

    def parameters(self):
        return iter(self._params)

    def _stage_tensors(self) -> dict:
        """Name -> tensor of everything this rank holds for its stage (original state_dict keys)."""
        if self.sequential:
            return dict(self.model.state_dict(keep_vars=True))
        if self._schedules:
            sub = next(iter(self._schedules.values())).submodule
            return dict(sub.state_dict(keep_vars=True))
        # not traced yet: this stage's tensors and those of modules spanning stages (on every rank)
        return {k: v for k, v in self.module.state_dict(keep_vars=True).items()
                if self.owners.get(k) in (self.rank, None)}

    def holdings(self) -> dict:
        params = {id(p): p for p in self._stage_tensors().values() if isinstance(p, nn.Parameter)}
        return dict(param_bytes=sum(tensor_bytes(p) for p in params.values()), stage=self.rank)

    # one step --------------------------------------------------------------------------
    def _record(self, ns, code):
        """Run the body until it calls ``model(...)``; return the call's positional tensors."""
        ns["model"] = _ModelStandIn(self.model, self._capture)
        ns.pop("loss", None)
        try:
            exec(code, ns)
        except _Captured as captured:
            args, kwargs = captured.call_args, captured.call_kwargs
            captured.__traceback__ = None
        else:
            raise RuntimeError("the step body finished without calling `model(...)`: a pipeline step feeds the "
                               "arguments of the body's model call to the first stage")
        finally:
            ns["model"] = self.model
        if kwargs:
            raise TypeError(f"model(...) was called with keyword arguments ({', '.join(kwargs)}); the pipeline "
                            "passes positional tensors only")
        return args

    @staticmethod
    def _capture(*args, **kwargs):
        raise _Captured(args, kwargs)

    def _build(self, batch_size, args):
        """The stage and schedule for batches of ``batch_size`` (built once per size, on every rank)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        m = num_microbatches(batch_size, self.microbatches)
        if not args:
            raise TypeError("model(...) was called without arguments; the pipeline needs the input tensors")
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != batch_size:
                what = f"shape {tuple(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                raise TypeError(f"argument {i} of model(...) has {what}; the pipeline cuts every argument into "
                                f"microbatches along dim 0, which must be the batch ({batch_size} samples)")
        mb_args = tuple(torch.empty((batch_size // m,) + tuple(a.shape[1:]), dtype=a.dtype, device="meta")
                        for a in args)
        with torch.random.fork_rng(devices=[]):
            if self.sequential:
                if len(args) != 1:
                    raise TypeError(f"an nn.Sequential takes one input, model(...) got {len(args)}")
                x = mb_args[0]
                with torch.enable_grad():
                    for s, stage_mod in enumerate(self._meta_stages):
                        y = stage_mod(x)
                        if not isinstance(y, torch.Tensor):
                            raise TypeError(f"stage {s} returns {type(y).__name__}; a stage of an nn.Sequential "
                                            "must return one tensor")
                        if s == self.rank:
                            example_in, example_out = x, y
                        x = y
                stage = PipelineStage(self.model, self.rank, self.world_size, self.device,
                                      input_args=example_in.detach().requires_grad_(example_in.requires_grad),
                                      output_args=example_out.detach().requires_grad_(example_out.requires_grad))
                submodule = self.model
                structure = None
            else:
                stage, submodule = self._trace(mb_args)
                structure = output_structure(self.module, mb_args) if self.rank == self.world_size - 1 else None
        cls = ScheduleGPipe if self.plan.schedule == "gpipe" or m < self.world_size else Schedule1F1B
        schedule = cls(stage, n_microbatches=m, loss_fn=self._loss_fn, scale_grads=False)
        entry = self._schedules[batch_size] = _Schedule(stage, schedule, m, submodule, structure)
        return entry

    def _trace(self, mb_args):
        """Trace a meta copy with split points; build this rank's stage and give it the real tensors."""
        from torch.distributed.pipelining import SplitPoint, pipeline

        meta = meta_copy(self.module)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pipe = pipeline(meta, mb_args=mb_args, split_spec={p: SplitPoint.BEGINNING for p in self.points})
        except Exception as exc:
            raise RuntimeError(f"could not trace {type(self.module).__name__} into pipeline stages with "
                               f"torch.export ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                               "make the model an nn.Sequential, or keep its forward traceable") from exc
        if pipe.num_stages != self.world_size:
            raise RuntimeError(f"tracing {type(self.module).__name__} at {', '.join(self.points)} gave "
                               f"{pipe.num_stages} stages, not {self.world_size}: are those modules called in forward?")
        check_first_stage_inputs(pipe.split_gm.graph, self.points[0])
        stage = pipe.build_stage(self.rank, self.device)
        sub = stage.submod
        real = {**plain_tensors(self.module), **self.module.state_dict(keep_vars=True)}
        for name, t in itertools.chain(sub.named_parameters(remove_duplicate=False),
                                       sub.named_buffers(remove_duplicate=False)):
            if name not in real:
                raise RuntimeError(f"the traced stage holds {name!r}, which is not a tensor of the model")
            if self.owners.get(name) not in (self.rank, None):
                raise RuntimeError(f"the trace puts {name} in stage {self.rank}, but it belongs to stage "
                                   f"{self.owners[name]}: either the model's forward does not call its blocks in the "
                                   "order they are registered (give --split names in forward order), or it uses "
                                   f"{name} in a second stage too, outside its module (as in `h @ "
                                   "self.wte.weight.T`, a weight tied across stages), which pipeline stages cannot "
                                   "share (use another --strategy, e.g. fsdp)")
            if real[name].is_meta:
                raise RuntimeError(f"{name} is used by stage {self.rank} but held by another stage")
            _set_tensor(sub, name, real[name])
        return stage, sub

    def _loss_fn(self, output, index):
        """The schedule's loss on the last stage: the body (or --loss) on microbatch ``index``'s samples."""
        mb = self._mb
        output = restructure(output, self._schedules[mb.size].structure, self.where)
        start, stop = int(index[0]), int(index[-1]) + 1
        part = _slice_batch(mb.batch, start, stop)
        ns = self.ns
        if self.plan.loss is not None:
            fn = ns.get(self.plan.loss)
            if not callable(fn):
                raise NameError(f"--loss {self.plan.loss} is not a function on rank {self.rank}")
            if isinstance(part, torch.Tensor):
                raise TypeError("--loss needs a target: the batch is one tensor; make it (inputs, ..., target)")
            target = list(part.values())[-1] if isinstance(part, dict) else part[-1]
            loss = fn(output, target)
        else:
            calls = []

            def forward(*args, **kwargs):
                calls.append(1)
                if len(calls) > 1:
                    raise RuntimeError("the step body calls model(...) more than once; a pipeline step runs one "
                                       "forward pass")
                return output

            ns["batch"], ns["model"] = part, _ModelStandIn(self.model, forward)
            ns.pop("loss", None)
            exec(mb.code, ns)
            loss = ns.get("loss")
            if not calls:
                raise RuntimeError("the step body never called model(...) on the last stage")
        weight = (stop - start) / mb.size
        if mb.evaluating:  # validation: no gradient; the metric sees this microbatch's output and target
            mb.losses.append(loss.detach().double() * weight)
            mb.outputs.append((output, _target_of(part)))
            return loss
        lenient = types.SimpleNamespace(plan=types.SimpleNamespace(nan="skip"), rank=mb.ctx.rank,
                                        epoch=mb.ctx.epoch, step=mb.ctx.step)
        check_loss(loss, lenient)  # the non-finite check runs on every rank after the step
        mb.ctx.note_loss_dtype(loss)  # summed in fp64 below; a bf16 loss is said once
        mb.losses.append(loss.detach().double() * weight)
        return mb.ctx.scale_loss(loss * weight)  # --accumulate and fp16 scale what the stage back-propagates

    def _schedule_for(self, ns, code, size, first):
        """The schedule for batches of ``size`` (built on first use) and the first stage's recorded inputs."""
        entry = self._schedules.get(size)
        args = self._record(ns, code) if first or entry is None else None
        if entry is None:
            entry = self._build(size, args)
            self.model = entry.submodule
        return entry, args

    def step(self, ns, code, ctx):
        batch = ns["batch"]
        size = _batch_size(batch)
        first, last = self.rank == 0, self.rank == self.world_size - 1
        self._mb = types.SimpleNamespace(batch=batch, size=size, code=code, ctx=ctx, losses=[], evaluating=False)
        try:
            entry, args = self._schedule_for(ns, code, size, first)
            target = torch.arange(size) if last else None
            with ctx.autocast():
                entry.schedule.step(*(args if first else ()), target=target, return_outputs=False)
        except BaseException as exc:
            _annotate(exc, self.where)
            raise
        finally:
            ns["batch"], ns["model"] = batch, self.model
        total = torch.zeros((), dtype=torch.float64, device=group_device())
        if last:
            total = on_group(torch.stack(self._mb.losses).sum().double())
        self._mb = None
        dist.broadcast(total, src=self.world_size - 1)
        value = total.item()
        if self.plan.nan == "stop" and not math.isfinite(value):
            raise FloatingPointError(f"the loss is {value} at rank {ctx.rank}, epoch {ctx.epoch}, step {ctx.step}; "
                                     "training stopped before the update (lower --lr, check the data, or pass "
                                     "--nan skip)")
        loss = total.float()
        ns["loss"] = loss
        return loss, value

    def validation_sums(self, ns, code, ctx, batch, k, metric_sums):
        """One validation forward through the stages (``schedule.eval``, no backward); every rank calls it.

        The last stage runs the body on each microbatch's output; its sums (loss x samples,
        samples, metric sum, metric count, has metric: see :mod:`distnb.engine.train.validation`) are
        broadcast, so every rank returns them. ``k``: real samples (0: a masked pad batch).
        """
        size = _batch_size(batch)
        first, last = self.rank == 0, self.rank == self.world_size - 1
        self._mb = types.SimpleNamespace(batch=batch, size=size, code=code, ctx=ctx, losses=[], outputs=[],
                                         evaluating=True)
        saved = {key: ns.get(key) for key in ("batch", "model", "loss")}
        ns["batch"] = batch
        try:
            entry, args = self._schedule_for(ns, code, size, first)
            with ctx.autocast():
                entry.schedule.eval(*(args if first else ()), target=torch.arange(size) if last else None,
                                    return_outputs=False)
            sums = torch.zeros(5, dtype=torch.float64)
            if last:
                if k:
                    sums[0], sums[1] = float(torch.stack(self._mb.losses).sum()) * k, k
                for output, target in self._mb.outputs:
                    found = metric_sums(output, target, k)
                    if found is not None:
                        sums[4] = 1.0
                        if k:
                            sums[2] += found[0]
                            sums[3] += found[1]
        except BaseException as exc:
            _annotate(exc, self.where)
            raise
        finally:
            self._mb = None
            ns.update(saved)
            ns["model"] = self.model
        sums = on_group(sums)
        dist.broadcast(sums, src=self.world_size - 1)
        return sums.cpu()

    # state -----------------------------------------------------------------------------
    def full_state(self, keys=None):
        """Every stage's tensors (``keys``: only these) on rank 0, sent one by one into its outbox; None elsewhere.

        The stages' key names are gathered (a small object), rank 0 says which rank sends each
        tensor, and each comes by ``send``/``recv`` into its place (:func:`stateout.write_state`):
        rank 0 holds its outbox plus one tensor. (``gather_object`` of the stages' tensors pickled
        them into a byte tensor on the device and allocated ``world_size`` times the largest stage on
        rank 0's; torch's docstring calls it "not well supported and inefficient" with GPU tensors.)
        """

        mine = {k: v for k, v in self._stage_tensors().items() if not v.is_meta}
        names = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(sorted(mine), names, dst=0)
        plan = [None]
        if self.rank == 0:
            plan[0] = self._senders(mine, names)
        dist.broadcast_object_list(plan, src=0)
        plan[0] = list(stateout.select(dict(plan[0]), keys).items())  # a part of the state (the same on every rank)
        if self.rank != 0:
            for key, src in plan[0]:
                if src == self.rank:
                    tensor = on_group(mine[key].detach().contiguous())
                    dist.send(tensor, dst=0)
            return None
        reference = self.module.state_dict(keep_vars=True)
        entries = []
        for key, src in plan[0]:
            if src == 0:
                entries.append((key, mine[key] if key in mine else reference[key]))
            else:
                entries.append((key, wire.describe(reference[key]), functools.partial(self._receive, src)))
        return stateout.write_state(entries)

    def _senders(self, mine, names) -> list:
        """Rank 0: ``(key, rank that sends it)`` for every key of the model's state, in its order."""
        reference = self.module.state_dict(keep_vars=True)
        held = {}
        for r, keys in enumerate(names):  # a tensor several stages hold (a root's): the last stage's, as trained
            for k in keys:
                held[k] = r
        plan, missing = [], []
        for k, v in reference.items():
            src = held.get(k, None if v.is_meta else 0)
            if src is None:
                missing.append(k)
            plan.append((k, src))
        if missing:
            raise RuntimeError(f"no stage holds {', '.join(missing[:5])}; the weights cannot be assembled")
        return plan

    def _receive(self, src: int, dst: torch.Tensor) -> None:
        """Rank 0: receive a tensor from rank ``src`` into ``dst`` (CPU, in the outbox); through the group's
        device when that is not the CPU (nccl)."""
        if group_device().type == "cpu":
            dist.recv(dst, src=src)  # group device: the CPU (gloo), checked on the line above
            return
        staging = torch.empty(dst.shape, dtype=dst.dtype, device=group_device())
        dist.recv(staging, src=src)
        dst.copy_(staging)

    def checkpoint_state(self, optimizer):
        """This stage's tensors (original keys, no two ranks share one) and its optimizer state.

        The optimizer state is flattened per parameter name (``state.NAME.exp_avg``,
        ``param_groups.NAME.lr``), so each rank's entries are its own.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model_sd = {k: v.detach() for k, v in self._stage_tensors().items() if not v.is_meta}
        if optimizer is None:  # loaded, not trained yet (%dist load): no optimizer state exists
            return model_sd, {}
        optim_sd = get_optimizer_state_dict(self.module, optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=True))
        return model_sd, optim_sd

    def load_checkpoint_state(self, optimizer, model_state, optimizer_state) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        tensors = self._stage_tensors()
        with torch.no_grad():
            for k, v in model_state.items():
                if v.data_ptr() != tensors[k].data_ptr():
                    tensors[k].copy_(v)
        if optimizer_state is None:  # the model only
            return
        set_optimizer_state_dict(self.module, optimizer, optimizer_state,
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))

    def close(self) -> None:
        self._schedules.clear()
        self._mb = None
        self.model = None


STRATEGY = Pipeline
