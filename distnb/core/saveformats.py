"""What ``%dist save`` and an exported job's save can write, and the size of a safetensors file (stdlib only:
the kernel's ``%dist save`` and the job's ``train.py --format`` read the same names)."""

from __future__ import annotations

import re

from distnb.core.errors import PlanError

#: What ``--format`` takes: torch.distributed.checkpoint (resumable: optimizer and position too) or safetensors.
FORMATS = ("dcp", "safetensors")
#: Default largest size of one safetensors file (transformers' own default for save_pretrained).
MAX_SHARD_SIZE = "50GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_bytes(size) -> int:
    """``size`` (an int of bytes, or ``"5GB"``, ``"500MB"``, ``"2GiB"`` as transformers reads it) in bytes.

    Raises
    ------
    PlanError
        Not a positive size.
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper()) if isinstance(size, str) else None
    if found and found.group(2) in _UNITS and float(found.group(1)) > 0:
        return int(float(found.group(1)) * _UNITS[found.group(2)])
    raise PlanError(f"max_shard_size must be a positive size such as 5GB, 500MB or a number of bytes, got {size!r}")


def check_format(fmt, adapters: bool) -> str:
    """``fmt`` checked against :data:`FORMATS` (and against ``adapters``, which always writes safetensors)."""
    if fmt not in FORMATS:
        raise PlanError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}: dcp (a checkpoint %dist load reads, "
                        "the default) or safetensors (a Hugging Face folder from_pretrained reads)")
    if adapters and fmt == "dcp":
        return "safetensors"  # peft's own files
    return fmt
