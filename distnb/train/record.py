"""The last training cell as the kernel recorded it, for ``%dist export``: its plan, code, names and what the ranks received."""

from __future__ import annotations

import ast
import linecache
import math
import textwrap
import time
import weakref
from dataclasses import dataclass, field

from distnb.core.errors import PlanError
from distnb.core.plan import LR_SCHEDULES
from distnb.train import jobfiles
from distnb.transfer import valsets
from distnb.transfer.data import path_of
from distnb.transfer.transfer import fingerprint, free_names

#: The last training cell of this kernel that returned a result (None before the first).
_LAST = [None]


@dataclass
class Cell:
    """What :func:`write` needs of one training cell (see the module docstring)."""

    plan: object
    code: str
    model_class: type
    model_packed: tuple | None  # (payload, descs, buffers) as sent, with copied weights; None: not sent this cell
    model_repr: str
    classes: list
    data_obj: object
    data_path: str
    data_fp: object
    val_obj: object
    val_fp: object
    names: dict
    ns: dict
    cluster: dict
    when: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    start: dict = field(default_factory=dict)
    problem: str = ""  # why it cannot be exported, if it cannot
    model_ref: object = None  # weakref to the notebook's model (a cell that went on with the ranks' live one exports it)
    model_fp: object = None  # its fingerprint when that cell ended (or %dist load put a checkpoint into it)
    model_since: str = "the training cell ran"  # what model_fp was taken after, for the "changed" error
    batch_rewrite: dict | None = None  # %dist scale --keep-global-batch's rewrite of the cell's batch options
    epoch_losses: list = field(default_factory=list)
    not_kept: str = ""  # why a model sent fresh had its starting weights left uncopied (too large)
    names_fp: dict = field(default_factory=dict)  # each name's fingerprint at the cell (its globals, for a function)

    @property
    def model_obj(self):
        """The notebook's model, or None once the notebook deleted it (the record must not keep a model alive)."""
        return self.model_ref() if self.model_ref is not None else None


def _names_read(session, plan, code, exclude, reserved) -> dict:
    """The notebook names a cell's body and options read (what the kernel pushes), by reference."""

    wanted = set(free_names(code)) - set(reserved)
    schedule = None if plan.lr_schedule in LR_SCHEDULES else plan.lr_schedule
    optimizer = None if plan.builtin_optimizer else plan.optimizer
    wanted |= {n for n in (optimizer, plan.loss, plan.tp_plan, plan.metric, schedule, plan.collate) if n}
    ns = session.ns
    return {n: ns[n] for n in sorted(wanted) if n in ns and not any(ns[n] is e for e in exclude)}


#: Bytes of a model's starting weights the kernel copies for the export of a cell that sent it fresh
#: (a larger model is exported from its weights after the cell, and export says so): a full copy of
#: a large model in the kernel would double its memory for a by-product.
KEEP_START_BYTES = 32 * 2**20  # within the kernel's bound: the model + 10 % + 64 MiB (issue 34)


def capture(session, plan, code, model_obj, data_obj, reserved=(), fresh=True) -> Cell:
    """A training cell at its start, once the ranks hold what it needs (called by ``train_cell``).

    ``reserved``: the names a body gets from distnb (``model``, ``batch``, ...), never the notebook's.
    ``fresh``: the model was sent to the ranks for this cell; then its weights are copied here
    (the cell's end overwrites the notebook's), since the job starts from them. A cell that goes on
    with the ranks' live model copies nothing: its job goes on from the notebook's weights after it.
    Never raises: a cell that cannot be captured trains as usual, and exporting it says why not.
    """
    try:
        cell = _capture(session, plan, code, model_obj, data_obj, reserved, fresh)
        cell.batch_rewrite = getattr(session.holdings, "batch_world", {}).get(None)  # what the ranks got, and why
        return cell
    except Exception as exc:  # noqa: BLE001 - export is a by-product of the cell: it must not stop it
        return Cell(plan=plan, code=code, model_class=type(model_obj), model_packed=None, model_repr="",
                    classes=[], data_obj=None, data_path="", data_fp=None, val_obj=None, val_fp=None, names={},
                    ns={}, cluster={}, problem=f"it could not be recorded ({type(exc).__name__}: {exc})")


def _capture(session, plan, code, model_obj, data_obj, reserved, fresh) -> Cell:
    from distnb.engine.transport import wire  # loads numpy, torch: at first use, not when this module is imported

    packed, problem, not_kept = None, "", ""
    if fresh:
        try:
            payload, descs, buffers = wire.pack(model_obj)  # as the ranks received it; the weights copied
            size = sum(b.nbytes for b in buffers)
            if size <= KEEP_START_BYTES:
                packed = (payload, descs, [b.copy() for b in buffers])
            else:
                not_kept = (f"--model {plan.model} ({size / 2**20:.0f} MiB) is larger than the "
                            f"{KEEP_START_BYTES / 2**20:.0f} MiB of starting weights the kernel keeps a copy of")
        except Exception as exc:  # noqa: BLE001 - the ranks got it (it was packed to be sent): only a by-product
            problem = f"--model {plan.model} could not be packed ({type(exc).__name__}: {exc})"
    held = session.holdings.data
    val_obj = session.ns.get(plan.val_data) if plan.val_data else None
    path = "ranks" if plan.data_on_ranks else path_of(plan, data_obj)[0]
    cluster = session.cluster
    threads = sorted({r.get("num_threads", cluster.spec.num_threads) for r in cluster.ranks})
    names = _names_read(session, plan, code, (model_obj, data_obj, val_obj), reserved)
    val_fp = held.get(plan.val_data, {}).get("fingerprint") if plan.val_data else None
    return Cell(plan=plan, code=code, model_class=type(model_obj), model_repr=repr(model_obj),
                classes=notebook_classes(model_obj), model_packed=packed, model_ref=weakref.ref(model_obj), data_obj=data_obj,
                data_path=path, data_fp=held.get(plan.data, {}).get("fingerprint"), val_obj=val_obj, val_fp=val_fp,
                names=names, names_fp={n: jobfiles.name_digest(v) for n, v in names.items()}, ns=session.ns,
                cluster=dict(world_size=session.world_size, num_nodes=cluster.num_nodes,
                             device=cluster.spec.device_type, backend=cluster.spec.backend, threads=threads[-1],
                             timeout=cluster.spec.timeout), problem=problem, not_kept=not_kept)


