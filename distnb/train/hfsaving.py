"""``%dist save DIR --format safetensors`` and ``%dist save --adapters DIR`` in the kernel.

``Session.save`` is :func:`session_save`: DCP checkpoints (the default, :mod:`distnb.train.checkpoints`), a
Hugging Face folder of sharded safetensors that ``from_pretrained`` reads, or a peft model's adapters
that ``PeftModel.from_pretrained`` reads. The ranks write the files (:mod:`distnb.engine.train.hfsave`); the
kernel checks the request, sends no weights and receives none.
"""

from __future__ import annotations

import os

from distnb.core import calls
from distnb.core.errors import PlanError
from distnb.core.options import check_path
from distnb.core.saveformats import FORMATS, MAX_SHARD_SIZE, check_format, shard_bytes
from distnb.execute.execute import run_on_ranks
from distnb.train import checkpoints, rankfolders


def check_adapters(name: str, model_obj) -> None:
    """PlanError unless ``model_obj`` is a peft model (``peft.get_peft_model`` over a model): the fix named."""
    if not hasattr(model_obj, "peft_config"):
        raise PlanError(f"%dist save --adapters: {name} ({type(model_obj).__name__}) has no adapters: it is not a "
                        "peft model. Wrap it before training (model = peft.get_peft_model(model, "
                        "peft.LoraConfig(target_modules=[...]))), or save the whole model with "
                        "%dist save DIR --format safetensors")


def session_save(session, directory: str, model=None, format: str = "dcp", adapters: bool = False,  # noqa: A002
                 max_shard_size=MAX_SHARD_SIZE, quiet: bool = False) -> dict:
    """Save the ranks' live model: a checkpoint, a Hugging Face folder, or a peft model's adapters.

    ``Session.save``. ``format="dcp"`` (the default) checkpoints the model, optimizer and position with
    torch.distributed.checkpoint in ``directory/step_<global step>`` (``%dist load`` restores it).
    ``format="safetensors"`` writes ``directory`` as ``save_pretrained`` does: ``model-0000x-of-0000y
    .safetensors`` with ``model.safetensors.index.json``, and ``config.json`` (with
    ``generation_config.json``) for a ``transformers`` model, so ``AutoModelForCausalLM.from_pretrained
    (directory)`` reads it; tied weights are written once (GPT-2's ``lm_head.weight`` is left out).
    ``adapters=True`` writes a peft model's adapters (``adapter_model.safetensors``,
    ``adapter_config.json``), what ``PeftModel.from_pretrained(base, directory)`` reads. Every rank
    writes its own part (torch.distributed.checkpoint's ``HuggingFaceStorageWriter``, then its
    consolidation into full tensors); the kernel holds none of it. Works for every strategy and for a
    model kept on the meta device in the notebook. Ranks on several hosts need ``directory`` on a shared
    file system.

    Parameters
    ----------
    directory : str
        The folder (created; a ``pathlib.Path`` is taken too). With ``format="safetensors"``, files of an earlier save there are replaced.
    model : str or torch.nn.Module, optional
        Default: the model of the last training cell.
    format : {"dcp", "safetensors"}
        What to write (``--format``).
    adapters : bool
        Only the peft adapters (``--adapters``).
    max_shard_size : int or str
        Largest safetensors file, in bytes or as ``"5GB"`` / ``"500MB"`` (default ``"50GB"``, as transformers).
    quiet : bool
        Print nothing.

    Returns
    -------
    dict
        DCP: the checkpoint's metadata (path, epoch, epoch_step, steps, seconds). Safetensors: path, files,
        num_tensors, num_bytes, config, seconds. Adapters: path, num_tensors, num_bytes, adapter, seconds.

    Raises
    ------
    PlanError
        No such model or not trained on the ranks; an unknown ``format``; ``adapters`` for a model that is
        not a peft model, or ``format="safetensors"`` for one (the fix named); a bad ``max_shard_size``.
        A rank cannot create or write ``directory`` (each such rank named with its host, and the fix), asked
        before anything is written: the ranks' model and process group stay.
    RankError
        A write failed once begun (a full disk); it says whether the model is still live on the ranks (their
        group kept: DCP fails on every rank alike) or where its weights are.

    Examples
    --------
    >>> session.save("out/llama-ft", format="safetensors")    # doctest: +SKIP
    >>> session.save("out/lora", adapters=True)                # doctest: +SKIP
    """
    session._check_running()
    fmt = check_format(format, adapters)
    limit = shard_bytes(max_shard_size)
    name, model_obj = checkpoints.trained_model(session, model, directory)
    directory = os.path.abspath(os.path.expanduser(check_path("directory", directory)))
    _check_request(session, name, model_obj, directory, fmt, adapters)
    check_ranks_write(session, directory, name)
    if fmt == "dcp":
        return checkpoints.save(session, name, model_obj, directory, quiet)
    if adapters:
        meta = run_on_ranks(session, calls.save_peft_adapters, name, directory, what=f"saving {name}'s adapters",
                            may_keep=True)[0]
        if not quiet:
            print(f"distnb: saved the {meta['adapter']!r} adapters of {name} ({meta['num_tensors']} tensors, "
                  f"{meta['num_bytes'] / 2**20:.1f} MiB) to {directory} in {meta['seconds']:.2f} s "
                  "(peft.PeftModel.from_pretrained(base_model, DIR) reads them)")
        return meta
    meta = run_on_ranks(session, calls.save_safetensors, name, directory, limit, what=f"saving {name}",
                        may_keep=True)[0]
    if not quiet:
        reader = "AutoModel*.from_pretrained(DIR)" if meta["config"] else "safetensors.torch.load_file per file"
        print(f"distnb: saved {name} to {directory} as {len(meta['files'])} safetensors "
              f"file{'s' if len(meta['files']) != 1 else ''} ({meta['num_tensors']} tensors, "
              f"{meta['num_bytes'] / 2**20:.1f} MiB{', with config.json' if meta['config'] else ''}) in "
              f"{meta['seconds']:.2f} s ({reader} reads it)")
    return meta


