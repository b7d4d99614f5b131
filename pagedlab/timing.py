"""Timing as the chapters and the benchmarks measure it, so that their numbers compare.

:func:`seconds_per_call` times a callable (Triton's ``do_bench`` on a GPU, which flushes the L2
cache between calls; a wall-clock median on a CPU); :func:`copy_bandwidth` measures the ceiling
a memory-bound kernel is judged against: a plain same-device copy.
"""

from __future__ import annotations

import statistics
import time

import torch

from pagedlab.device import DEVICE, HAS_CUDA

__all__ = ["seconds_per_call", "copy_bandwidth"]


def seconds_per_call(fn, repeats: int = 3) -> float:
    """Median seconds per call of ``fn()``: ``do_bench`` on CUDA, else the median of
    ``repeats`` timed calls after a warm-up call."""
    if HAS_CUDA:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()  # warm-up: first calls pay for compilation and caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, device=DEVICE) -> float:
    """Bytes per second of a same-device copy of ``nbytes`` bytes, counting the bytes read
    and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call(lambda: dst.copy_(src))