def remember(cell: Cell, result, model_obj) -> None:
    """``cell`` ended with ``result`` (a TrainResult; ``model_obj`` holds its weights): the one ``%dist export`` writes."""


    first = result.rows[0]
    start_steps = first["global_steps"] - first["steps"]
    continued = first.get("continued") or {}
    skip = continued.get("samples", 0)
    cell.start = dict(epoch=first["first_epoch"], epoch_samples=skip, steps=start_steps,
                      epoch_step=math.ceil(skip / cell.plan.batch_size), exact=True, why="")
    if cell.model_packed is None and not cell.problem:  # it went on with the ranks' live model and optimizer
        epoch = (first.get("where") or {}).get("epoch", first["next_epoch"])
        cell.model_fp = fingerprint(model_obj)
        cell.start = dict(epoch=epoch, epoch_samples=0, steps=first["global_steps"], epoch_step=0, exact=False,
                          why=(f"{cell.not_kept}: " if cell.not_kept else
                               f"the cell went on with the ranks' live model and its optimizer ({start_steps} steps "
                               "in), whose state (and lr schedule) the kernel does not hold: ") +
                          f"the job goes on from the notebook's weights after the cell, from epoch {epoch}, with a "
                          "fresh optimizer, and does not repeat the cell's losses" +
                          ("" if cell.not_kept else ". For a job that repeats a cell, run the cell with --reset "
                           "(its model sent fresh), then export"))
    elif first.get("resumed"):
        cell.start.update(exact=False, why=f"the cell resumed from the checkpoint {first['resumed']}, which the job "
                          "does not read: it starts from the notebook's weights at the cell's start, with a fresh "
                          "optimizer, so its losses can differ from the cell's")
    cell.epoch_losses = list(result.epoch_losses)
    _LAST[0] = cell


def loaded(name: str, model_obj, meta: dict) -> None:
    """``%dist load`` put checkpoint ``meta`` into ``name`` (the notebook's model and the ranks' alike).

    A last cell of ``name`` that went on with the ranks' live model is exported from the notebook's
    weights: from now on those are the checkpoint's, so the job goes on from them (from the
    checkpoint's epoch), and only a change after the load counts as the model changed in the notebook.
    A cell that sent its model fresh exports the weights it started from, which a load does not touch.
    """

    cell = _LAST[0]
    if cell is None or cell.plan.model != name or cell.model_packed is not None or cell.problem:
        return
    cell.model_fp, cell.model_since = fingerprint(model_obj), f"%dist load {meta['path']}"
    cell.start = dict(epoch=meta["epoch"], epoch_samples=0, steps=meta["steps"], epoch_step=0, exact=False,
                      why=f"%dist load put the checkpoint {meta['path']} into {name} after the cell: the job goes "
                          f"on from those weights (the notebook's now), from epoch {meta['epoch']}, with a fresh "
                          "optimizer, and does not repeat the cell's losses")


def last() -> Cell:
    """The cell :func:`write` exports; PlanError naming the fix when no training cell has ended yet."""
    if _LAST[0] is None:
        raise PlanError("no training cell has run in this kernel yet: run a %%distrain cell (it must end with a "
                        "result), then %dist export DIR (a job repeats a training cell; weights a model holds, say "
                        "after %dist load, are written by %dist save DIR --format safetensors)")
    if _LAST[0].problem:
        raise PlanError(f"the last training cell cannot be exported: {_LAST[0].problem}; make it picklable (delete "
                        "or move what is not), run the cell again, then %dist export")
    return _LAST[0]


def class_source(cls) -> str | None:
    """The source of a class defined in the notebook, from the cells IPython keeps in linecache (None if not found).

    ``inspect.getsource`` cannot find classes of ``__main__``; their methods' code objects name the
    cell they were defined in.
    """

    for value in vars(cls).values():
        code = getattr(getattr(value, "__func__", value), "__code__", None)
        lines = linecache.getlines(code.co_filename) if code is not None else []
        try:
            tree = ast.parse("".join(lines)) if lines else None
        except SyntaxError:
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__ and \
                    node.lineno <= code.co_firstlineno <= node.end_lineno:
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                return textwrap.dedent("".join(lines[first - 1:node.end_lineno]))
    return None


def notebook_classes(model) -> list:
    """Classes defined in the notebook that ``model`` is made of: bases and submodules before their users."""
    found = []
    for m in reversed(list(model.modules())):  # innermost submodules first
        for cls in reversed(type(m).__mro__):  # bases before the class
            if cls.__module__ == "__main__" and cls not in found:
                found.append(cls)
    return found
