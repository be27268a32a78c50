"""A tensor plan is verified once, numerically: the split model must compute what the whole one does.

A column-wise layer leaves each rank with a slice of its output features; the forward between
it and its row-wise partner must act on each of those features alone (ReLU, GELU, dropout,
scaling). Any op that looks across them (a mean, sum, softmax or normalization over the hidden
dim, a reshape or view mixing it) sees only the rank's slice: the run finishes normally and
trains a different model. Neither the default plan (which pairs ``nn.Linear`` children by
registration order) nor a ``--tp-plan`` dict can see the functional code of a ``forward``, so
instead of guessing, the plan is checked on what the model really does.

Design
------
- When the strategy is built (:class:`VerifiedPlan.arm`, before ``parallelize_module``), a
  skeleton of the whole module is kept (:func:`skeleton`: its parameters on the meta device, so
  it holds no memory; the check fills it one module at a time from the split model's gathered
  tensors, :mod:`~distnb.engine.strategies.layered`, and falls back to the whole state below only
  for a forward that reads a module's tensors outside its call, up to :data:`VERIFY_MAX_BYTES`),
  and a forward pre-hook (``prepend=True``, ``with_kwargs=True``) is put on the module the body
  calls (after ``--compile``, on the compiled one).
- The first call of the model on this rank, whatever the body passes (a tensor, a tuple, a
  dict, keyword arguments; the first micro-step of a step body, a ``--loop`` body's first call,
  or validation's), runs the hook. The skeleton takes the split module's tensors as they are
  now, gathered whole one module at a time during its forward (collectives: a checkpoint loaded
  or weights adopted since the build are compared too; the fallback: the whole state at once,
  ``get_model_state_dict(full_state_dict=True)``); then in eval mode (BatchNorm's running
  statistics and dropout left alone), under ``torch.no_grad``, with autocast off and the RNG
  states saved and restored, the whole and the split module each run a forward on those same
  arguments. The outputs (tensors in
  any nesting of tuples, lists and dicts; a DTensor as its full tensor) are compared, relative to
  the largest value of the whole model's output, at a tolerance for their dtype
  (:data:`RTOL`); then again with both models' weights moved by the same seeded noise
  (:mod:`.moved`: a term across the hidden units that vanishes at the current weights,
  a gate initialised at 0, shows there). The hook then removes itself and drops the whole
  model: nothing runs per step; the cost, once per strategy build, is two all-gathers of the
  state (one module's tensors at a time) and two forwards of the whole model and of the split
  one, with one module's full tensors held at a time beside the rank's share.
- The ranks agree with one ``all_reduce`` (MAX) of each rank's verdict, so every rank makes the
  same decision and none waits. If any rank's outputs differ, every rank raises
  :class:`~distnb.engine.strategies.StrategyError` from inside the body's ``model(...)`` call,
  before any backward or optimizer step, the model as it found it (its weights moved back bit for bit).
  As every rank raised it alike after collectives that all completed, the process group is kept
  (:mod:`distnb.engine.train.beforestep`), and with it the model the ranks hold (a meta model's
  trained weights, carried into this placement, included). The refusal stays: a later forward of
  the same split model raises the same error at once, with no collective. The message names the
  first default pair whose row-wise output differs (outputs of every row-wise layer are compared
  too) and gives the fix.
- A ``--tp-plan`` dict is checked the same way and a mismatch is the same error: a plan that
  changes the model's function trains it silently wrong whoever wrote it. The exception is an
  output the plan leaves sharded on purpose (e.g. ``ColwiseParallel(use_local_output=True)`` on
  the last layer, for a loss that gathers it itself): its shape differs from the whole model's,
  so it cannot be compared, and rank 0 warns instead. Under the default plan a changed shape is
  an error (the default never shards an output on purpose).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Mapping

import torch

from distnb.engine.process.collectives import group_device
from distnb.engine.strategies import StrategyError, layered, moved
from distnb.engine.strategies.fsdp import used_outside

#: (rtol, atol) per output dtype: |split - whole| <= rtol * max|whole| + atol. Splitting changes
#: only the order of sums (float32: about 1e-7 relative); a non-elementwise op between a pair
#: changes the output by about 1e-2 relative or more.
#: Above this many bytes of parameters and buffers, a tensor plan whose model cannot run one module at a time
#: (:mod:`.layered`) is not verified (the fallback holds the whole model on every rank once, and a model split
#: because it is big may not fit whole).
VERIFY_MAX_BYTES = 256 << 20
RTOL = {torch.float64: (1e-7, 1e-12), torch.float32: (1e-3, 1e-6), torch.bfloat16: (2e-2, 1e-3),
        torch.float16: (2e-2, 1e-3)}
#: Verdicts, ordered by severity (the ranks agree on the largest).
SAME, UNCOMPARABLE, DIFFERENT = 0, 1, 2


def leaves(out) -> list:
    """The tensors of a model output, in order: nested tuples, lists, dicts (``ModelOutput``) and dataclasses walked."""
    if isinstance(out, torch.Tensor):
        return [out.full_tensor() if hasattr(out, "full_tensor") else out]
    if isinstance(out, Mapping):
        return [t for key in out for t in leaves(out[key])]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in leaves(item)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):  # @dataclass class Output: logits; loss
        return [t for f in dataclasses.fields(out) for t in leaves(getattr(out, f.name))]
    return []


def compare(whole: list, split: list) -> tuple[int, float, str]:
    """(verdict, relative difference, what differs) of two lists of output tensors.

    The relative difference is ``max|split - whole| / max|whole|`` over the floating-point
    outputs; other dtypes are left out (an argmax may differ on a tie).
    """
    if len(whole) != len(split):
        return UNCOMPARABLE, 0.0, f"{len(split)} output tensors where the whole model gives {len(whole)}"
    worst, verdict, which = 0.0, SAME, ""
    floats = 0
    for i, (a, b) in enumerate(zip(whole, split)):
        if a.shape != b.shape:
            return (UNCOMPARABLE, 0.0,
                    f"output {i} has shape {tuple(b.shape)} where the whole model's is {tuple(a.shape)}")
        if not a.is_floating_point():
            continue
        floats += 1
        rtol, atol = RTOL.get(a.dtype, RTOL[torch.bfloat16])
        if not a.numel():
            continue
        a, b = a.detach().double(), b.detach().double().to(a.device)
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # a NaN or inf the whole model gives too is no difference
        diff = float(torch.where(same, 0.0, (a - b).abs()).nan_to_num(float("inf")).max())
        scale = float(torch.where(torch.isfinite(a), a.abs(), 0.0).max())
        if not diff <= rtol * scale + atol:
            verdict, which = DIFFERENT, which or f"output {i}"
        worst = max(worst, diff / scale if scale > 0 else diff)
    if not floats:
        return UNCOMPARABLE, 0.0, "no floating-point output tensor"
    return verdict, worst, which


class _Outputs:
    """Forward hooks on named submodules recording each one's first output (its leaves)."""

    def __init__(self, module, names):
        self.seen, self.handles = {}, []
        for name in names:
            self.handles.append(module.get_submodule(name).register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def record(mod, args, out):
            self.seen.setdefault(name, leaves(out))
        return record

    def remove(self):
        for handle in self.handles:
            handle.remove()


class _Quiet:
    """Eval mode, no grad, autocast off, RNG states saved and restored; each module's ``training`` flag back."""

    def __init__(self, modules, device):
        self.modules, self.device = modules, device

    def __enter__(self):

        # a split model that cannot run logs each failed sharding propagation at ERROR (fake tensors), tens of lines
        self.log = logging.getLogger("torch._subclasses.fake_tensor")
        self.level = self.log.level
        self.log.setLevel(logging.CRITICAL)
        self.flags = [(m, m.training) for module in self.modules for m in module.modules()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.stack = [torch.no_grad(), torch.autocast(self.device.type, enabled=False)]
        for ctx in self.stack:
            ctx.__enter__()
        for module in self.modules:
            module.eval()

    def __exit__(self, *exc):
        self.log.setLevel(self.level)
        for ctx in reversed(self.stack):
            ctx.__exit__(*exc)
        for m, flag in self.flags:
            m.training = flag
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def agree(verdict: int, worst: float, rows: list[int], device) -> tuple[int, float, list[int]]:
    """Every rank's largest verdict, difference and per-row-layer flags (one all_reduce MAX)."""
    import torch.distributed as dist

    flags = torch.tensor([float(verdict), worst, *map(float, rows)], dtype=torch.float64, device=group_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = flags.cpu().tolist()
    return int(values[0]), values[1], [int(v) for v in values[2:]]


class VerifiedPlan:
    """Mixin for tensor-plan strategies (``module``, ``model``, ``plan``, ``device``, ``tp_plan``): see the module doc.

    Call :meth:`arm` in ``__init__`` before ``parallelize_module``, and :meth:`watch` after it.
    """

    _probe = None  # (the whole module's copy, the hook's handle), until the first forward
    _refused = None  # the refusal's text, once the check refused the plan: said again at every later forward
    _words = ("tensor plan", "", {})  # how the message names the plan, what it splits, {row: column partner}

    def arm(self, module, label: str, plan_text: str, pairs) -> None:
        """Keep a copy of the whole ``module`` to compare the split one with (call before it is split).

        ``label``: how errors name the plan (``--tp-plan NAME``, ``tensor plan``); ``plan_text``:
        what it splits (one line); ``pairs``: the default plan's (column-wise, row-wise) names.

        The copy is a skeleton on the meta device; the check fills it one module at a time
        (:mod:`~distnb.engine.strategies.layered`), so no rank ever holds the whole model for it.
        """
        self._size = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        self._probe = [skeleton(module), None]
        self._words = (label, plan_text, {row: col for col, row in pairs})

    def placed(self) -> None:
        """The module was split on the meta device: the copy takes the buffers outside the state dict now placed."""
        if self._probe is None:
            return
        whole = self._probe[0]
        for name, mod in whole.named_modules():
            for key in mod._non_persistent_buffers_set:
                if mod._buffers.get(key) is not None and mod._buffers[key].is_meta and _has(self.module, name):
                    live = self.module.get_submodule(name)._buffers.get(key)
                    if live is not None and not live.is_meta:
                        mod._buffers[key] = live.detach().clone()

    def watch(self) -> None:
        """Put the check on the first call of ``self.model`` (again after ``--compile`` replaced it)."""
        if self._probe is None:
            return
        if self._probe[1] is not None:
            self._probe[1].remove()
        self._probe[1] = self.model.register_forward_pre_hook(self._first_forward, prepend=True, with_kwargs=True)

    def compile(self) -> None:
        super().compile()
        self.watch()

    def _disarm(self):
        """Remove the hook; return the whole module's copy (None once checked). ``close`` calls it."""
        whole, handle = self._probe or (None, None)
        if handle is not None:
            handle.remove()
        self._probe = None
        return whole

    def _first_forward(self, model, args, kwargs):
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self._refused is not None:  # refused before, the group kept: the same verdict (the weights as they were)
            raise _refusal(self._refused)
        whole = self._disarm()
        if whole is None:
            return None
        rows = [name for name, style in self.tp_plan.items() if type(style).__name__ == "RowwiseParallel"
                and _has(self.module, name) and _has(whole, name)]
        try:  # the whole model's tensors gathered from the split one's (as they are now) one module at a time
            with layered.LayerByLayer(whole, self.module) as layers:
                now = self._compare_both(whole, rows, args, kwargs, layers)
        except layered.NotLayered as exc:  # alike on every rank: the forward reads a tensor outside its module
            size = getattr(self, "_size", 0)
            if size > VERIFY_MAX_BYTES:
                if dist.get_rank() == 0:
                    print(f"distnb: {self._words[0]} is not verified against the whole model: its forward cannot run "
                          f"one module at a time ({exc}), and the whole model ({size / 2**20:.0f} MiB) is more than "
                          f"{VERIFY_MAX_BYTES >> 20} MiB to hold on every rank; verify it on a smaller configuration "
                          "of the same model", flush=True)
                return None
            whole.load_state_dict(get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True)),
                                  assign=True)
            retie(whole, self.module)
            now = self._compare_both(whole, rows, args, kwargs, None)
        verdict, worst, which, row_flags = now
        del whole
        verdict, worst, row_flags = agree(verdict, worst, row_flags, self.device)
        bad_rows = [r for r, flag in zip(rows, row_flags) if flag]
        try:
            self._decide(verdict, worst, which, bad_rows)
        except StrategyError as exc:  # the hook stays on the model, to refuse its next forward too
            self._refused, self._probe = str(exc), [None, None]
            self.watch()
            raise
        return None

    def _compare_both(self, whole, rows, args, kwargs, layers) -> tuple:
        """:meth:`_compare_on` at the weights, then at weights moved at random (:mod:`.moved`); the worse of the two.

        ``layers``: the :class:`~.layered.LayerByLayer` the whole model runs in, None when it is held whole.
        """
        from torch.distributed.fsdp import FSDPModule

        lazy = layers is not None
        now = self._compare_on(whole, rows, args, kwargs, lazy)
        units = any(isinstance(m, FSDPModule) for m in self.module.modules())  # their gathered views: moved in place
        moving = (moved.MovedPerModule(self.module, self.device, layers) if lazy and not units
                  else moved.MovedInPlace(whole, self.module, self.device))
        with moving:  # every rank runs both: the split forward is collective
            moved_now = self._compare_on(whole, rows, args, kwargs, lazy)
        if moved_now[0] > now[0]:  # a term that vanishes at these weights (a gate initialised at 0) shows here
            now = (moved_now[0], moved_now[1], f"{moved_now[2]}, with the weights moved at random", moved_now[3])
        return now

    def _compare_on(self, whole, rows, args, kwargs, lazy: bool = False) -> tuple:
        """(verdict, difference, what differs, a flag per row-wise layer) of one forward of each model.

        ``lazy``: ``whole`` runs one module at a time (:mod:`.layered`); a forward that fails or gives a meta
        output then raises :class:`~.layered.NotLayered` (before the split model's forward, on every rank).
        """
        seen = (_Outputs(whole, rows), _Outputs(self.module, rows))
        try:
            with _Quiet((whole, self.module), self.device):
                try:
                    with layered.no_placeholders() if lazy else contextlib.nullcontext():
                        expected = leaves(whole(*args, **kwargs))
                except Exception as exc:
                    if not lazy or isinstance(exc, layered.NotLayered):
                        raise
                    raise layered.NotLayered(str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__) \
                        from exc
                try:
                    got = leaves(self.module(*args, **kwargs))
                except RuntimeError as exc:  # the split layers' shapes do not fit the forward (DTensor's propagation
                    # fails alike on every rank, before any collective): the plan, not the body, is wrong ...
                    outside = used_outside(exc, getattr(self, "units", None) or [], named_only=True)
                    if outside is not None:  # ... or fsdp+tensor's FSDP units (fsdp.py), alike on every rank too
                        raise outside from None
                    return DIFFERENT, float("inf"), f"the split model cannot run: {str(exc).splitlines()[0][:300].rstrip('.')}", \
                        [0] * len(rows)
        finally:
            for s in seen:
                s.remove()
        verdict, worst, which = compare(expected, got)
        flags = [int(compare(seen[0].seen.get(r, []), seen[1].seen.get(r, []))[0] == DIFFERENT) for r in rows]
        return verdict, worst, which, flags

    def _decide(self, verdict: int, worst: float, which: str, bad_rows: list[str]) -> None:
        import torch.distributed as dist

        label, plan_text, partner = self._words
        default = self.plan.tp_plan is None
        if verdict == SAME:
            return
        if verdict == UNCOMPARABLE and not default:
            if dist.get_rank() == 0:
                print(f"distnb: warning: --tp-plan {self.plan.tp_plan} was not verified against the whole model: "
                      f"the split model's output cannot be compared ({which or 'on some rank'}); if the plan "
                      "leaves the output sharded on purpose, that is expected", flush=True)
            return
        # the suspect layers: a default pair 'fc1' -> 'fc2' whose row-wise output differs; a --tp-plan's row layer
        suspects = [f"{partner[r]!r} (column-wise) -> {r!r} (row-wise)" if r in partner else repr(r) for r in bad_rows]
        raise _refusal(explain(label, plan_text, verdict, worst, which, suspects, default))


def _refusal(text: str) -> StrategyError:
    """The check's refusal: raised alike on every rank before any step (:attr:`StrategyError.before_step`)."""
    error = StrategyError(text)
    error.before_step = True
    return error


def skeleton(module):
    """A copy of ``module`` whose parameters and persistent buffers are on the meta device (no memory).

    Non-persistent buffers (not in the state dict) are copied. The check fills the rest with the
    split module's full state (``load_state_dict(assign=True)``); tied parameters get equal values.
    """
    kept = {id(m._buffers[n]) for m in module.modules() for n in m._non_persistent_buffers_set
            if m._buffers.get(n) is not None}
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            for p in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers() if id(b) not in kept})
    return copy.deepcopy(module, memo)


