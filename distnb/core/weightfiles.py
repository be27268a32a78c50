"""What ``--load PATH`` holds, read in the kernel from the index and headers only (stdlib only).

``%%distrain --load PATH`` (and ``%dist load PATH``) takes

- a safetensors file;
- a Hugging Face model folder: ``model.safetensors``, or sharded ``model-0000x-of-0000y.safetensors``
  with ``model.safetensors.index.json``;
- a distnb checkpoint (what ``%dist save`` writes: torch.distributed.checkpoint, DCP).

The kernel reads nothing but the index and the files' headers (:func:`find`): the names, dtypes and
shapes of the tensors, never their data. :func:`match` holds them against the notebook model's
``state_dict`` (meta or not) before anything reaches the ranks: missing and unexpected names are an
error naming them with their nearest names (``difflib``), as are shapes that differ; a tied parameter
stored once (GPT-2's ``lm_head.weight``, the same tensor as ``transformer.wte.weight``) is read under
the stored name; a dtype conversion is said once. The ranks then read their slices
(:mod:`distnb.engine.train.pretrained`), as :mod:`distnb.train.pretrained` asks them.
"""

from __future__ import annotations

import difflib
import json
import os
import struct

from distnb.core import peftnames
from distnb.core.errors import PlanError
from distnb.core.options import check_path

HELP = ("pretrained weights the ranks read before training, each only the slices it holds, from its own host: a "
        "safetensors file, a Hugging Face folder (model.safetensors, or shards with model.safetensors.index.json) "
        "or a %dist save checkpoint; names must match the model's state_dict, e.g. --load ./llama-tiny")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: safetensors' dtype names -> torch's.
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2"}
#: How many names an error lists of each kind before "and N more".
SHOWN = 6


def header(file: str) -> tuple[dict, int]:
    """The tensors in safetensors ``file``, from its header only: ``({name: (dtype, shape, end, begin)}, bytes)``.

    ``end`` is the byte where the tensor's data ends, relative to the data section; ``begin`` where it
    starts in the file; the file must hold at least ``bytes`` bytes (header plus the furthest ``end``).

    Raises
    ------
    PlanError
        The file is not safetensors, or shorter than its header says (truncated): names it and its sizes.
    """
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size < (100 << 20):
                raise PlanError(f"{file} is not a safetensors file (its first 8 bytes are no header length)")
            meta = json.loads(f.read(size))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise PlanError(f"{file} cannot be read as safetensors: {exc}") from None
    tensors, end = {}, 0
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise PlanError(f"{file}: {name} has dtype {info['dtype']}, which torch cannot hold")
        tensors[name] = (dtype, tuple(info["shape"]), int(info["data_offsets"][1]), 8 + size + info["data_offsets"][0])
        end = max(end, tensors[name][2])
    need = 8 + size + end
    have = os.path.getsize(file)
    if have < need:
        raise PlanError(f"{file} is truncated: its header describes {need} bytes and the file has {have}; "
                        "copy or download it again")
    return tensors, need


def _sharded(folder: str) -> dict:
    """{name: file} from a Hugging Face index, each file checked to exist."""
    try:
        with open(os.path.join(folder, INDEX)) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        raise PlanError(f"{os.path.join(folder, INDEX)} is not a Hugging Face index (a weight_map): {exc}") from None
    absent = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(folder, f))})
    if absent:
        raise PlanError(f"{os.path.join(folder, INDEX)} names {', '.join(absent)}, which {folder} does not hold")
    return {name: os.path.join(folder, f) for name, f in weight_map.items()}


def _safetensors(path: str) -> dict:
    """``{"kind": "safetensors", "tensors": {name: (file, dtype, shape)}, "sizes": {file: bytes}}`` of ``path``."""
    if os.path.isfile(path):
        where = None
    elif os.path.isfile(os.path.join(path, INDEX)):
        where = _sharded(path)
    elif os.path.isfile(os.path.join(path, SINGLE)):
        path = os.path.join(path, SINGLE)
        where = None
    else:
        raise PlanError(f"--load {path}: the folder holds neither {INDEX}, {SINGLE} nor a distnb checkpoint "
                        "(step_* folders); give a safetensors file, a Hugging Face model folder or a %dist save folder")
    files = sorted(set(where.values())) if where is not None else [path]
    tensors, sizes, unindexed = {}, {}, {}
    for file in files:
        found, sizes[file] = header(file)
        for name, (dtype, shape, _, begin) in found.items():
            if where is None or where.get(name) == file:
                tensors[name] = (file, dtype, shape, begin)
            elif name not in where:
                unindexed[name] = os.path.basename(file)
    if where is not None:
        lost = sorted(n for n, file in where.items() if n not in tensors)
        if lost:
            raise PlanError(f"{os.path.join(path, INDEX)} puts {_listed(lost)} in files whose headers do not hold "
                            "them; the index and the shards disagree: copy or download the folder again")
    return dict(kind="safetensors", tensors=tensors, sizes=sizes, unindexed=unindexed)


