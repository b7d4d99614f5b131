"""A step-driven simulation of KV-cache memory over time, under a pluggable memory system.

Requests arrive (:mod:`pagedlab.sim.traces`) and queue; they are admitted first come, first
served while the memory system has room, which stores their prompt; at every step each
running request decodes one token, whose KV the memory system must store; a request that has
produced all its output tokens leaves and releases its memory. After each step the memory
system sorts its slots into the categories of
:class:`~pagedlab.memory.contiguous.MemoryBreakdown`, giving a time series and its
time-average (the paper's Fig. 2).

Contiguous systems reserve a request's whole region at admission, so decoding never runs
out. Paging allocates a block at a time and can: then the latest admitted request is
preempted (freed and put back at the head of the queue, to resume later with its prompt and
the tokens it had produced) and no one is admitted until a request finishes. This is a
memory-only stand-in for the engine's scheduler (chapter 6). Steps take a fixed time, or
the time a :class:`~pagedlab.sim.cost_model.CostModel` gives them: chapter 10 runs the Orca
and FasterTransformer baselines through this loop that way, with request-level batching for
the latter (a batch runs to its end before the next one is admitted), and the paged system
through the engine's own scheduler (:mod:`pagedlab.sim.simulator`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pagedlab._checks import check_positive
from pagedlab.memory import KVCacheManager
from pagedlab.memory.contiguous import (
    CATEGORIES,
    CATEGORY_INDEX,
    MemoryBreakdown,
    orca,
    static_max,
)
from pagedlab.sim.traces import Request

if TYPE_CHECKING:
    from pagedlab.sim.cost_model import CostModel

BATCHING = ("iteration", "request")


class KVMemory(Protocol):
    """What the simulation asks of a KV memory system (what hands out its slots); requests are
    named by their id."""

    name: str
    capacity: int  # token slots in the pool

    def can_admit(self, request: Request, num_tokens: int) -> bool: ...

    def admit(self, request: Request, num_tokens: int) -> None:
        """Take memory for ``request`` and store its first ``num_tokens`` tokens."""

    def can_append(self, request_id: int) -> bool: ...

    def append(self, request_id: int) -> None:
        """Store one more token of ``request_id``."""

    def free(self, request_id: int) -> None: ...

    def breakdown(self, waiting: Request | None = None) -> MemoryBreakdown:
        """The pool by category; ``waiting`` is the next request in line, if any."""


class PagedKV:
    """Paging (vLLM): blocks of ``block_size`` slots taken on demand from
    :class:`pagedlab.memory.KVCacheManager`.

    Its only waste is the unfilled tail of each sequence's last block (``rounding``). Nothing
    is reserved ahead, and any free block serves any request, so there is no external
    fragmentation.
    """

    def __init__(self, capacity: int, block_size: int = 16):
        check_positive("capacity", capacity, integer=True)
        check_positive("block_size", block_size, integer=True)
        if capacity % block_size:
            raise ValueError(f"capacity={capacity} must be a multiple of block_size={block_size}")
        self.name = f"Paging (block {block_size})"
        self.capacity, self.block_size = capacity, block_size
        self.manager = KVCacheManager(capacity // block_size, block_size)
        self._admitted: set[int] = set()  # ids of the requests holding blocks

    def can_admit(self, request: Request, num_tokens: int) -> bool:
        return self.manager.can_allocate(num_tokens)

    def admit(self, request: Request, num_tokens: int) -> None:
        self.manager.allocate(request.id, [0] * num_tokens)  # token ids: no prefix caching
        self._admitted.add(request.id)

    def can_append(self, request_id: int) -> bool:
        return self.manager.can_append(request_id)

    def append(self, request_id: int) -> None:
        self.manager.append(request_id, [0])

    def free(self, request_id: int) -> None:
        self.manager.free(request_id)
        self._admitted.remove(request_id)

    def breakdown(self, waiting: Request | None = None) -> MemoryBreakdown:
        usage = self.manager.usage()
        free = self.manager.num_free_blocks * self.block_size
        return MemoryBreakdown(usage.tokens_stored, 0, 0,
                               usage.slots_allocated - usage.tokens_stored, 0, free)

    def slot_map(self, waiting: Request | None = None) -> np.ndarray:
        """The category of every slot, as an index into ``CATEGORIES``: ``[capacity]`` int8."""
        bs = self.block_size
        slots = np.full(self.capacity, CATEGORY_INDEX["free"], dtype=np.int8)
        for request_id in self._admitted:
            n = self.manager.num_tokens(request_id)
            for i, block in enumerate(self.manager.block_table(request_id)):
                filled = min(bs, n - i * bs)  # the last block may be partly filled
                slots[block * bs:block * bs + filled] = CATEGORY_INDEX["tokens"]
                slots[block * bs + filled:(block + 1) * bs] = CATEGORY_INDEX["rounding"]
        return slots


# The KV memory systems by name: vLLM's paging, Orca reserving least (Oracle) to most (Max),
# FasterTransformer's static slots
SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")


def make_memory(name: str, capacity: int, max_seq_len: int, block_size: int = 16) -> KVMemory:
    """A fresh KV memory system by name (one of :data:`SYSTEMS`) over ``capacity``
    token slots."""
    if name == "static":
        return static_max(capacity, max_seq_len)
    if name.startswith("orca-") and name in SYSTEMS:
        return orca(capacity, name.removeprefix("orca-"), max_seq_len)
    if name == "paged":
        return PagedKV(capacity, block_size)
    raise ValueError(f"memory system name={name!r} must be one of {SYSTEMS}")


@dataclass(frozen=True)
class SimResult:
    """What a run recorded at the end of each step, and its counters."""

    system: str  # the memory system's name
    capacity: int  # token slots
    time: np.ndarray  # [steps] seconds at which each step began
    duration: np.ndarray  # [steps] seconds each step lasted
    slots: dict[str, np.ndarray]  # category of CATEGORIES -> [steps] slots
    running: np.ndarray  # [steps] requests that decoded a token in the step
    waiting: np.ndarray  # [steps] requests queued after it
    finished: int  # requests that produced all their output
    preemptions: int
    arrival: np.ndarray | None = None  # [requests] seconds, in the order they were given
    finish: np.ndarray | None = None  # [requests] seconds at which each produced its last token
    first_token: np.ndarray | None = None  # [requests] seconds of each one's first token (paging)
    output_len: np.ndarray | None = None  # [requests] tokens generated
    blocks_swapped: int = 0  # blocks moved between GPU and CPU, both ways (paging, swap mode)
    swap_seconds: float = 0.0  # of the total time, spent swapping over PCIe
    # [requests] seconds at the end of each step that gave the request tokens (paging, when
    # PagedConfig.record_token_times): what a streaming client would see as its chunks
    token_times: list[list[float]] | None = None

    @property
    def normalized_latency(self) -> float:
        """The paper's metric (Fig. 12): mean over requests of end-to-end latency divided by
        output length, in seconds per token."""
        return float(np.mean((self.finish - self.arrival) / self.output_len))

    @property
    def throughput(self) -> float:
        """Requests finished per second, from the first arrival to the last completion."""
        return len(self.finish) / float(self.finish.max() - self.arrival.min())

    @property
    def tokens_per_second(self) -> float:
        """Output tokens generated per second, over the same span as :attr:`throughput`."""
        return float(self.output_len.sum()) / float(self.finish.max() - self.arrival.min())

    @property
    def utilization(self) -> np.ndarray:
        """[steps] share of the pool holding token states after each step."""
        return self.slots["tokens"] / self.capacity

    @property
    def mean_batch(self) -> float:
        """Time-averaged number of running requests."""
        return float(np.average(self.running, weights=self.duration))

    def mean_shares(self, saturated: bool = True) -> dict[str, float]:
        """Time-averaged share of the pool in each category, plus ``internal``.

        ``saturated`` averages only over the steps after which a request was waiting: the
        memory was then the limit, as in the paper's measurement. Otherwise over all steps
        (free memory while the queue is empty is idle capacity, not waste).
        """
        mask = self.waiting > 0 if saturated else np.ones_like(self.waiting, dtype=bool)
        if not mask.any():
            raise ValueError(f"{self.system}: no step had a waiting request; the load never "
                             f"saturated memory (use saturated=False)")
        weights = self.duration[mask]
        shares = {c: float(np.average(self.slots[c][mask], weights=weights)) / self.capacity
                  for c in CATEGORIES}
        shares["internal"] = shares["overreservation"] + shares["rounding"]
        return shares


def simulate(
    requests: list[Request],
    memory: KVMemory,
    *,
    step_seconds: float | None = None,
    cost: CostModel | None = None,
    batching: str = "iteration",
) -> SimResult:
    """Serve ``requests`` with ``memory`` holding their KV, one step at a time.

    A step lasts ``step_seconds``, or what ``cost`` says a step with its prefills and decodes
    takes on a GPU (give exactly one). ``batching="iteration"`` admits requests at every step
    (Orca); ``"request"`` only when no request is running, so that a batch runs until its
    longest request ends (FasterTransformer behind a dynamic batcher). Idle stretches (nothing
    running or waiting) are skipped, not recorded. Raises if a request can never fit (it
    alone needs more than the pool).
    """
    if (step_seconds is None) == (cost is None):
        raise ValueError("give exactly one of step_seconds and cost")
    if step_seconds is not None:
        check_positive("step_seconds", step_seconds)
    if batching not in BATCHING:
        raise ValueError(f"batching={batching!r} must be one of {BATCHING}")
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"request id {duplicate} appears more than once")
    pending = deque(sorted(requests, key=lambda r: (r.arrival, r.id)))
    waiting: deque[Request] = deque()
    running: list[Request] = []  # in admission order
    generated = dict.fromkeys(ids, 0)  # request id -> output tokens produced so far
    finish: dict[int, float] = {}  # request id -> when it produced its last token
    record: list[tuple] = []  # per step: (time, breakdown, running, waiting, duration)
    now, finished, preemptions, memory_full = 0.0, 0, 0, False

    while pending or waiting or running:
        if not (running or waiting):
            now = max(now, pending[0].arrival)  # skip the idle gap
        while pending and pending[0].arrival <= now:
            waiting.append(pending.popleft())
        prefills = {}  # id -> tokens each request admitted in this step stores (its prompt)
        admitting = not memory_full and (batching == "iteration" or not running)
        while admitting and waiting:  # FCFS admission while memory allows
            r = waiting[0]
            stored = r.prompt_len + generated[r.id]  # a preempted request resumes where it was
            if not memory.can_admit(r, stored):
                break
            memory.admit(waiting.popleft(), stored)
            running.append(r)
            prefills[r.id] = stored
        if not running:
            r = waiting[0]
            raise RuntimeError(f"request {r.id} (prompt_len={r.prompt_len}, output_len="
                               f"{r.output_len}) does not fit in {memory.name}'s "
                               f"{memory.capacity} slots even alone")

        i = 0
        while i < len(running):  # each running request decodes one token
            r = running[i]
            while not memory.can_append(r.id):  # paging only: preempt the latest request
                victim = running.pop()
                memory.free(victim.id)
                waiting.appendleft(victim)
                preemptions += 1
                memory_full = True
                if victim is r:
                    break
            else:
                memory.append(r.id)
                generated[r.id] += 1
                i += 1
        if cost is None:
            duration = step_seconds
        else:  # requests admitted in this step prefill; the others decode one token
            duration = cost.step_time(
                [prefills[r.id] for r in running if r.id in prefills],
                [r.prompt_len + generated[r.id] for r in running if r.id not in prefills])
        record.append((now, memory.breakdown(waiting[0] if waiting else None),
                       len(running), len(waiting), duration))

        now += duration
        still_running = []
        for r in running:
            if generated[r.id] == r.output_len:
                memory.free(r.id)
                finish[r.id] = now
                finished += 1
                memory_full = False
            else:
                still_running.append(r)
        running = still_running

    breakdowns = [b for _, b, _, _, _ in record]
    return SimResult(
        system=memory.name,
        capacity=memory.capacity,
        time=np.array([t for t, _, _, _, _ in record]),
        duration=np.array([d for _, _, _, _, d in record], dtype=float),
        slots={c: np.array([getattr(b, c) for b in breakdowns]) for c in CATEGORIES},
        running=np.array([n for _, _, n, _, _ in record]),
        waiting=np.array([w for _, _, _, w, _ in record]),
        finished=finished,
        preemptions=preemptions,
        arrival=np.array([r.arrival for r in requests], dtype=float),
        finish=np.array([finish[r.id] for r in requests]),
        output_len=np.array([r.output_len for r in requests]),
    )
