"""Hugging Face's own initialisation for the modules of a transformers model built on the meta device.

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


def hf_init(found: dict, name: str, module, used: dict, first=None):
    """The owning model's ``_init_weights`` bound to ``module`` (a function of no arguments), or None.

    A one-process build of a transformers model runs each module's constructor (``reset_parameters()``:
    torch's kaiming init for a Linear, N(0, 1) for an Embedding) and then ``post_init()``'s
    ``_init_weights`` over every module (N(0, ``initializer_range``) for both). The returned function does
    the same for one module: ``first()`` (its ``reset_parameters``, when it has one), then ``_init_weights``,
    so the weights follow Hugging Face's distributions, not torch's. The generator's draws come in module
    order, not in the two sweeps of a one-process build, so the values differ from it (the distributions
    do not).

    Parameters
    ----------
    found : dict
        :func:`owners` of the whole model.
    name : str
        ``module``'s dotted name in the whole model.
    module : torch.nn.Module
        A module whose own tensors are whole, on the CPU.
    used : dict
        ``{owner class name: {module class names}}``, added to when an ``_init_weights`` is returned
        (for :func:`say_once`).
    first : callable, optional
        The module's own ``reset_parameters``, run before ``_init_weights``.

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
    if first is None:
        return lambda: owner._init_weights(module)
    return lambda: (first(), owner._init_weights(module))


def say_once(used: dict, rank: int) -> None:
    """State on rank 0 which modules got Hugging Face's ``_init_weights`` (``{owner class: {module classes}}``)."""
    if not used or rank != 0:
        return
    parts = [f"{', '.join(sorted(kinds))} with {owner}._init_weights" for owner, kinds in sorted(used.items())]
    print(f"distnb: a Hugging Face model built on the meta device, no --init FN: its modules were initialised "
          f"as Hugging Face does (reset_parameters() where they have one, then _init_weights): {'; '.join(parts)}",
          flush=True)
