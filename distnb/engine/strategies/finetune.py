"""Fine-tuning a part of a model: frozen parameters, and the units of a Hugging Face model.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022) as ``peft``
builds it freezes every weight of the base model (``requires_grad=False``) and adds small trainable
adapter matrices beside some of its linear layers. What that means for each strategy:

- the optimizer is built over the trainable parameters only (:func:`trainable`), so no optimizer
  state is ever made for a frozen weight, whichever optimizer the cell names;
- DDP registers only parameters that require gradients with its reducer: frozen weights are never
  all-reduced and get no bucket memory (``torch.nn.parallel.DistributedDataParallel``);
- FSDP2 (torch 2.13, ``FSDPParamGroup.post_backward``) reduce-scatters only the parameters of a unit
  that got a gradient, so a unit may mix frozen base weights and trainable adapters: the frozen
  ones are all-gathered for the forward and backward and get neither a gradient nor a
  reduce-scatter.

The FSDP units of a Hugging Face model (plain, or wrapped by ``peft``) are its repeated blocks,
the classes the model lists in ``_no_split_modules`` (``LlamaDecoderLayer``, ``GPT2Block``), as
Accelerate's ``transformer_auto_wrap_policy`` wraps them (:func:`block_units`): one unit per decoder
layer, so a rank gathers one layer at a time; embeddings, final norm and head go to the root unit.
The peft model's own child, ``base_model`` (a ``LoraModel``), is never a unit: ``PeftModel.forward``
without a ``task_type`` calls the model inside it directly (``get_base_model()(...)``, peft 0.21), so
that unit's forward, where FSDP2 gathers it, never runs (DTensor then fails at the embedding).
"""

from __future__ import annotations

import math

import torch

from distnb.engine.process import runtime


def trainable(params, module=None):
    """The parameters of ``params`` that require gradients, as the optimizer's parameter list.

    Parameters
    ----------
    params : iterable of torch.nn.Parameter
        What the strategy says this rank's optimizer updates (``Strategy.parameters()``).
    module : torch.nn.Module, optional
        The whole model: when this rank's own parameters are all frozen but the model has trainable
        ones elsewhere (a pipeline stage of frozen layers), this rank gets an empty optimizer.

    Returns
    -------
    list
        The trainable parameters, in order; ``[{"params": []}]`` (one empty parameter group, which
        ``torch.optim`` accepts) when this rank has none to update but the model does, so that every
        rank has an optimizer to step.

    Raises
    ------
    ValueError
        Every parameter of the model is frozen (naming the rank and the fix): nothing to train.
    """
    params = list(params)
    found = [p for p in params if p.requires_grad]
    if found:
        return found
    whole = params if module is None else list(module.parameters())
    if not whole or any(p.requires_grad for p in whole):
        return [{"params": []}]
    raise ValueError(f"on rank {runtime.STATE.rank} every parameter of the model is frozen (requires_grad=False): "
                     "there is nothing to train; unfreeze some (p.requires_grad_(True)) or add adapters "
                     "(peft.get_peft_model) and run the cell again")


def _base_model(module):
    """The Hugging Face model inside ``module`` (a ``peft`` model's base model), else ``module``."""
    get = getattr(module, "get_base_model", None)
    if callable(get) and hasattr(module, "peft_config"):
        try:
            return get()
        except Exception:  # not peft's after all: treat it as a plain model
            return module
    return module


def block_units(module) -> list[str]:
    """Names of the repeated blocks of a Hugging Face model, its natural FSDP units ([] for other models).

    The blocks are the submodules whose class is named in the model's ``_no_split_modules``
    (``transformers.PreTrainedModel``; for a ``peft`` model, its base model's), outermost only:
    ``model.layers.0``, ``model.layers.1``, ... for a Llama; under ``peft`` the same names with
    ``base_model.model.`` before them. Models that declare none (plain ``nn.Module``) get [].
    """
    classes = set(getattr(_base_model(module), "_no_split_modules", None) or ())
    if not classes:
        return []
    units: list[str] = []
    for name, sub in module.named_modules():
        if name and type(sub).__name__ in classes and not any(name.startswith(u + ".") for u in units):
            if any(True for _ in sub.parameters()):
                units.append(name)
    return units


#: The submodules of a peft LoRA layer that hold the adapter matrices (``lora_A.default``, ``lora_B.default``).
_ADAPTERS = ("lora_A", "lora_B")


def adapter_init(root, name: str, module):
    """peft's own initialisation of a LoRA adapter ``module`` built on the meta device, or None for other modules.

    A ``peft`` model built over a meta model has its adapters on meta too, and
    ``nn.Linear.reset_parameters()`` (or a notebook's ``--init``) would give ``lora_B`` random values:
    the adapter would change the model's output before training, silently. This mirrors
    ``LoraLayer.reset_lora_parameters`` (peft 0.21): ``init_lora_weights=True`` draws A with
    ``kaiming_uniform_(a=sqrt(5))``, ``"gaussian"`` with ``normal_(std=1/r)``, and both set B (and its
    bias) to zero; ``False`` keeps ``nn.Linear``'s own initialisation for both.

    Parameters
    ----------
    root : torch.nn.Module
        The whole model (a ``peft.PeftModel``; its ``peft_config`` gives ``init_lora_weights``).
    name : str
        ``module``'s name in ``root`` (``...q_proj.lora_A.default``).
    module : torch.nn.Module
        The module whose own tensors are to be initialised (whole, on the CPU).

    Returns
    -------
    callable or None
        A function of no arguments that initialises ``module`` in place; None when ``module`` is not
        a LoRA adapter matrix (the caller then uses ``--init`` or ``reset_parameters()``).

    Raises
    ------
    RuntimeError
        An ``init_lora_weights`` that is computed from the base weights (``"pissa"``, ``"olora"``,
        ``"loftq"``, ...), which a meta model does not have: the message names the module and the fix.
    """
    parent, _, adapter = name.rpartition(".")
    layer_name, _, kind = parent.rpartition(".")
    if kind not in _ADAPTERS or not isinstance(module, torch.nn.Linear):
        return None
    layer = root.get_submodule(layer_name) if layer_name else root
    if not hasattr(layer, "reset_lora_parameters"):
        return None
    config = (getattr(root, "peft_config", None) or {}).get(adapter)
    mode = getattr(config, "init_lora_weights", True)
    if mode is False:
        return module.reset_parameters
    if mode is not True and str(mode).lower() != "gaussian":
        raise RuntimeError(f"{name} (a LoRA adapter) was built on the meta device with init_lora_weights={mode!r}, "
                           "which peft computes from the base weights; the ranks cannot: build the peft model over "
                           "a model that holds its weights, or use init_lora_weights=True or 'gaussian'")

    def initialise():
        if kind == "lora_B":
            torch.nn.init.zeros_(module.weight)
        elif mode is True:
            torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        else:
            torch.nn.init.normal_(module.weight, std=1 / layer.r[adapter])
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    return initialise
