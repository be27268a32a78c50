"""The files of an exported job's folder that hold what the cell trained on, and the checks that they still do.

``%dist export`` (:mod:`distnb.export.export`) writes the job from the notebook's objects as they are when it runs; each
of them must be what the cell read: the data (``data.pt`` tensors or ``data.pkl`` a Dataset by value), the
validation set (``val.pt``), the model (``model.pkl``) and the notebook names the body and options read
(``names.pkl``: a dict's values, the globals a function reads). One that changed since the cell is a PlanError
naming it (:func:`changed`), never a job that trains on something else while it says it gives the cell's losses.
"""

from __future__ import annotations

import io
import pickle

from distnb.core.errors import PlanError
from distnb.transfer.captured import of_value
from distnb.transfer.data import _fingerprint, held_fingerprint
from distnb.transfer.transfer import columns_of, fingerprint, pack_named


def name_digest(value):
    """What a notebook name the body reads is, to tell a change: plain values and containers of them by value, a
    function by the globals its code reads (:func:`distnb.transfer.captured.of_value`), anything else by its fingerprint
    (tensors' versions, a container's items)."""

    digest = of_value(value)
    return fingerprint(value) if isinstance(digest, tuple) and digest[:1] == ("object",) else digest


def names_unchanged(cell) -> None:
    """PlanError naming the first notebook name the body or options read that changed since the cell (a dict's
    value, the globals a function reads): names.pkl would carry the new value, and the job train otherwise."""
    for name, value in cell.names.items():
        if name in cell.names_fp and name_digest(value) != cell.names_fp[name]:
            what = "the notebook function" if callable(value) else "the notebook name"
            raise changed(name, what)


def changed(name, what, since="the training cell ran") -> PlanError:
    return PlanError(f"{what} {name} changed in the notebook since {since}, so the job would not train "
                     "on what the cell trained on: run the cell again (or export right after it), then %dist export")


def tensor_file(name, obj, fp, what) -> bytes:
    """``data.pt``/``val.pt``: a tensor data set as its columns (the job cuts the shards as the kernel did)."""
    import torch


    if fp is not None and held_fingerprint(obj) != fp:
        raise changed(name, what)
    structure, columns, _ = columns_of(obj, name)
    buf = io.BytesIO()
    torch.save({"structure": list(structure), "columns": [c.contiguous() for c in columns]}, buf)
    return buf.getvalue()


def data_file(cell) -> tuple:
    """(file name, bytes) of ``--data``; PlanError when the kernel never held it or it changed."""

    name, path = cell.plan.data, cell.data_path
    if path == "ranks":
        raise PlanError(f"--data {name} was made on the ranks by a %%dist cell (--data-on-ranks): the kernel never "
                        "held it, so it cannot be written to the job's folder. Define it in the notebook (a Dataset, "
                        "or a function make(rank, world_size) -> Dataset that builds it on each rank), train the cell "
                        f"with --data {name} without --data-on-ranks, then %dist export")
    if path == "tensors":
        return "data.pt", tensor_file(name, cell.data_obj, cell.data_fp, "--data")
    tensors = []
    packed = pack_named(name, cell.data_obj, " (the exported job loads it from data.pkl)", tensors)
    if cell.data_fp is not None and (path, _fingerprint(*packed, tensors), id(cell.data_obj)) != cell.data_fp:
        raise changed(name, "--data")
    return "data.pkl", pickle.dumps(packed, protocol=5)


def model_packed(cell) -> tuple:
    """The model the job starts from: as sent at the cell's start, or the notebook's after a cell that went on.

    PlanError when it holds tensors on the meta device: the kernel has no weights of them to write, and a job
    would start from none (a crash on the CPU, a fresh initialisation on a GPU), never from the ranks' weights.
    """

    if cell.model_packed is not None:
        packed = cell.model_packed
    else:
        if fingerprint(cell.model_obj) != cell.model_fp:
            raise changed(cell.plan.model, "--model", cell.model_since)
        packed = pack_named(cell.plan.model, cell.model_obj, " (the exported job loads it from model.pkl)")
    _holds_weights(cell, packed[1])
    return packed


def _holds_weights(cell, descs) -> None:
    """PlanError naming where the weights are and the fix when the packed model's ``descs`` include meta tensors."""
    from distnb.engine.transport import wire  # loads numpy, torch: at first use, not when this module is imported

    num_meta = sum(1 for d in descs if wire.is_meta_desc(d))
    if not num_meta:
        return
    name = cell.plan.model
    raise PlanError(f"--model {name} is on the meta device in the notebook ({num_meta} of its {len(descs)} tensors "
                    "have no data): the kernel holds none of their weights (they exist on the ranks only), so the job "
                    f"could not start from them. To export, build {name} with its weights in the notebook (not under "
                    f"torch.device(\"meta\"); %dist load PATH --model {name} fills a model the kernel holds too), "
                    "run the cell, then %dist export. The ranks' weights themselves are written by %dist save DIR "
                    "(a checkpoint that %dist load reads) or %dist save DIR --format safetensors")