def retie(whole, split) -> None:
    """Tie ``whole``'s parameters as ``split``'s are tied (``out.weight = emb.weight``).

    ``load_state_dict(assign=True)`` gives each name a parameter of its own when the full state holds
    separate tensors (FSDP's gathered state does): the whole model then had two copies of a tied weight,
    and the moved-weights comparison moved one of them only, a difference the split model does not have.

    Parameters
    ----------
    whole : torch.nn.Module
        The unsplit copy (its parameters are replaced in place).
    split : torch.nn.Module
        The distributed module, whose ``named_parameters(remove_duplicate=False)`` shows the ties.
    """
    first = {}
    for name, p in split.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            first[id(p)] = name
            continue
        owner, _, attr = name.rpartition(".")
        setattr(whole.get_submodule(owner) if owner else whole, attr, whole.get_parameter(first[id(p)]))


def _has(module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def explain(label: str, plan_text: str, verdict: int, worst: float, which: str, pairs: list[str],
            default: bool) -> str:
    """The error's text: what differs, which layers, why, and the fix."""
    if verdict == DIFFERENT and which.startswith("the split model cannot run"):
        what = which
    elif verdict == DIFFERENT:
        what = (f"the split model's output differs from the whole model's by up to {worst:.3g} (relative to its "
                f"largest value; {which})")
    else:
        what = f"the split model's output does not match the whole model's ({which})"
    where = (f"the split pair{'s' if len(pairs) > 1 else ''} {', '.join(pairs)}" if pairs
             else f"the split layers ({plan_text})")
    how = ("pairs nn.Linear layers by the order they are defined in and assumes" if default else "assumes")
    fix = ("give an explicit plan with --tp-plan NAME (a notebook dict {submodule: ColwiseParallel() / "
           "RowwiseParallel()} that leaves such layers whole)" if default
           else f"fix {label} (leave those layers out of it, or split where only elementwise ops follow)")
    return (f"{label} changes what the model computes: on the first batch, in eval mode, {what}, at {where}. "
            f"The {'default ' if default else ''}tensor plan {how} that the forward between a column-wise "
            "layer and its row-wise partner is elementwise over the hidden units (ReLU, GELU, dropout, ...): "
            "each rank holds only a slice of them, so a mean, sum, softmax or normalization over the hidden "
            "dim, or a reshape/view mixing it, sees only that slice. Nothing was trained. Fix: "
            f"{fix}, or use another strategy (--strategy ddp or fsdp).")
