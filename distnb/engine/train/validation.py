"""Validation on held-out data (``--val-data``): exact sums and counts, early stopping, the best weights.

The validation set is scattered like the training set (:func:`distnb.transfer.data.scatter`, the same
seeded, disjoint, covering shards). Each rank evaluates its own shard in batches of
``--batch-size``; every rank runs the *same number* of forwards (FSDP all-gathers, tensor
parallel collectives and DDP buffers need every rank in every forward): a rank whose shard is
shorter runs its last forwards on a *masked* pad sample that counts in no sum, never on
repeated samples that would be counted twice.

For each batch the body runs as in training (same ``batch``, ``model``, ``loss``) under
``model.eval()``, ``torch.no_grad()`` and the cell's autocast; ``model(...)`` returns the
output, which is also captured for the metric. Per batch of ``k`` real samples the body's
``loss`` (a batch mean) adds ``loss * k`` to the loss sum and ``k`` to the count; the metric
(``--metric NAME``: ``metric(output, target)`` with ``target`` the batch's last element)
adds the sum of its per-sample scores and their number (a scalar counts as a batch mean of
``k`` samples). The default metric is accuracy (``output.argmax(-1) == target``) when the
output holds class scores for an integer target. The sums are all-reduced over the ranks
that hold different shards, so the figures are exact, not means of means. Strategies where
every rank trains on the same batches (tensor, pipeline) evaluate the whole set on every rank
and need no reduction; a pipeline runs each batch through its stages with the schedule's
forward-only ``eval()`` (``Pipeline.validation_sums``: the last stage runs the body and the
metric, and broadcasts the sums).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distnb.core.plan import BOUND_PREFIX
from distnb.engine.process.collectives import on_group
from distnb.engine.transport import shard as sharding


class _Capture:
    """What the body calls as ``model`` during validation: the eval model, its output remembered."""

    def __init__(self, model):
        self._model, self.outputs = model, []

    def __call__(self, *args, **kwargs):
        out = self._model(*args, **kwargs)
        self.outputs.append(out)
        return out

    def __getattr__(self, name):
        if name in ("_model", "outputs"):
            raise AttributeError(name)
        return getattr(self._model, name)


def _target(batch):
    if isinstance(batch, dict):
        return list(batch.values())[-1] if batch else None
    if isinstance(batch, (tuple, list)) and len(batch) > 1:
        return batch[-1]
    return None


def accuracy(output, target):
    """Per-element correctness of class scores ``output`` (``[..., C]``) for integer ``target`` (``[...]``)."""
    return (output.argmax(-1) == target).float()


def default_metric(output, target):
    """Accuracy when ``output`` holds class scores for an integer ``target``; else None (no metric)."""
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if target.dtype.is_floating_point or output.dim() != target.dim() + 1 or output.shape[:-1] != target.shape:
        return None
    return accuracy


def _metric_sums(fn, output, target, k: int) -> tuple:
    value = fn(output, target)
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(float(value))
    value = value.detach().double()
    if value.dim() == 0:  # sums stay tensors where the metric is (no GPU sync per batch)
        return value * k, float(k)
    return value.sum(), float(value.numel())


def _floats(found):
    """``(sum, count)`` as floats, or None (a pipeline's stage adds them into its own CPU sums)."""
    return None if found is None else (float(found[0]), float(found[1]))


class Validator:
    """Evaluates one validation set on this rank for one cell.

    Parameters
    ----------
    plan : distnb.core.plan.TrainPlan
    run : distnb.engine.train.loop.Run
    data : distnb.engine.train.shards.Shard
        This rank's shard of ``plan.val_data``.
    ns : dict
        The engine namespace (the body's names, ``--metric``).
    """

    def __init__(self, plan, run, data, ns, device):
        self.plan, self.run, self.data, self.ns, self.device = plan, run, data, ns, device
        self.history = []
        self.best = None  # (loss, epoch)
        self.best_state = None
        self.bad_evaluations = 0
        self.metric_name = self._metric_label()
        # the longest shard (a part each rank built with make(rank, world_size) says its own: engine/valparts.py)
        longest = getattr(data, "longest", None) or sharding.shard_length(data.num_samples, data.num_shards, 0)
        self.num_batches = max(1, -(-longest // plan.batch_size))

    def _metric_label(self):
        """The metric's notebook name, or its function's name when the API was given the object itself."""
        name = self.plan.metric
        if name is not None and name.startswith(BOUND_PREFIX):  # bound by Session.train (no notebook name)
            return getattr(self.ns.get(name), "__name__", name)
        return name

    def _metric_fn(self, output, target):
        if self.plan.metric is not None:
            fn = self.ns.get(self.plan.metric)
            if not callable(fn):
                raise NameError(f"--metric {self.plan.metric} is not a function on this rank")
            return fn
        fn = default_metric(output, target)
        if fn is not None:
            self.metric_name = "accuracy"
        return fn

    def evaluate(self, ctx, code, epoch: int) -> dict:
        """One validation pass (every rank): dict(epoch, loss, metric, metric_name, samples)."""
        strategy, module = self.run.strategy, self.run.module
        n_local = len(self.data)
        # loss sum, samples, metric sum, metric count, has metric: summed on the device, read once per pass
        sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        ns = self.ns
        saved = {k: ns.get(k) for k in ("batch", "model", "loss")}
        strategy.sync_buffers()  # the BatchNorm statistics the notebook gets (rank 0's), on every rank
        module.eval()
        try:
            with torch.no_grad():
                for j in range(self.num_batches):
                    lo, hi = j * self.plan.batch_size, min((j + 1) * self.plan.batch_size, n_local)
                    k = max(0, hi - lo)
                    idx = torch.arange(lo, hi) if k else torch.zeros(1, dtype=torch.long)  # masked pad sample
                    sums += self._batch(ctx, code, idx, k, strategy).to(self.device)
        except Exception as exc:  # the body ran on the training batches: say this one was a validation batch
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (f"{exc.args[0]}\n[distnb] rank {ctx.rank} raised this on a --val-data {self.plan.val_data} "
                            f"batch (validation after epoch {epoch}); the training batches ran",) + exc.args[1:]
            raise
        finally:
            module.train()
            ns.update(saved)
        if self.data.num_shards > 1:  # ranks with different shards: exact totals over all of them
            sums = on_group(sums)  # already there unless the rank's device is not the group's
            dist.all_reduce(sums)
            copies = dist.get_world_size() // self.data.num_shards
            if copies > 1:  # the ranks of one shard (a tensor-parallel group) evaluated the same samples
                sums /= copies
        loss_sum, count, metric_sum, metric_count, has_metric = sums.tolist()
        if has_metric:  # known on every rank (a pipeline's metric runs on its last stage only)
            self.metric_name = self._metric_label() or "accuracy"
        loss = loss_sum / count if count else math.nan
        metric = metric_sum / metric_count if has_metric and metric_count else None
        entry = dict(epoch=epoch, loss=loss, metric=metric, metric_name=self.metric_name if metric is not None else None,
                     samples=int(count))
        self.history.append(entry)
        self._track_best(entry)
        return entry

    def _metric_sums(self, ctx, output, target, k):
        """(sum, count) of the metric on one batch's output, or None when there is no metric."""
        if output is None or target is None:
            return None
        fn = self._metric_fn(output, target)
        if fn is None:
            return None
        try:
            return _metric_sums(fn, output, target, max(k, 1))
        except Exception as exc:
            raise type(exc)(f"--metric {self.plan.metric or 'accuracy'} raised on rank {ctx.rank}: {exc}") from exc

    def _batch(self, ctx, code, idx, k, strategy):
        batch = self.data.batch(idx, self.device) if len(self.data) else self._pad(self.data)
        own = getattr(strategy, "validation_sums", None)  # pipeline: through the stages
        if own is not None:
            return own(self.ns, code, ctx, batch, k, lambda out, target, n: _floats(self._metric_sums(ctx, out, target, n)))
        capture = _Capture(strategy.eval_model())
        ns = self.ns
        ns.update(batch=batch, model=capture)
        ns.pop("loss", None)
        ctx._clear_items()
        with ctx.autocast():
            exec(code, ns)
        loss, items = ns.get("loss"), ctx._count
        ctx._clear_items()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("the body left no scalar `loss` on a validation batch")
        out = torch.zeros(5, dtype=torch.float64, device=loss.device)
        if k and items is not None:  # a loss summed over ctx.num_items items: the loss is their mean
            out[0], out[1] = loss.detach().double(), items.to(loss.device)
        elif k:
            out[0], out[1] = loss.detach().double() * k, k
        found = self._metric_sums(ctx, capture.outputs[-1] if capture.outputs else None, _target(batch), k)
        if found is not None:
            out[4] = 1.0
            if k:
                out[2], out[3] = found
        return out

    def _pad(self, data):
        """A batch of one zero sample shaped as ``data``'s (an empty shard: fewer samples than ranks), counted in no
        sum: the rank still runs every forward the others run (FSDP gathers, DDP buffers need it)."""
        zeros = [torch.zeros((1, *c.shape[1:]), dtype=c.dtype) for c in data.columns]
        return type(data)(1, 1, data.seed, 0, data.structure, zeros).batch(slice(None), self.device)

    def _track_best(self, entry) -> None:
        loss = entry["loss"]
        if self.best is None or (math.isfinite(loss) and loss < self.best[0] - self.plan.min_delta):
            self.best = (loss, entry["epoch"])
            self.bad_evaluations = 0
            if self.plan.restore_best:
                self.best_state = _snapshot(self.run.module)
        else:
            self.bad_evaluations += 1

    @property
    def out_of_patience(self) -> bool:
        return self.plan.patience is not None and self.bad_evaluations >= self.plan.patience

    def restore_best(self) -> bool:
        """Load the best validation weights back into this rank's model; True if there were any."""
        if self.best_state is None:
            return False
        live = self.run.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, value in self.best_state.items():
                live[key].copy_(value)
        masters = getattr(self.run.strategy, "masters", None)  # ps with staleness: the servers' copies too
        if masters:
            owned = self.run.strategy.owned[self.run.strategy.rank]
            with torch.no_grad():
                for master, param in zip(masters, owned):
                    master.copy_(param)
        return True


def _snapshot(module) -> dict:
    """A copy of every tensor this rank holds of ``module`` (local shards, this stage)."""
    return {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and not v.is_meta}
