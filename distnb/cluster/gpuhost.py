"""What a GPU host shared with the kernel needs from it (GPU review, finding 14): no CUDA context here.

The notebook habit ``net.cuda()`` in the kernel makes a CUDA context (about 0.5 GB, plus the model)
on the kernel's first visible GPU, which is rank 0's: rank 0 then runs out of memory first, and on
GPUs in ``EXCLUSIVE_PROCESS`` compute mode (common on clusters) rank 0 cannot make its own context
at all. distnb itself never makes one in the kernel: it counts GPUs without torch
(:func:`distnb.core.net.visible_gpus`), and what comes back from the ranks is on the CPU. When the
kernel already holds one, ``%dist start`` says so (:func:`kernel_cuda_note`).
"""

from __future__ import annotations

import sys


def kernel_cuda_note(device_type: str) -> str:
    """A warning for ``%dist start`` on GPUs when this process holds a CUDA context, else ``""``.

    Asks ``torch.cuda.is_initialized()``, which makes no context itself, and only when the
    notebook imported torch (distnb imports nothing for it).
    """
    torch = sys.modules.get("torch")
    if device_type != "cuda" or torch is None or not torch.cuda.is_initialized():
        return ""
    return ("this kernel holds a CUDA context (about 0.5 GB on its first visible GPU, rank 0's, plus what it "
            "put there: `.cuda()`/`.to('cuda')` in the notebook): rank 0 may run out of memory first, and GPUs "
            "in EXCLUSIVE_PROCESS mode refuse rank 0's context. Keep the notebook's tensors on the CPU (distnb "
            "moves them to the ranks' GPUs), then %dist restart or restart the kernel")
