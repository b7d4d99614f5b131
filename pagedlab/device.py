"""Where pagedlab runs: CUDA, else Apple's GPU (MPS), else the CPU; Triton's kernels where
Triton imports, the torch references where it does not.

Importing pagedlab imports this module first. On a machine without CUDA it sets
``TRITON_INTERPRET=1`` before any pagedlab kernel is defined, so every Triton kernel runs
through the interpreter with no action from the reader. Triton publishes Linux wheels only: on
macOS and Windows :func:`has_triton` is False, the model and the engine use the torch references
(:mod:`pagedlab.kernels.reference`) and :func:`describe` says so. ``PAGEDLAB_DEVICE`` (``cuda``,
``mps`` or ``cpu``) overrides the choice of device. Chapters size their problems with
:func:`pick`: small enough for the interpreter on a CPU, realistic on a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("cuda", "mps", "cpu")


def select_device() -> torch.device:
    """``$PAGEDLAB_DEVICE`` if set, else the first of CUDA, MPS and the CPU that torch finds."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(),
                 "cpu": True}
    name = os.environ.get("PAGEDLAB_DEVICE") or next(b for b in BACKENDS if available[b])
    if name not in BACKENDS:
        raise ValueError(f"PAGEDLAB_DEVICE must be one of {BACKENDS}, got {name!r}")
    if not available[name]:
        raise RuntimeError(f"PAGEDLAB_DEVICE={name} but torch finds no {name} device here; "
                           f"unset PAGEDLAB_DEVICE to use the best device there is")
    return torch.device(name)


DEVICE: torch.device = select_device()
HAS_CUDA: bool = DEVICE.type == "cuda"

if not HAS_CUDA:
    # Triton reads this flag when a kernel is decorated, so it must be set before
    # pagedlab.kernels is imported. setdefault lets a reader force TRITON_INTERPRET=0.
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_import_error() -> str | None:
    """Why ``import triton`` fails here (``None``: it works). Asked on first use, not at import,
    so that ``import pagedlab`` stays as quick as before and TRITON_INTERPRET is set first."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def has_triton() -> bool:
    """True where Triton imports, so that pagedlab's Triton kernels can be defined."""
    return triton_import_error() is None


def require_triton(what: str, instead: str) -> None:
    """Raise an ImportError that says ``what`` needs Triton, why it is missing, and to use
    ``instead``."""
    if not has_triton():
        raise ImportError(
            f"{what} needs Triton, which cannot be imported here ({triton_import_error()}). "
            f"Triton publishes Linux wheels only (no macOS or Windows); use {instead}, plain "
            f"torch with the same results, or run on Linux, WSL or Colab")

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
    """One line that says where the code is running and whether Triton's kernels run there
    (compiled, interpreted, or unavailable), for the top of each chapter."""
    if HAS_CUDA:
        where = f"CUDA ({torch.cuda.get_device_name(0)})"
    else:
        where = "MPS (Apple GPU)" if DEVICE.type == "mps" else "CPU"
    if not has_triton():
        where += ", Triton unavailable: the torch reference kernels run instead"
    elif HAS_CUDA:
        where += ", Triton kernels"
    elif INTERPRET:
        where += ", Triton kernels through the interpreter"
    return f"pagedlab on {where}; size preset: {size_preset()}"
