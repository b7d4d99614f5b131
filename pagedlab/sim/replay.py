"""A timed replay: a trace served by the real engine on a clock, and the simulator's
prediction of the same run (chapter 10).

:func:`replay` feeds each request of a trace to an :class:`~pagedlab.engine.LLM` when its
arrival time comes round, adding every request that has arrived before each step and sleeping
while the engine is idle, and records what a serving benchmark reports per request (time to
first token, time per output token, end-to-end latency) from the clock after each step, and
each step's time and shape. :func:`predict` runs the simulator on the same requests, arrivals,
scheduler limits and cache size, with a cost model (usually one fitted by
:mod:`pagedlab.sim.calibration`), and :func:`errors` says how far apart the two are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from pagedlab.engine.params import SamplingParams
from pagedlab.engine.scheduler import SchedulerConfig
from pagedlab.sim.calibration import StepTiming, timed_step
from pagedlab.sim.simulator import PagedConfig, simulate_paged
from pagedlab.sim.traces import Request

METRICS = ("ttft", "tpot", "latency")


@dataclass(frozen=True)
class RequestTiming:
    """One request's arrival (seconds into the run) and what it waited, in seconds."""

    id: int
    arrival: float
    prompt_len: int
    output_len: int
    ttft: float  # arrival to first output token
    tpot: float  # mean gap between output tokens after the first (nan for one token)
    latency: float  # arrival to last output token


@dataclass(frozen=True)
class EngineSettings:
    """What a simulation must share with the engine it predicts: block size, cache sizes and
    the scheduler's limits."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    scheduler: SchedulerConfig

    @classmethod
    def of(cls, llm) -> EngineSettings:
        m = llm.manager
        return cls(m.block_size, m.num_gpu_blocks, m.cpu.num_blocks, llm.scheduler.config)

    def paged_config(self, cost) -> PagedConfig:
        """The simulator's configuration for these settings, swap space in ``cost``'s bytes."""
        block_bytes = self.block_size * cost.kv_bytes_per_token
        return PagedConfig(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks,
                           swap_space_gib=self.num_cpu_blocks * block_bytes / 2**30,
                           scheduler=self.scheduler)


@dataclass(frozen=True)
class Replay:
    """A timed run (or a predicted one): its requests, its steps, the engine's settings."""

    requests: list[RequestTiming]
    steps: list[StepTiming]
    settings: EngineSettings

    def metric(self, name: str) -> np.ndarray:
        """[requests] one of :data:`METRICS`, in request order."""
        return np.array([getattr(r, name) for r in self.requests])


def replay(llm, requests: list[Request], *, seed: int = 0,
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> Replay:
    """Serve ``requests`` on ``llm`` at their arrival times (seconds after the call).

    Each prompt is ``prompt_len`` token ids drawn from the model's vocabulary (seeded), and
    each request generates exactly ``output_len`` tokens (greedy, EOS ignored). Times are read
    from ``clock`` after every step, as a client would see them, not from the engine's own
    metrics: a :class:`~pagedlab.timing.CPUClock` (with its ``sleep``) times a run by the CPU
    time its steps cost, which a busy machine hardly changes. Give ``llm`` a fixed
    ``num_gpu_blocks``: a CPU engine's default cache grows with what each idle moment's
    request needs.
    """
    pending = sorted(requests, key=lambda r: (r.arrival, r.id))
    rng = np.random.default_rng(seed)
    vocab = llm.model.args.vocab_size
    prompts = {r.id: rng.integers(0, vocab, r.prompt_len).tolist() for r in pending}
    running, first, finish, steps, nxt = {}, {}, {}, [], 0
    origin = clock()
    while nxt < len(pending) or llm.has_unfinished_requests():
        now = clock() - origin
        if not llm.has_unfinished_requests() and pending[nxt].arrival > now:
            sleep(pending[nxt].arrival - now)
            continue
        while nxt < len(pending) and pending[nxt].arrival <= now:
            r = pending[nxt]
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            running[r.id] = llm.add_request(str(r.id), prompts[r.id], params)
            nxt += 1
        steps.append(timed_step(llm, origin, clock))
        end = steps[-1].start + steps[-1].duration
        for rid, group in list(running.items()):
            if rid not in first and any(s.output_token_ids for s in group.seqs):
                first[rid] = end
            if group.is_finished:
                if group.error is not None:
                    raise RuntimeError(f"request {rid} failed in the replay: {group.error}")
                finish[rid] = end
                del running[rid]
    timings = []
    for r in requests:
        tpot = (finish[r.id] - first[r.id]) / (r.output_len - 1) if r.output_len > 1 else math.nan
        timings.append(RequestTiming(r.id, r.arrival, r.prompt_len, r.output_len,
                                     first[r.id] - r.arrival, tpot, finish[r.id] - r.arrival))
    return Replay(timings, steps, EngineSettings.of(llm))


def predict(measured: Replay, cost) -> Replay:
    """The simulator's prediction of ``measured``: the same requests and arrivals, scheduler
    limits and cache, each step priced by ``cost``. Its steps are not recorded."""
    requests = [Request(r.id, r.arrival, r.prompt_len, r.output_len) for r in measured.requests]
    sim = simulate_paged(requests, cost, measured.settings.paged_config(cost))
    timings = []
    for r, first, finish in zip(requests, sim.first_token, sim.finish):
        tpot = (finish - first) / (r.output_len - 1) if r.output_len > 1 else math.nan
        timings.append(RequestTiming(r.id, r.arrival, r.prompt_len, r.output_len,
                                     first - r.arrival, tpot, finish - r.arrival))
    return Replay(timings, [], measured.settings)


def capacity(requests: list[Request], cost, settings: EngineSettings) -> float:
    """Requests per second the engine serves flat out, as the simulator predicts it: all of
    ``requests`` arriving at once, priced by ``cost``."""
    at_once = [replace(r, arrival=0.0) for r in requests]
    sim = simulate_paged(at_once, cost, settings.paged_config(cost))
    return len(requests) / float(sim.finish.max())


def percentiles(run: Replay, name: str) -> dict[str, float]:
    """Median and 90th percentile of one of :data:`METRICS` (one-token requests have no TPOT)."""
    values = run.metric(name)
    values = values[~np.isnan(values)]
    return {"median": float(np.median(values)), "p90": float(np.percentile(values, 90))}


def errors(measured: Replay, predicted: Replay) -> dict[str, dict[str, float]]:
    """Relative error (predicted / measured - 1) of each metric's median and p90."""
    out = {}
    for name in METRICS:
        m, p = percentiles(measured, name), percentiles(predicted, name)
        out[name] = {stat: p[stat] / m[stat] - 1 for stat in m}
    return out
