"""Whether a rank's GPU runs ``--precision bf16`` natively (GPU review, finding 14).

GPUs before Ampere (compute capability < 8.0: T4, V100, the 2xT4 notebook hosts) have no bf16
arithmetic. ``torch.cuda.is_bf16_supported()`` still answers True there, by default
(``including_emulation=True``: it makes a bf16 tensor, ``torch/cuda/__init__.py``), so autocast
accepts bf16 and runs it emulated, several times slower than fp16. The cell then says so once,
naming the GPU and the faster choice; it trains on (the results are right, only slow).
"""

from __future__ import annotations


def precision_note(precision: str | None, device) -> str:
    """The start note of a ``--precision bf16`` cell on a GPU without native bf16, else ``""``.

    Parameters
    ----------
    precision : str or None
        The cell's ``--precision`` (``"fp32"``, ``"bf16"``, ``"fp16"``).
    device : torch.device or None
        The rank's device; only a CUDA device is asked (the CPU case is in docs/guides/real_jobs.md).
    """
    if precision != "bf16" or getattr(device, "type", None) != "cuda":
        return ""
    import torch  # loaded already on a CUDA rank

    if torch.cuda.is_bf16_supported(including_emulation=False):
        return ""
    major, minor = torch.cuda.get_device_capability(device)
    return (f"--precision bf16 on {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, "
            "before Ampere's 8.0) is emulated, several times slower than fp16: --precision fp16 is the fast "
            "choice on this GPU")
