"""A ``peft`` model's names for ``--load``: its base weights under the base model's own names.

``peft.get_peft_model(base, config)`` renames the base model's tensors: its ``state_dict`` has
``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` for the file's
``model.layers.0.self_attn.q_proj.weight`` (the ``base_model.model.`` prefix of ``PeftModel``, and
``base_layer`` for each layer an adapter wraps; for ``modules_to_save``, ``original_module`` and the
trainable copy ``modules_to_save.<adapter>``, both read from the base module's weights), plus the adapters' own tensors
(``...q_proj.lora_A.default.weight``), which a pretrained folder does not hold. :func:`renaming` maps a
peft key to the name ``save_pretrained`` of the base model wrote; :func:`adapter_keys` lists the
adapters' keys, which ``--load`` leaves to peft's initialisation (a meta model) or to the notebook's
values. For any other model both are the identity and the empty set. The renaming is the one
``PeftModel.from_pretrained`` relies on when it wraps a model that ``from_pretrained`` loaded.
"""

from __future__ import annotations

import re
import sys

PREFIX = "base_model.model."
#: ``modules_to_save``: peft keeps the base module as ``original_module`` and a trainable copy per adapter.
MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


def _peft():
    # peft is never imported here: a model that is a PeftModel has imported it already
    return sys.modules.get("peft")


def is_peft(model_obj) -> bool:
    """Whether ``model_obj`` is a ``peft.PeftModel`` (of any task type)."""
    peft = _peft()
    return peft is not None and isinstance(model_obj, peft.PeftModel)


def renaming(model_obj):
    """A function from ``model_obj``'s ``state_dict`` keys to the names of the base model's files."""
    if not is_peft(model_obj):
        return lambda key: key

    def base_name(key: str) -> str:
        if key.startswith(PREFIX):
            key = key[len(PREFIX):]
        key = key.replace(".base_layer.", ".").replace(".original_module.", ".")
        return MODULES_TO_SAVE.sub(".", key)  # a trainable copy starts as the base module: read from it too

    return base_name


def adapter_keys(model_obj) -> set:
    """The ``state_dict`` keys of ``model_obj``'s adapters (its tuner layers' ``adapter_layer_names``)."""
    if not is_peft(model_obj):
        return set()
    BaseTunerLayer = _peft().tuners.tuners_utils.BaseTunerLayer  # loaded with peft's PeftModel (is_peft)
    prefixes = [f"{name}.{attr}." for name, mod in model_obj.named_modules() if isinstance(mod, BaseTunerLayer)
                for attr in getattr(mod, "adapter_layer_names", ())]
    return {key for key in model_obj.state_dict(keep_vars=True) if any(key.startswith(p) for p in prefixes)}
