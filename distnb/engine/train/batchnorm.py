"""``--sync-bn``: BatchNorm layers of a rank's model become ``torch.nn.SyncBatchNorm``, and back.

``SyncBatchNorm.convert_sync_batchnorm`` builds new layers that share the original layers'
parameters and running-statistics tensors, so the state dict (and the weights that go back
to the notebook, whose model keeps its plain BatchNorm) is unchanged. The originals are
remembered on the model, so a later cell without ``--sync-bn`` puts them back exactly.
torch's SyncBatchNorm needs CUDA: the kernel refuses ``--sync-bn`` on CPU ranks first.
"""

from __future__ import annotations

import torch

_ORIGINALS = "_distnb_plain_batchnorm"


def holds_sync_batchnorm(module) -> bool:
    return any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())


def convert(module, sync: bool):
    """``module`` with SyncBatchNorm layers (``sync``) or its plain BatchNorm layers put back."""
    if sync:
        if holds_sync_batchnorm(module):
            return module
        originals = {name: m for name, m in module.named_modules()
                     if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
        converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
        object.__setattr__(converted, _ORIGINALS, originals)
        return converted
    originals = getattr(module, _ORIGINALS, None)
    if not originals:
        return module
    root = originals.get("")
    for name, original in originals.items():
        if not name:
            continue
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, attr, original)
    object.__setattr__(module, _ORIGINALS, None)
    return root if root is not None else module