def _check_request(session, name: str, model_obj, directory: str, fmt: str, adapters: bool) -> None:
    """PlanError, naming the fix, unless model ``name`` is on the ranks and fits what is to be saved of it."""
    if name not in session.holdings.models:
        raise PlanError(f"{name} is not on the ranks (train it with %%distrain, or %dist load weights into it, "
                        "first)")
    if adapters:
        check_adapters(name, model_obj)
    elif fmt == "safetensors" and hasattr(model_obj, "peft_config"):
        raise PlanError(f"{name} is a peft model: save its adapters with %dist save --adapters {directory}, or "
                        "merge them into the base model first (model.merge_and_unload() on the ranks) and save that")


def check_ranks_write(session, directory: str, name: str) -> None:
    """Ask every rank whether it can create ``directory`` and write in it, before any rank writes.

    Not a collective (:func:`distnb.engine.train.savefolder.writable`): nothing fails on the ranks, so the
    process group and the model they hold stay, whatever the answer.

    Raises
    ------
    PlanError
        Some rank cannot (its engine's user may not write there, a file is in the way, the folder is on
        another host's disk): naming each such rank with its host and reason, and the fix.
    """
    why = rankfolders.not_writable(session, directory)
    if why:
        raise PlanError(f"%dist save {directory}: {why}. Nothing was written, and {name} is still live on the ranks")


def save_arguments(argument):
    """A decorator giving the ``%dist save`` magic its arguments, with their help (``argument``: IPython's
    ``magic_arguments.argument``, passed in so that this module does not import IPython)."""
    return lambda fn: _apply(argument, fn)


def _apply(argument, fn):
    for args, kw in reversed([
        (("directory",), dict(help="folder: DCP checkpoints go to DIRECTORY/step_<global step>; safetensors and "
                                   "adapters straight into DIRECTORY")),
        (("--model",), dict(default=None, help="notebook name of the model (default: the last one trained)")),
        (("--format",), dict(default="dcp", metavar="{" + ",".join(FORMATS) + "}", help="dcp (default: model, "
                             "optimizer and position, for %%dist load) or safetensors (a Hugging Face folder: "
                             "model-0000x-of-0000y.safetensors, model.safetensors.index.json, config.json; "
                             "AutoModelForCausalLM.from_pretrained(DIR) reads it). "
                             "Example: %%dist save out/llama --format safetensors")),
        (("--adapters",), dict(action="store_true", help="only a peft model's adapters (adapter_model.safetensors "
                               "and adapter_config.json; PeftModel.from_pretrained(base, DIR) reads them). "
                               "Example: %%dist save --adapters out/lora")),
        (("--max-shard-size",), dict(default=MAX_SHARD_SIZE, dest="max_shard_size", help="largest safetensors "
                                     f"file, e.g. 5GB or 500MB (default {MAX_SHARD_SIZE}, as transformers)")),
    ]):
        fn = argument(*args, **kw)(fn)
    return fn


def save_keywords(args) -> dict:
    """``Session.save``'s keywords from the parsed ``%dist save`` line."""
    return dict(directory=args.directory, model=args.model, format=args.format, adapters=args.adapters,
                max_shard_size=args.max_shard_size)


def export_format_argument(argument):
    """A decorator giving ``%dist export`` its ``--format`` (``argument``: IPython's, as in :func:`save_arguments`)."""
    return argument("--format", default="dcp", metavar="{" + ",".join(FORMATS) + "}",
                    help="what the job saves when it ends, besides its DCP checkpoints (which it resumes from): dcp "
                    "(nothing more, the default) or safetensors (the trained model as a Hugging Face folder in "
                    "model/ of the export folder; a peft model's adapters). The job's train.py --format changes it. "
                    "Example: %%dist export jobs/llama --format safetensors")
