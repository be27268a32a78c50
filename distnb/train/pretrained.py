"""Kernel side of ``--load PATH`` (``%%distrain --load``, ``%dist load``): check in the kernel, read on the ranks.

:func:`check` finds what PATH holds and holds it against the notebook's model before anything is sent
(:mod:`distnb.core.weightfiles`: the index and headers only); :func:`load_on_ranks` then has every rank read
the slices it holds (:func:`distnb.engine.train.pretrained.load_weights`).
"""

from __future__ import annotations

import os
import time

from distnb.core import calls
from distnb.core.errors import PlanError
from distnb.core.options import check_path
from distnb.core.plan import STRATEGIES
from distnb.core.tables import count
from distnb.core.weightfiles import absolute, find, match, provided
from distnb.execute.execute import run_on_ranks


def is_checkpoint(path) -> bool:
    """Whether ``path`` is a distnb checkpoint (a ``step_*`` folder with its marker, or a parent of one)."""
    from distnb.engine.train import checkpoint  # imports torch.distributed: only where a path is asked about

    path = os.path.abspath(os.path.expanduser(check_path("--load", path)))
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, checkpoint.MARKER))
                                    or checkpoint.latest(path) is not None)


def _dcp(path: str) -> dict:
    """What a distnb checkpoint (``step_*`` folder or its parent) holds, as :func:`distnb.core.weightfiles.find` says it:
    the model's entries of DCP's metadata (``.metadata``), never tensor data."""
    from torch.distributed.checkpoint import FileSystemReader  # torch: the kernel has it with the model

    from distnb.engine.train import checkpoint  # imports torch.distributed: only for a checkpoint

    path = checkpoint.read_meta(path)["path"]
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # a damaged .metadata file
        raise PlanError(f"--load {path}: its torch.distributed.checkpoint metadata cannot be read: {exc}") from None
    tensors = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            tensors[key[len("model."):]] = (path, str(md.properties.dtype).replace("torch.", ""), tuple(md.size), None)
    return dict(kind="dcp", path=path, tensors=tensors, sizes={})


def find_any(path) -> dict:
    """What ``path`` holds (:func:`distnb.core.weightfiles.find`), a distnb checkpoint included (``kind`` ``"dcp"``)."""
    path = absolute(path)
    return _dcp(path) if os.path.exists(path) and is_checkpoint(path) else find(path)


def provided_names(plan, model_obj) -> set:
    """The names of ``model_obj``'s tensors ``plan.load`` fills (none without ``--load``): no init needed."""
    return provided(find_any(plan.load)["tensors"], model_obj) if plan.load else set()


def check(plan, model_obj) -> dict | None:
    """Before the model is sent: what ``plan.load`` holds, matched to ``model_obj`` (None without ``--load``).

    Returns ``{"found", "aliases", "note"}`` (:func:`find`, :func:`match`).

    Raises
    ------
    PlanError
        As :func:`find` and :func:`match`; ``--strategy ps``, whose servers hold the parameters in their
        own layout; ``--checkpoint-dir`` holding a checkpoint to resume from (it would replace the loaded
        weights).
    """
    if plan.load is None:
        return None
    if plan.strategy == "ps":
        raise PlanError("--load does not go with --strategy ps (its servers keep the parameters in their own "
                        "layout): load under ddp (%dist load PATH --model NAME --strategy ddp), then train with "
                        "--strategy ps")
    if plan.checkpoint_dir is not None and is_checkpoint(plan.checkpoint_dir) and not plan.reset:
        raise PlanError(f"--load {plan.load} and --checkpoint-dir {plan.checkpoint_dir}, which holds a checkpoint "
                        "to resume from: give one of them (or --reset to start from the loaded weights)")
    found = find_any(plan.load)
    return dict(found=found, **match(found, model_obj, plan.model))


def load_on_ranks(session, plan, checked: dict, quiet: bool = False) -> list:
    """Every rank reads its slices of ``checked`` (:func:`check`) into model ``plan.model``, sent just before.

    Returns the ranks' rows ``{"rank", "bytes"}``. On a failure the ranks' model counts as not held, so
    the next cell sends the notebook's model afresh.
    """
    found = checked["found"]
    if checked["note"] and not quiet:
        print(checked["note"])
    t0 = time.perf_counter()
    try:
        rows = run_on_ranks(session, calls.load_weights, plan.model, plan.to_dict(), found, checked["aliases"],
                            what=f"loading {found['path']}")
    except BaseException:  # half loaded: the next cell sends the notebook's model afresh
        for held in (session.holdings.models, session.holdings.distributed):
            held.pop(plan.model, None)
        raise
    if not quiet:
        largest = max(rows, key=lambda r: r["bytes"])
        print(f"distnb: loaded {found['path']} into {plan.model} on {count(session.world_size, 'rank')} "
              f"(--strategy {plan.strategy}; each rank read the slices it holds, at most "
              f"{largest['bytes'] / (1 << 20):.1f} MiB) in {time.perf_counter() - t0:.2f} s")
    return rows



def load_arguments(argument):
    """A decorator giving the ``%dist load`` magic its arguments, with their help (``argument``: IPython's
    ``magic_arguments.argument``, passed in so that this module does not import IPython)."""
    def apply(fn):
        for args, kw in reversed([
            (("directory",), dict(help="a step_* checkpoint folder or its parent (the newest complete one); or "
                                       "weights: a safetensors file or Hugging Face folder, each rank reading its "
                                       "slices (needs --model)")),
            (("--model",), dict(default=None, help="notebook name of the model (default: the last one trained or "
                                "loaded; none since the cluster started: the checkpoint's own, if the notebook "
                                "defines it)")),
            (("--strategy",), dict(default=None, metavar="{" + ",".join(s for s in STRATEGIES if s != "ps") + "}",
                                   help="weights files: how the ranks hold the model (default: its last cell's, "
                                   "ddp at first; fsdp for one larger than a rank). A checkpoint keeps the strategy "
                                   "it was saved with. Example: %%dist load ./llama-tiny --model net --strategy fsdp")),
        ]):
            fn = argument(*args, **kw)(fn)
        return fn
    return apply
