"""Simulation without a GPU: request traces, and KV memory over time under a memory system.

Chapter 2 uses :mod:`~pagedlab.sim.memory_sim` to measure how contiguous allocation wastes
memory; chapter 10 extends it with the engine's scheduler (:mod:`~pagedlab.sim.simulator`) and a GPU
cost model (:mod:`~pagedlab.sim.cost_model`); chapters 5 and 10 measure what sharing saves with
:mod:`~pagedlab.sim.sharing`.
"""

from pagedlab.sim.cost_model import CostModel
from pagedlab.sim.memory_sim import (
    SYSTEMS,
    KVMemory,
    PagedKV,
    SimResult,
    make_memory,
    simulate,
)
from pagedlab.sim.simulator import (
    SYSTEM_NAMES,
    PagedConfig,
    SimExecutor,
    knee_rate,
    knee_rates,
    simulate_paged,
    simulate_system,
    sweep,
    with_rate,
)
from pagedlab.sim.traces import (
    DATASETS,
    LengthStats,
    Request,
    TraceNotFound,
    clip_to_context,
    load_trace,
    shared_trace_path,
    synthetic_requests,
    trace_path,
)

__all__ = [
    "DATASETS", "SYSTEMS", "SYSTEM_NAMES", "CostModel", "KVMemory",
    "LengthStats", "PagedConfig", "PagedKV", "Request", "SimExecutor", "SimResult", "TraceNotFound",
    "clip_to_context", "knee_rate", "knee_rates", "load_trace", "make_memory",
    "shared_trace_path", "simulate", "simulate_paged", "simulate_system", "sweep",
    "synthetic_requests", "trace_path", "with_rate",
]
