"""Number formats of weights and KV caches: canonical names and bytes per value.

Every size in pagedlab is counted in bytes, so all a format contributes is its width.
Names follow the papers ("fp16", "bf16", "fp8"); the matching torch dtypes are accepted too.
"""

from __future__ import annotations

import torch

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}

FP8 = torch.float8_e4m3fn  # the fp8 KV cache's format (e4m3), as in vLLM's "fp8" cache

_TORCH_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    FP8: "fp8",
    torch.float8_e5m2: "fp8",
}


def dtype_name(dtype, field: str = "dtype") -> str:
    """Canonical name of ``dtype`` (a name above or a torch dtype); errors name ``field``."""
    name = _TORCH_NAMES.get(dtype) if isinstance(dtype, torch.dtype) else dtype
    if not isinstance(name, str) or name not in DTYPE_BYTES:
        raise ValueError(
            f"{field}={dtype!r} is not a known dtype; use one of {', '.join(DTYPE_BYTES)}"
            f" or one of the torch dtypes {', '.join(str(d) for d in _TORCH_NAMES)}"
        )
    return name


def dtype_bytes(dtype, field: str = "dtype") -> int:
    """Bytes per value of ``dtype``: 4 for fp32, 2 for fp16/bf16, 1 for fp8."""
    return DTYPE_BYTES[dtype_name(dtype, field)]
