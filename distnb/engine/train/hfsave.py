"""Rank side of ``%dist save DIR --format safetensors`` and ``%dist save --adapters DIR``.

A whole model goes out as a Hugging Face folder: ``model-0000x-of-0000y.safetensors`` with
``model.safetensors.index.json``, plus ``config.json`` (and ``generation_config.json``) when the model
is a ``transformers`` one. Every rank writes its own part with ``torch.distributed.checkpoint`` and
its ``HuggingFaceStorageWriter`` (a shard for fsdp and tensor, a stage for pipeline, one copy of each
replicated tensor for ddp, into ``DIR/sharded``; one tensor at a time, :mod:`distnb.engine.train.hfwriter`);
the writer then consolidates the parts into full tensors on rank 0, one tensor at a time from the
files, so no rank and not the kernel ever holds the whole model. Tied weights are written once, under the name ``transformers`` keeps (GPT-2: ``lm_head.weight``
left out), so ``from_pretrained`` ties them again.

Adapters of a ``peft`` model go out as ``peft`` writes them (``adapter_model.safetensors`` with the
keys of ``peft.get_peft_model_state_dict``, and ``adapter_config.json``): they are small, so each
sharded one is gathered whole (``DTensor.full_tensor``) and rank 0 writes the file.

Both are collectives: every rank calls them. A rank that cannot write the folder is named on every
rank before anything is written, so no rank waits in a collective the others left.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distnb.engine.process import runtime
from distnb.engine.train.hfwriter import DTYPE_NAMES, StreamingHuggingFaceWriter
from distnb.engine.train.savefolder import check_writable

#: The index file ``from_pretrained`` reads first (the name transformers and DCP use).
INDEX = "model.safetensors.index.json"
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def tied_targets(module) -> set:
    """Names ``transformers`` leaves out of a saved file because they are tied to another (``lm_head.weight``).

    ``all_tied_weights_keys`` (transformers 5: ``{target: source}``) of the model and its sub-models;
    empty for a model that is not a ``transformers`` one.
    """
    found = set()
    for prefix, sub in module.named_modules():
        tied = getattr(sub, "all_tied_weights_keys", None)
        if isinstance(tied, dict):
            found.update(f"{prefix}.{k}" if prefix else k for k in tied)
    return found


def untied(state: dict, module) -> dict:
    """``state`` with each tensor once: of names viewing the same memory, the one transformers keeps.

    A name ``transformers`` declares tied to another goes (:func:`tied_targets`); with none declared,
    the first name in ``state``'s order stays (as ``safetensors.torch.save_model`` does).
    """
    targets = tied_targets(module)
    by_tensor: dict = {}
    for key, t in state.items():
        by_tensor.setdefault(_storage(t), []).append(key)
    drop = set()
    for names in by_tensor.values():
        if len(names) > 1:
            keep = next((n for n in names if n not in targets), names[0])
            drop.update(n for n in names if n != keep)
    return {k: t for k, t in state.items() if k not in drop}


def _storage(t):
    """What tells two state-dict entries of one tensor apart from equal ones: the memory they view (the
    entries are detached copies of the parameters, so never the same object)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.is_meta or local.numel() == 0:  # no memory to compare: only the same object is the same
        return ("object", id(t))
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride())


def _nbytes(t) -> int:
    return t.numel() * t.element_size()  # a DTensor's numel is its global one


def file_index(state: dict, max_shard_bytes: int) -> dict:
    """``{name: file number from 1}``, the same on every rank (collective): names in rank order, then each
    rank's order, cut into files of at most ``max_shard_bytes`` (a larger tensor gets a file of its own)."""
    mine = [(k, _nbytes(t)) for k, t in state.items()]
    every = [None] * runtime.STATE.world_size
    dist.all_gather_object(every, mine)
    index, number, used = {}, 1, 0
    for rank_items in every:
        for key, size in rank_items:
            if key in index:
                continue
            if used and used + size > max_shard_bytes:
                number, used = number + 1, 0
            index[key], used = number, used + size
    return index


def _model_state(run) -> dict:
    """This rank's part of the model under the model's own names (the DCP checkpoint's view, any strategy)."""
    model_sd, _ = run.strategy.checkpoint_state(run.optimizer)
    return {k: v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}


def _check_dtypes(state: dict) -> None:
    odd = sorted(f"{k} ({t.dtype})" for k, t in state.items() if t.dtype not in DTYPE_NAMES)
    if odd:
        raise RuntimeError(f"rank {runtime.STATE.rank}: a safetensors folder is written here for float tensors "
                           f"(float32, float16, bfloat16, float64) only; {', '.join(odd[:5])} cannot be: convert "
                           "them, or save with --format dcp")


