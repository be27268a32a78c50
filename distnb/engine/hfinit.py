"""Hugging Face's own initialisation for meta-device modules that have no ``reset_parameters()``.

A ``transformers`` model built on the meta device (``with torch.device("meta"):
AutoModelForCausalLM.from_config(cfg)``) holds modules that torch cannot initialise by itself:
its norms (``LlamaRMSNorm``) and its rotary embedding, whose ``inv_freq`` buffer is non-persistent
(never in a checkpoint, so ``--load`` cannot fill it). Hugging Face's convention for these is the
model's ``_init_weights(module)``, which ``post_init()`` applies in a one-process build; in
transformers 5 it also recomputes the rotary ``inv_freq`` and ``original_inv_freq`` from the config
(``ROPE_INIT_FUNCTIONS``), so those buffers come out equal to a one-process build's. :func:`hf_init`
finds the ``PreTrainedModel`` that owns a module (the innermost one: a ``peft`` model's base model, a
composite model's sub-model, as ``PreTrainedModel.initialize_weights`` dispatches) and returns its
``_init_weights``; :func:`say_once` states it, once per cell, on rank 0.
"""

from __future__ import annotations

import sys

from . import runtime


def _pretrained_class():
    # transformers is never imported here: a model that is a PreTrainedModel has imported it already
    module = sys.modules.get("transformers")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def owners(root) -> dict:
    """``{name: module}`` of every ``transformers.PreTrainedModel`` in ``root`` (``""`` for ``root`` itself)."""
    cls = _pretrained_class()
    if cls is None:
        return {}
    return {name: mod for name, mod in root.named_modules() if isinstance(mod, cls)}


def hf_init(found: dict, name: str, module, used: dict):
    """The owning model's ``_init_weights`` bound to ``module`` (a function of no arguments), or None.

    Parameters
    ----------
    found : dict
        :func:`owners` of the whole model.
    name : str
        ``module``'s dotted name in the whole model.
    module : torch.nn.Module
        A module without ``reset_parameters()`` whose own tensors are whole, on the CPU.
    used : dict
        ``{owner class name: {module class names}}``, added to when an ``_init_weights`` is returned
        (for :func:`say_once`).

    Returns
    -------
    callable or None
        None when no ``PreTrainedModel`` contains ``module`` (a plain torch model: the caller asks for
        ``--init``).
    """
    best = None
    for prefix, owner in found.items():
        inside = prefix == "" or name == prefix or name.startswith(prefix + ".")
        if inside and (best is None or len(prefix) > len(best[0])):
            best = (prefix, owner)
    if best is None or not callable(getattr(best[1], "_init_weights", None)):
        return None
    owner = best[1]
    used.setdefault(type(owner).__name__, set()).add(type(module).__name__)
    return lambda: owner._init_weights(module)


def say_once(used: dict) -> None:
    """State on rank 0 which modules got Hugging Face's ``_init_weights`` (``{owner class: {module classes}}``)."""
    if not used or runtime.STATE.rank != 0:
        return
    parts = [f"{', '.join(sorted(kinds))} with {owner}._init_weights" for owner, kinds in sorted(used.items())]
    print(f"distnb: modules built on the meta device without reset_parameters() and no --init FN were "
          f"initialised as Hugging Face does: {'; '.join(parts)}", flush=True)
