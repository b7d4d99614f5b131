"""A serving simulator: the engine's scheduler and KV-cache manager, a cost model for a GPU.

The paged system runs the very :class:`~pagedlab.engine.Scheduler` and
:class:`~pagedlab.memory.KVCacheManager` that the engine runs (chapter 8). Only the executor
differs: where :class:`~pagedlab.engine.ModelRunner` runs a model, :class:`SimExecutor` asks a
:class:`~pagedlab.sim.cost_model.CostModel` how long the step would take and hands back
placeholder tokens. Each request asks for exactly its trace's output length (``max_tokens``;
the scheduler knows no end-of-sequence token, which only the ``LLM`` adds to a request's stop
tokens), so the trace, not a model, decides when it stops.

The baselines (FasterTransformer's static batching, Orca's Max / Pow2 / Oracle reservation)
reserve contiguous regions, which the paged manager cannot express; they run through the
step loop of :mod:`pagedlab.sim.memory_sim` with the same cost model. :func:`simulate_system`
serves one trace under any of the memory systems
:data:`~pagedlab.sim.memory_sim.SYSTEMS` names; :func:`sweep` runs rates in parallel
processes; :func:`knee_rate` finds where normalised latency crosses a threshold (the paper's
Fig. 12).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from pagedlab._checks import check_positive
from pagedlab.engine.params import SamplingParams
from pagedlab.engine.scheduler import Scheduler, SchedulerConfig
from pagedlab.engine.speculative import Drafter, NgramProposer
from pagedlab.engine.step import Placeholders, Step, StepOutput, run_step
from pagedlab.memory import KVCacheManager
from pagedlab.memory.contiguous import CATEGORIES
from pagedlab.sim.calibration import step_shape
from pagedlab.sim.cost_model import CostModel
from pagedlab.sim.memory_sim import SYSTEMS, SimResult, make_memory, simulate
from pagedlab.sim.traces import Request, clip_to_context, synthetic_requests

SYSTEM_NAMES = {"paged": "vLLM (paging)", "orca-oracle": "Orca (Oracle)",
                "orca-pow2": "Orca (Pow2)", "orca-max": "Orca (Max)",
                "static": "FasterTransformer"}
TOKEN = 0  # the placeholder every simulated step "samples"


class SimExecutor:
    """Stands where the model runner stands: a step's time from the cost model, and one
    placeholder token per sequence (``n`` of them for a parallel-sampling prompt).

    With speculative decoding, a verification step is priced as its chunks are (the pending
    token and ``k`` proposals per sequence, attended like a prefill chunk), and each proposal
    is accepted with probability ``acceptance_rate``, independently, until the first
    rejection (the model behind Leviathan et al.'s expected speed-up). A draft model's
    proposals cost ``draft_cost`` of a target decode step over the same sequences, once per
    proposal (its ``c``; 0 for n-gram lookup, whose host work the cost model leaves out)."""

    def __init__(self, cost: CostModel, block_size: int, acceptance_rate: float = 0.0,
                 seed: int = 0, draft_cost: float = 0.0):
        check_positive("draft_cost", draft_cost, allow_zero=True)
        self.cost, self.block_size = cost, block_size
        self.placeholders = Placeholders(TOKEN)
        self.acceptance_rate, self.rng = acceptance_rate, np.random.default_rng(seed)
        self.draft_cost = draft_cost

    def execute(self, step: Step) -> StepOutput:
        """What ``step`` costs and produces."""
        shape = step_shape(step)
        seconds = self.cost.step_time(shape.prefill_lens, shape.decode_lens, self.block_size,
                                      prefill_starts=shape.prefill_starts)
        moved = len(step.swap_out) + len(step.swap_in)
        swap = self.cost.swap_time(moved, self.block_size) if moved else 0.0
        outputs = self.placeholders.outputs(step)
        if step.num_draft_tokens:
            drafts = {c.seq.seq_id: len(c.draft) for c in step.decodes if c.draft}
            if self.draft_cost:  # a draft pass per proposal, over the sequences it drafts for
                contexts = [c.start + 1 for c in step.decodes if c.draft]
                seconds += self.draft_cost * max(drafts.values()) * self.cost.step_time(
                    [], contexts, self.block_size)
            for child in (c for out in outputs for c in out.children):
                k = drafts.get(child.parent.seq_id, 0)
                accepted = int(np.argmin(np.append(self.rng.random(k) < self.acceptance_rate,
                                                   False)))  # leading acceptances
                child.accepted = [(TOKEN, 0.0, None)] * accepted
        return StepOutput(outputs, seconds, swap)


@dataclass(frozen=True)
class PagedConfig:
    """The paged system's knobs: block size, memory and the scheduler's limits (vLLM's)."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space_gib: float = 4.0  # CPU swap space, vLLM's default
    num_gpu_blocks: int | None = None  # None: what the GPU holds once the weights are loaded
    scheduler: SchedulerConfig = SchedulerConfig()
    n: int = 1  # parallel samples per request
    acceptance_rate: float = 0.0  # of each speculative proposal (scheduler.speculative_config)
    draft_cost: float = 0.0  # a draft model's pass over a target decode step's (n-gram: 0)
    record_token_times: bool = False  # keep when each step gave each request tokens


def _drafter(config: SchedulerConfig) -> Drafter | None:
    """n-gram lookup over the placeholder tokens (it always finds a match, so every decode
    carries its proposals; ``acceptance_rate`` decides how many verify)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method != "ngram":
        raise ValueError(f"the simulator proposes by n-gram lookup, not {spec.method!r}: "
                         "price a draft model with PagedConfig.draft_cost")
    return Drafter(NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max),
                   spec.num_speculative_tokens)


def simulate_paged(
    requests: list[Request],
    cost: CostModel,
    config: PagedConfig = PagedConfig(),
    scheduler_class: Callable[..., Scheduler] = Scheduler,
) -> SimResult:
    """Serve ``requests`` with the engine's scheduler over a paged cache sized for ``cost``'s
    model and GPU. Another order of service goes in ``config.scheduler.policy``;
    ``scheduler_class`` may be a subclass that records or checks what the scheduler does.
    """
    bs = config.block_size
    check_positive("block_size", bs, integer=True)
    num_gpu_blocks = (config.num_gpu_blocks
                      or cost.kv_capacity_tokens(config.gpu_memory_utilization) // bs)
    block_bytes = bs * cost.kv_bytes_per_token
    manager = KVCacheManager(num_gpu_blocks, bs, int(config.swap_space_gib * 2**30 // block_bytes))
    sched_config = config.scheduler
    if sched_config.max_model_len is None and cost.max_context:
        sched_config = replace(sched_config, max_model_len=cost.max_context)
    scheduler = scheduler_class(manager, sched_config)
    drafter = _drafter(sched_config)
    executor = SimExecutor(cost, bs, config.acceptance_rate, draft_cost=config.draft_cost)
    params = {r.id: SamplingParams(n=config.n, max_tokens=r.output_len)
              for r in requests}
    pending = sorted(requests, key=lambda r: (r.arrival, r.id))
    first, finish = {}, {}  # request id -> seconds of its first and last token
    token_times = {r.id: [] for r in requests} if config.record_token_times else None
    times, durations, batch, waiting, used, stored = [], [], [], [], [], []
    now, nxt, preemptions, swapped, swap_seconds = 0.0, 0, 0, 0, 0.0

    def observe(step, ran):
        """The step as it ran, before its tokens are applied."""
        nonlocal swapped, swap_seconds, preemptions
        swapped += len(step.swap_out) + len(step.swap_in)
        swap_seconds += ran.swap_seconds
        preemptions += len(step.preempted)
        times.append(now)
        durations.append(ran.seconds + ran.swap_seconds)
        batch.append(len(step.groups))
        waiting.append(len(scheduler.waiting) + len(scheduler.swapped))
        used.append(manager.num_used_blocks)
        # from the manager, not the step: a shared block counts once, and a prompt part-way
        # through its prefill keeps its tokens in a step that gives it no chunk
        stored.append(manager.usage().tokens_stored)

    while nxt < len(pending) or scheduler.has_unfinished:
        if not scheduler.has_unfinished:
            now = max(now, pending[nxt].arrival)  # skip the idle gap
        while nxt < len(pending) and pending[nxt].arrival <= now:
            r = pending[nxt]
            scheduler.add_request(r.id, [TOKEN] * r.prompt_len, params[r.id])
            nxt += 1
        step, ran, finished = run_step(scheduler, executor, observe, drafter)
        now += ran.seconds + ran.swap_seconds  # the copies run before the forward pass
        for group in step.sampled_groups:
            first.setdefault(group.request_id, now)
            if token_times is not None:
                token_times[group.request_id].append(now)
        for group in finished:
            finish[group.request_id] = now

    capacity = num_gpu_blocks * bs
    used_slots, tokens = np.array(used) * bs, np.array(stored)
    zeros = np.zeros(len(times), dtype=np.int64)
    slots = dict.fromkeys(CATEGORIES, zeros) | {
        "tokens": tokens, "rounding": used_slots - tokens, "free": capacity - used_slots}
    return SimResult(
        system=f"Paging (block {bs})",
        capacity=capacity,
        time=np.array(times),
        duration=np.array(durations),
        slots=slots,
        running=np.array(batch),
        waiting=np.array(waiting),
        finished=len(finish),
        preemptions=preemptions,
        arrival=np.array([r.arrival for r in requests], dtype=float),
        finish=np.array([finish[r.id] for r in requests]),
        first_token=np.array([first[r.id] for r in requests]),
        output_len=np.array([r.output_len * config.n for r in requests]),
        blocks_swapped=swapped,
        token_times=None if token_times is None else [token_times[r.id] for r in requests],
        swap_seconds=swap_seconds,
    )


def simulate_system(system: str, requests: list[Request], cost: CostModel, **paged) -> SimResult:
    """Serve ``requests`` under ``system`` (one of
    :data:`~pagedlab.sim.memory_sim.SYSTEMS`) on ``cost``'s GPU.

    Requests are clipped to the model's context. ``paged`` holds :class:`PagedConfig` fields
    for the paged system; the baselines share its ``gpu_memory_utilization``.
    """
    max_len = cost.max_context or 2048
    requests = clip_to_context(requests, max_len)
    config = PagedConfig(**paged)
    if system == "paged":
        return simulate_paged(requests, cost, config)
    if system not in SYSTEMS:
        raise ValueError(f"system={system!r} must be one of {SYSTEMS}")
    capacity = cost.kv_capacity_tokens(config.gpu_memory_utilization)
    memory = make_memory(system, capacity, max_len)
    return simulate(requests, memory, cost=cost,
                    batching="request" if system == "static" else "iteration")


@dataclass(frozen=True)
class Point:
    """One run of a sweep: a system at a request rate, and what it measured."""

    system: str
    rate: float
    config: dict  # the PagedConfig fields this run set
    normalized_latency: float
    throughput: float
    mean_batch: float
    preemptions: int


def _point(args) -> Point:
    system, dataset, rate, num_requests, seed, cost, paged = args
    requests = synthetic_requests(dataset, num_requests, rate=rate, seed=seed)
    res = simulate_system(system, requests, cost, **paged)
    return Point(system, rate, paged, res.normalized_latency, res.throughput, res.mean_batch,
                 res.preemptions)


def sweep(
    systems: Sequence[str],
    dataset: str,
    rates: Sequence[float],
    cost: CostModel,
    *,
    duration: float = 600.0,
    min_requests: int = 100,
    seed: int = 0,
    workers: int = 1,
    progress: bool = False,
    configs: Sequence[dict] = ({},),
) -> list[Point]:
    """Each system at each Poisson ``rate`` on synthetic ``dataset`` requests arriving for
    ``duration`` seconds (at least ``min_requests``; one seed, so the same lengths in the same
    order at every rate), once per entry of ``configs`` (:class:`PagedConfig` fields, as for
    :func:`simulate_system`). ``workers > 1`` runs the points in parallel processes.

    Past its capacity a system's queue grows for as long as requests keep coming, so the
    latency at a rate, and the knee, depend on ``duration``: the paper's traces last an hour.
    """
    check_positive("duration", duration)
    jobs = [(s, dataset, float(r), max(min_requests, round(r * duration)), seed, cost, paged)
            for s in systems for paged in configs for r in rates]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = pool.map(_point, jobs)
            points = list(_progress(results, len(jobs), progress))
    else:
        points = list(_progress(map(_point, jobs), len(jobs), progress))
    return points


def _progress(iterable, total: int, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc="simulated runs", unit="run")


def knee_rate(rates: Sequence[float], latencies: Sequence[float], threshold: float = 1.0) -> float:
    """The request rate at which normalised latency first passes ``threshold`` (s/token),
    interpolated linearly between the sweep's rates; ``inf`` if it never does."""
    for i, (rate, lat) in enumerate(zip(rates, latencies)):
        if lat > threshold:
            if i == 0:
                return float(rate)
            r0, l0 = rates[i - 1], latencies[i - 1]
            return float(r0 + (threshold - l0) * (rate - r0) / (lat - l0))
    return math.inf


def knee_rates(points: list[Point], threshold: float = 1.0) -> dict[str, float]:
    """:func:`knee_rate` of each system in a :func:`sweep`."""
    knees = {}
    for system in dict.fromkeys(p.system for p in points):
        mine = sorted((p.rate, p.normalized_latency) for p in points if p.system == system)
        knees[system] = knee_rate(*zip(*mine), threshold=threshold)
    return knees


def with_rate(requests: list[Request], scale: float) -> list[Request]:
    """A trace replayed ``scale`` times faster: arrivals divided by ``scale``."""
    check_positive("scale", scale)
    return [replace(r, arrival=r.arrival / scale) for r in requests]