def save_model(run, directory: str, max_shard_bytes: int) -> dict:
    """Write ``run``'s model as a Hugging Face folder in ``directory`` (every rank calls it).

    Parameters
    ----------
    run : distnb.engine.train.loop.Run
        A model with its strategy and optimizer built (any strategy).
    directory : str
        The folder (created); files of an earlier save there are replaced.
    max_shard_bytes : int
        Largest size of one ``model-*.safetensors`` file in bytes (a larger tensor gets a file alone).

    Returns
    -------
    dict
        path, files (names), num_tensors, num_bytes (of all tensors), config (whether config.json was
        written), seconds.

    Raises
    ------
    RuntimeError
        The folder cannot be written on some rank (naming each), or a tensor's dtype cannot go in safetensors.
    """
    from torch.distributed.checkpoint import save as dcp_save

    t0 = time.perf_counter()
    check_writable(directory)
    os.makedirs(directory, exist_ok=True)  # every rank: each writes its part there (a shared file system)
    state = untied(_model_state(run), run.module)
    _check_dtypes(state)
    index = file_index(state, max_shard_bytes)
    if runtime.STATE.rank == 0:
        _clear(directory)
    dist.barrier()
    writer = StreamingHuggingFaceWriter(directory, fqn_to_index_mapping=index, save_distributed=True,
                                        enable_consolidation=True)
    dcp_save(state, storage_writer=writer)  # each rank its part into DIR/sharded; rank 0 consolidates into DIR
    dist.barrier()
    wrote_config = False
    if runtime.STATE.rank == 0:  # file I/O only: no collective under this branch
        shutil.rmtree(os.path.join(directory, "sharded"), ignore_errors=True)
        wrote_config = _write_config(run.module, state, directory)
        with open(os.path.join(directory, INDEX)) as f:
            weight_map = json.load(f)["weight_map"]
    dist.barrier()
    files = sorted(set(weight_map.values())) if runtime.STATE.rank == 0 else []
    return dict(path=directory, files=files, num_tensors=len(index),
                num_bytes=sum(_nbytes(t) for t in state.values()), config=wrote_config,
                seconds=time.perf_counter() - t0)


def _clear(directory: str) -> None:
    """Remove what an earlier save left in ``directory``: its shard files, index and parts."""
    for entry in os.listdir(directory):
        if (entry.startswith("model-") and entry.endswith(".safetensors")) or entry == INDEX:
            os.remove(os.path.join(directory, entry))
    shutil.rmtree(os.path.join(directory, "sharded"), ignore_errors=True)


def _write_config(module, state: dict, directory: str) -> bool:
    """``config.json`` (and ``generation_config.json``) of a transformers model, as ``save_pretrained`` writes them."""
    config = getattr(module, "config", None)
    if not hasattr(config, "save_pretrained"):
        return False
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__.removeprefix("FSDP")]  # fully_shard renames the class
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    if floats:
        config.dtype = str(floats[0]).removeprefix("torch.")
    config.save_pretrained(directory)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(directory)
    return True


def save_adapters(run, directory: str) -> dict:
    """Write the ``peft`` adapters of ``run``'s model to ``directory`` as ``PeftModel.save_pretrained`` does.

    ``adapter_model.safetensors`` holds ``peft.get_peft_model_state_dict`` of the active adapter (peft's
    key names, the adapter's name taken out) as full tensors; ``adapter_config.json`` its config, with
    ``inference_mode`` set as peft saves it. Every rank calls it (sharded adapters are all-gathered).

    Returns
    -------
    dict
        path, num_tensors, num_bytes, adapter (its name), seconds.

    Raises
    ------
    RuntimeError
        The model has no peft adapters, or the folder cannot be written on some rank (naming each).
    """
    from peft import get_peft_model_state_dict  # an optional extra: only a peft model gets here

    t0 = time.perf_counter()
    module = run.module
    if not hasattr(module, "peft_config"):
        raise RuntimeError(f"rank {runtime.STATE.rank}: the model has no peft adapters")
    check_writable(directory)
    os.makedirs(directory, exist_ok=True)  # every rank: each writes its part there (a shared file system)
    adapter = getattr(module, "active_adapter", None) or next(iter(module.peft_config))
    state = get_peft_model_state_dict(module, state_dict=_model_state(run), adapter_name=adapter)
    full, plain = {}, {}
    for key in sorted(state):  # the same keys in the same order on every rank that holds DTensors
        t = state[key]
        if isinstance(t, DTensor):
            full[key] = t.full_tensor().detach().cpu().contiguous()
        else:
            plain[key] = t.detach().cpu().contiguous()
    parts = [None] * runtime.STATE.world_size if runtime.STATE.rank == 0 else None
    dist.gather_object(plain, parts, dst=0)  # a pipeline stage's own; ddp's replicas (small: adapters only)
    out = {}
    if runtime.STATE.rank == 0:
        for part in parts:
            for key, t in part.items():
                out.setdefault(key, t)
        out.update(full)
        _write_adapters(module, adapter, out, directory)
    dist.barrier()
    return dict(path=directory, num_tensors=len(out) if runtime.STATE.rank == 0 else len(state),
                num_bytes=sum(_nbytes(t) for t in out.values()), adapter=adapter,
                seconds=time.perf_counter() - t0)


def _write_adapters(module, adapter: str, tensors: dict, directory: str) -> None:
    from safetensors.torch import save_file  # an optional extra, as peft

    config = copy.deepcopy(module.peft_config[adapter])
    config.inference_mode = True
    config.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
