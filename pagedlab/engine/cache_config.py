"""The KV cache's configuration, with vLLM's names and defaults (chapters 6 and 8).

The other half of an engine's configuration, beside
:class:`~pagedlab.engine.scheduler_config.SchedulerConfig`: how big a block is, how many the
GPU and CPU pools hold (or the memory that sizes them), whether full blocks are shared across
requests, and the cache's dtype. It checks itself when made, so the engine does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedlab._checks import check_positive

KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache's size and form (vLLM's ``CacheConfig`` fields).

    ``num_gpu_blocks`` sets the GPU pool's size; None: what a memory budget holds,
    ``kv_cache_memory_bytes`` if given, else what ``gpu_memory_utilization`` leaves after the
    weights (on a CPU, ``$PAGEDLAB_CPU_KVCACHE_SPACE`` GiB). ``swap_space`` (GiB) or
    ``num_cpu_blocks`` sizes the CPU pool that swapping needs. ``kv_cache_dtype`` "fp8"
    stores e4m3 keys and values with one scale ``kv_scale`` (pagedlab's stand-in for vLLM's
    ``k_scale``/``v_scale``).
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 0  # GiB of CPU memory for swapped-out blocks
    num_cpu_blocks: int | None = None  # None: what swap_space holds
    enable_prefix_caching: bool = False
    kv_cache_dtype: str = "auto"  # or "fp8"
    kv_scale: float = 1.0

    def __post_init__(self):
        check_positive("block_size", self.block_size, integer=True)
        for name in ("num_gpu_blocks", "kv_cache_memory_bytes", "num_cpu_blocks"):
            value = getattr(self, name)
            if value is not None:
                check_positive(name, value, integer=True, allow_zero=name == "num_cpu_blocks")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not (isinstance(u, (int, float)) and 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization={u!r} must be in (0, 1]")
        check_positive("swap_space", self.swap_space, allow_zero=True)
        if not math.isfinite(self.swap_space):
            raise ValueError(f"swap_space={self.swap_space!r} must be a finite number of GiB")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a "
                             "bool")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        check_positive("kv_scale", self.kv_scale)
        if not math.isfinite(self.kv_scale):
            raise ValueError(f"kv_scale={self.kv_scale!r} must be finite and > 0")