def find(path) -> dict:
    """What safetensors ``path`` holds, from its index and headers: ``{"kind", "path", "tensors", "sizes"}``.

    (A distnb checkpoint: :func:`distnb.train.pretrained.find_any`.)

    ``tensors`` maps each stored name to ``(file, dtype, shape, begin)`` (dtype as torch names it; begin:
    the byte its data starts at in a safetensors file, None in a checkpoint); ``sizes``
    gives each safetensors file's expected length in bytes, which the ranks check on their hosts.

    Raises
    ------
    PlanError
        ``path`` does not exist, is neither a safetensors file nor a Hugging Face folder, or is damaged
        (truncated, an index naming absent files or tensors).
    """
    path = os.path.abspath(os.path.expanduser(check_path("--load", path)))
    if not os.path.exists(path):
        raise PlanError(f"--load {path}: no such file or folder on the kernel's host")
    return dict(_safetensors(path), path=path)


def _listed(names, limit=SHOWN) -> str:
    names = list(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _nearest(name: str, among) -> str:
    close = difflib.get_close_matches(name, among, n=2, cutoff=0.5)
    return f" (nearest: {', '.join(close)})" if close else ""


def _why_missing(key: str, found: dict) -> str:
    """After a missing name: the shard holding it that the index leaves out, else the nearest stored names."""
    file = found.get("unindexed", {}).get(key)
    if file is not None:
        return f" ({file} holds it, but {INDEX} has no entry for it: the index is incomplete)"
    return _nearest(key, list(found["tensors"]))


def _architecture(path: str) -> str:
    """`` (its config.json says GPT2LMHeadModel)`` for a Hugging Face folder whose config names one, else ""."""
    try:
        with open(os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "config.json")) as f:
            names = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return ""
    return f" (its config.json says {', '.join(map(str, names))})" if names else ""


def match(found: dict, model_obj, name: str) -> dict:
    """Hold the stored tensors against ``model_obj``'s ``state_dict``: ``{"aliases": ..., "note": ...}``.

    ``aliases`` maps a model name stored under another name of the same tied tensor to that name;
    ``note`` is the sentence about dtype conversions ("" when none). A ``peft`` model's keys are read
    as its base model's names, and its adapters need not be in the files (:mod:`distnb.core.peftnames`).

    Raises
    ------
    PlanError
        Names missing from the files, names the model does not have, and shapes that differ (each
        with the nearest names on the other side), so that a folder of another architecture or a
        missing index entry fails before training.
    """
    stored = found["tensors"]
    rename, adapters = peftnames.renaming(model_obj), peftnames.adapter_keys(model_obj)
    groups: dict = {}
    for key, t in model_obj.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), (t, []))[1].append(key)
    aliases, missing, shapes, converted = {}, [], [], {}
    for t, keys in groups.values():
        present = [rename(k) for k in keys if rename(k) in stored]
        if not present:
            if not all(k in adapters for k in keys):  # a peft adapter is not in the base model's files
                missing.append(keys[0])
            continue
        for k in keys:
            if k not in stored:
                aliases[k] = rename(k) if rename(k) in stored else present[0]
        key = present[0]
        want, have = tuple(t.shape), tuple(stored[key][2])
        if want != have:
            shapes.append(f"{key}: stored {list(have)}, model {list(want)}")
        dtypes = (stored[key][1], str(t.dtype).replace("torch.", ""))
        if dtypes[0] != dtypes[1]:
            converted[dtypes] = converted.get(dtypes, 0) + 1
    model_keys = {rename(k) for _, keys in groups.values() for k in keys}
    unexpected = sorted(k for k in stored if k not in model_keys)
    problems = []
    if missing:
        problems.append(f"{len(missing)} of {name}'s tensors are not in it: " + "; ".join(
            k + _why_missing(k, found) for k in missing[:SHOWN]) + (" ..." if len(missing) > SHOWN else ""))
    if unexpected:
        problems.append(f"{len(unexpected)} stored tensors are not in {name}: " + "; ".join(
            k + _nearest(k, list(model_keys)) for k in unexpected[:SHOWN]) + (" ..." if len(unexpected) > SHOWN else ""))
    if shapes:
        problems.append(f"{len(shapes)} shapes differ: {_listed(shapes)}")
    if problems:
        if not any(k in stored for k in model_keys):
            problems.insert(0, f"none of its names are {name}'s: a folder of another architecture"
                            + _architecture(found["path"]))
        raise PlanError(f"--load {found['path']} does not fit {name} ({type(model_obj).__name__}): "
                        + ". ".join(problems) + ". Load weights saved from this architecture and configuration "
                        "(the names are the model's state_dict keys)")
    note = "; ".join(f"{n} tensors stored as {a} become {b}" for (a, b), n in sorted(converted.items()))
    return dict(aliases=aliases, note=f"distnb: --load {found['path']}: {note} ({name}'s dtype)" if note else "")


def provided(stored, model_obj) -> set:
    """The names in ``model_obj``'s ``state_dict`` whose values are ``stored`` (names; under them or a tied name).

    A meta model needs no initialisation for these: :func:`distnb.train.bigmodels.check_init` leaves their
    modules alone and the ranks give them memory without values, which the load then fills
    (:func:`distnb.engine.train.install.place_model`).
    """
    rename = peftnames.renaming(model_obj)  # a peft model's base weights: the base model's names
    groups: dict = {}
    for key, t in model_obj.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(key)
    return {k for keys in groups.values() if any(rename(k) in stored for k in keys) for k in keys}


def absolute(path):
    """``path`` made absolute in the kernel (the ranks' working folder may differ), or None for None."""
    return None if path is None else os.path.abspath(os.path.expanduser(check_path("--load", path)))
