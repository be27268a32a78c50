"""``--compile`` on a rank: what ``torch.compile`` is applied to, and what dynamo then did with it.

Where to compile: torch's guide "Where to apply torch.compile?" (docs.pytorch.org, compile/programming_model)
says that ``torch.compile`` does not handle distributed wrapper modules like DDP well, and to compile the
module the wrapper is given (``model.compile()`` in place, then ``DistributedDataParallel(model)``).
Compiled from outside, DDP's forward graph-breaks at once (``DistributedDataParallel._inside_ddp_forward`` is
on dynamo's skip list): measured with torch 2.13 on CPU/gloo, dynamo then made 0 graphs on every rank and the
steps ran eagerly. :func:`compile_in_place` compiles a module's ``forward`` in place (its ``state_dict`` keys and
the wrapper around it stay as they are; its hooks, FSDP2's all-gathers among them, run around the compiled
forward); :func:`uncompile` undoes it when the strategy is rebuilt without it. Not ``module.compile()``:
that compiles ``nn.Module._call_impl``, which dynamo skips as a frame of torch's own for a torch container
such as ``nn.Sequential`` (measured: 0 graphs, nothing said), where ``torch.compile(module.forward)`` makes one.
Before compiling, dynamo's in-memory caches are reset (:func:`torch._dynamo.reset`): models of earlier cells
share code objects with this one (``nn.Sequential.forward``), and their cache entries would count as this
model's recompiles, and past ``torch._dynamo.config.cache_size_limit`` make dynamo give up on it.

What dynamo did: its counters (``torch._dynamo.utils.counters``: ``stats.unique_graphs``, ``graph_break``)
and compilation metrics (``torch._dynamo.utils.get_compilation_metrics()``: one entry per frame compiled,
``compile_id`` ``"frame/attempt"``, an attempt above 0 being a recompile) are per process and cumulative,
so a cell's figures are differences from a :func:`snapshot` taken when the cell starts (:func:`report`).
A compile time is only ever stated when graphs exist (:mod:`distnb.train.compiled`, kernel side, words it).
"""

from __future__ import annotations

import getpass
import os
import tempfile

from distnb.engine.process import compile_workers

#: How many distinct graph-break reasons a report keeps (the most frequent first).
REASONS = 2


def set_cache_dir() -> None:
    """The ranks of one host share inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``, default
    ``<tmp>/torchinductor_<user>``): the second rank, and later cells, reuse compiled kernels."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))


def fresh() -> None:
    """Reset dynamo's in-memory caches before a model is compiled (see the module docstring)."""
    import torch._dynamo

    torch._dynamo.reset()


class CompiledForward:
    """A module's ``forward`` compiled (``torch.compile``), set on the module as its ``forward``.

    It pickles as the eager forward it replaced: a module sent on from a rank (``%dist pull``, a rank added
    by ``%dist scale``) arrives eager, never with dynamo's state (which does not pickle).
    """

    def __init__(self, module):
        import torch

        self.replaced = module.__dict__.get("forward")  # None: the class's own forward
        self.eager = module.forward
        self.compiled = torch.compile(self.eager)

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    def __reduce__(self):
        return _same, (self.eager,)


def _same(value):
    return value


def compile_in_place(module) -> None:
    """``module.forward`` becomes its :class:`CompiledForward`: calls keep the module's identity, its
    ``state_dict`` keys, its hooks and any wrapper already holding it (DDP)."""
    set_cache_dir()
    compile_workers.limit()  # this rank's share of the host's cores, not min(32, cores) per rank
    uncompile(module)
    module.forward = CompiledForward(module)


def innermost(modules) -> list:
    """Those of ``modules`` that hold none of the others (in their order)."""
    held = [{id(m) for m in module.modules()} - {id(module)} for module in modules]
    return [m for m, inside in zip(modules, held) if not any(id(o) in inside for o in modules if o is not m)]


def uncompile(module) -> None:
    """Undo :func:`compile_in_place` (the module is called eagerly again)."""
    held = None if module is None else module.__dict__.get("forward")
    if isinstance(held, CompiledForward):
        if held.replaced is None:
            del module.forward
        else:
            module.forward = held.replaced


def snapshot() -> dict:
    """Dynamo's cumulative figures in this process now: graphs, graph breaks by reason, frames compiled."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    metrics = get_compilation_metrics()  # held: the ids below stay those of these entries
    return dict(graphs=counters["stats"]["unique_graphs"], breaks=dict(counters["graph_break"]),
                metrics=metrics, compiled={id(m) for m in metrics})


def report(cell: dict, since_compile: dict | None) -> dict:
    """What dynamo did since ``cell`` (the cell's :func:`snapshot`), and since ``since_compile`` (the one taken
    when the model was compiled; None: the same as ``cell``).

    Returns
    -------
    dict
        ``graphs`` (int, new this cell), ``graphs_since_compile`` (int: 0 means nothing was ever compiled for
        this model), ``graph_breaks`` (int, this cell), ``break_reasons`` (list of [first line of the reason,
        count], the most frequent first, at most :data:`REASONS`), ``recompiles`` (int, frames compiled again
        this cell after a guard failed) and ``recompile_reasons`` (list of str, at most :data:`REASONS`).
    """
    from torch._dynamo.utils import counters, get_compilation_metrics

    now = snapshot()
    breaks = {k: v - cell["breaks"].get(k, 0) for k, v in now["breaks"].items()}
    breaks = sorted(((k, v) for k, v in breaks.items() if v > 0), key=lambda kv: -kv[1])
    new = [m for m in get_compilation_metrics() if id(m) not in cell["compiled"]]
    again = [m for m in new if _attempt(m.compile_id) > 0]
    since = since_compile or cell
    return dict(graphs=now["graphs"] - cell["graphs"], graphs_since_compile=counters["stats"]["unique_graphs"]
                - since["graphs"], graph_breaks=sum(v for _, v in breaks),
                break_reasons=[[_first_line(k), v] for k, v in breaks[:REASONS]], recompiles=len(again),
                recompile_reasons=[_first_line(m.recompile_reason) for m in again if m.recompile_reason][:REASONS])


def _attempt(compile_id) -> int:
    """The attempt of a ``"frame/attempt"`` compile id (0: the frame's first compile)."""
    try:
        return int(str(compile_id).rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return 0


def _first_line(text: str) -> str:
    line = next((x.strip() for x in str(text).splitlines() if x.strip()), "")
    line = " ".join(line.split())  # dynamo aligns its source comments with runs of spaces
    return line if len(line) <= 160 else line[:157] + "..."
