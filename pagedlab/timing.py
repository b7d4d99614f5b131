"""Timing as the chapters and the benchmarks measure it, so that their numbers compare.

:func:`seconds_per_call` times a callable (Triton's ``do_bench`` on a GPU, which flushes the L2
cache between calls; a median of CPU time on a CPU); :func:`copy_bandwidth` measures the ceiling
a memory-bound kernel is judged against: a plain same-device copy. :class:`CPUClock` is the
clock a CPU run's conclusions are read from: a neighbour's load stretches wall-clock time, not
the CPU time this process spends.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagedlab.device import DEVICE, HAS_CUDA

__all__ = ["seconds_per_call", "copy_bandwidth", "CPUClock", "step_clock", "Elapsed", "stopwatch"]


def seconds_per_call(fn, repeats: int = 3) -> float:
    """Median seconds per call of ``fn()``: ``do_bench`` on CUDA, else the median CPU time
    of ``repeats`` calls after a warm-up call (this process's CPU time, all threads: on a
    shared machine the wall clock would also count other programs' turns on the cores)."""
    if HAS_CUDA:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()  # warm-up: first calls pay for compilation and caches
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, device=DEVICE) -> float:
    """Bytes per second of a same-device copy of ``nbytes`` bytes, counting the bytes read
    and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call(lambda: dst.copy_(src))


class CPUClock:
    """Seconds of this process's CPU time, plus whatever idle time :meth:`sleep` skipped.

    On a shared CPU the wall clock runs on while other programs hold the cores, so a step timed
    by it costs what the machine's load makes it cost. This process's CPU time advances only
    while it computes, so a step costs about what its work costs, busy machine or not. Sleeping
    does not spend CPU time: :meth:`sleep` moves the clock forward at once instead, so a timed
    replay keeps its arrivals' gaps without waiting them out. Run torch on one thread with it
    (``torch.set_num_threads(1)``): idle worker threads that spin would count as work.
    """

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.process_time() + self.skipped

    def sleep(self, seconds: float) -> None:
        self.skipped += max(0.0, seconds)


def step_clock():
    """(clock, sleep) a chapter times engine steps with: the wall clock on a GPU, whose work
    this process's CPU time does not see, else a fresh :class:`CPUClock`."""
    if HAS_CUDA:
        return time.monotonic, time.sleep
    clock = CPUClock()
    return clock, clock.sleep


@dataclass
class Elapsed:
    """Seconds a block took: on the wall clock, and in this process's CPU time (all threads)."""

    wall: float = 0.0
    cpu: float = 0.0


@contextmanager
def stopwatch(device=DEVICE):
    """``with stopwatch() as t:`` times the block into ``t.wall`` and ``t.cpu``, synchronizing
    a CUDA ``device`` at both ends so that its queued work is inside the timing."""
    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    elapsed = Elapsed()
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield elapsed
    finally:
        sync()
        elapsed.wall = time.perf_counter() - wall
        elapsed.cpu = time.process_time() - cpu
