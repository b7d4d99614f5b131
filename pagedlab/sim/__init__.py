"""Simulation without a GPU: request traces, and KV memory over time under a policy.

Chapter 2 uses :mod:`~pagedlab.sim.memory_sim` to measure how contiguous allocation wastes
memory; chapter 9 extends it with the engine's scheduler and a GPU cost model.
"""

from pagedlab.sim.memory_sim import POLICIES, KVPolicy, PagedKV, SimResult, make_policy, simulate
from pagedlab.sim.traces import (
    DATASETS,
    LengthStats,
    Request,
    clip_to_context,
    load_trace,
    shared_trace_path,
    synthetic_requests,
)

__all__ = [
    "DATASETS", "POLICIES", "KVPolicy", "LengthStats", "PagedKV", "Request", "SimResult",
    "clip_to_context", "load_trace", "make_policy", "shared_trace_path", "simulate",
    "synthetic_requests",
]
