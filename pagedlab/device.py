"""Where pagedlab runs: CUDA when present, otherwise the CPU with Triton's interpreter.

Importing pagedlab imports this module first. On a machine without CUDA it sets
``TRITON_INTERPRET=1`` before any pagedlab kernel is defined, so every Triton kernel runs
through the interpreter with no action from the reader. Chapters size their problems with
:func:`pick`: small enough for the interpreter on a CPU, realistic on a GPU.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA: bool = torch.cuda.is_available()
DEVICE: torch.device = torch.device("cuda" if HAS_CUDA else "cpu")

if not HAS_CUDA:
    # Triton reads this flag when a kernel is decorated, so it must be set before
    # pagedlab.kernels is imported. setdefault lets a reader force TRITON_INTERPRET=0.
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_SIZES = ("small", "large")


def size_preset() -> str:
    """``"small"`` on a CPU, ``"large"`` on a GPU; ``PAGEDLAB_SIZE`` overrides either way."""
    preset = os.environ.get("PAGEDLAB_SIZE", "large" if HAS_CUDA else "small")
    if preset not in _SIZES:
        raise ValueError(f"PAGEDLAB_SIZE must be one of {_SIZES}, got {preset!r}")
    return preset


def pick(small, large):
    """Return ``small`` under the small preset (CPU, interpreter) and ``large`` otherwise.

    >>> context_len = pick(small=64, large=4096)
    """
    return small if size_preset() == "small" else large


def half_dtype(capability: tuple[int, int] | None = None) -> torch.dtype:
    """The 16-bit dtype for a model and its cache on a GPU of compute ``capability`` (this one's
    by default): bf16 from 8.0 (Ampere) on, fp16 below. A T4 (7.5, Colab's free GPU) has no
    bf16 tensor cores, and vLLM refused bf16 there too (``_check_if_gpu_supports_dtype`` in
    V0's ``vllm/worker/worker.py``); ``torch.cuda.is_bf16_supported()`` says True on a T4,
    counting software emulation, so the capability decides here. bf16 on a CPU."""
    if capability is None and HAS_CUDA:
        capability = torch.cuda.get_device_capability()
    return torch.float16 if capability is not None and tuple(capability) < (8, 0) else \
        torch.bfloat16


def describe() -> str:
    """One line that says where the code is running, for the top of each chapter."""
    if HAS_CUDA:
        where = f"CUDA ({torch.cuda.get_device_name(0)})"
    else:
        where = "CPU, Triton kernels through the interpreter" if INTERPRET else "CPU"
    return f"pagedlab on {where}; size preset: {size_preset()}"
