"""A step-driven simulation of KV-cache memory over time, under a pluggable allocation policy.

Requests arrive (:mod:`pagedlab.sim.traces`) and queue; they are admitted first come, first
served while the policy has room, which stores their prompt; at every step each running
request decodes one token, whose KV the policy must store; a request that has produced all
its output tokens leaves and releases its memory. After each step the policy sorts its slots
into the categories of :class:`~pagedlab.memory.contiguous.MemoryBreakdown`, giving a time
series and its time-average (the paper's Fig. 2).

Contiguous policies reserve a request's whole region at admission, so decoding never runs
out. Paging allocates a block at a time and can: then the latest admitted request is
preempted (freed and put back at the head of the queue, to resume later with its prompt and
the tokens it had produced) and no one is admitted until a request finishes. This is a
memory-only stand-in for the engine's scheduler (chapter 6); steps take a fixed time here,
where the simulator of chapter 9 uses a GPU cost model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

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


class KVPolicy(Protocol):
    """What the simulation asks of a KV memory policy; requests are named by their id."""

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


POLICIES = ("static", "orca-max", "orca-pow2", "orca-oracle", "paged")


def make_policy(name: str, capacity: int, max_seq_len: int, block_size: int = 16) -> KVPolicy:
    """A fresh policy by name (one of :data:`POLICIES`) over ``capacity`` token slots."""
    if name == "static":
        return static_max(capacity, max_seq_len)
    if name.startswith("orca-") and name in POLICIES:
        return orca(capacity, name.removeprefix("orca-"), max_seq_len)
    if name == "paged":
        return PagedKV(capacity, block_size)
    raise ValueError(f"policy name={name!r} must be one of {POLICIES}")


@dataclass(frozen=True)
class SimResult:
    """What a run recorded at the end of each step, and its counters."""

    policy: str
    capacity: int  # token slots
    time: np.ndarray  # [steps] seconds at which each step began
    duration: np.ndarray  # [steps] seconds each step lasted
    slots: dict[str, np.ndarray]  # category of CATEGORIES -> [steps] slots
    running: np.ndarray  # [steps] requests that decoded a token in the step
    waiting: np.ndarray  # [steps] requests queued after it
    finished: int  # requests that produced all their output
    preemptions: int

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
            raise ValueError(f"{self.policy}: no step had a waiting request; the load never "
                             f"saturated memory (use saturated=False)")
        weights = self.duration[mask]
        shares = {c: float(np.average(self.slots[c][mask], weights=weights)) / self.capacity
                  for c in CATEGORIES}
        shares["internal"] = shares["overreservation"] + shares["rounding"]
        return shares


def simulate(requests: list[Request], policy: KVPolicy, *, step_seconds: float) -> SimResult:
    """Serve ``requests`` under ``policy``, one decode step of ``step_seconds`` at a time.

    Idle stretches (nothing running or waiting) are skipped, not recorded. Raises if a
    request can never fit (it alone needs more than the pool).
    """
    check_positive("step_seconds", step_seconds)
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"request id {duplicate} appears more than once")
    pending = deque(sorted(requests, key=lambda r: (r.arrival, r.id)))
    waiting: deque[Request] = deque()
    running: list[Request] = []  # in admission order
    generated = dict.fromkeys(ids, 0)  # request id -> output tokens produced so far
    record: list[tuple] = []  # per step: (time, breakdown, running, waiting)
    now, finished, preemptions, memory_full = 0.0, 0, 0, False

    while pending or waiting or running:
        if not (running or waiting):
            now = max(now, pending[0].arrival)  # skip the idle gap
        while pending and pending[0].arrival <= now:
            waiting.append(pending.popleft())
        while not memory_full and waiting:  # FCFS admission while memory allows
            r = waiting[0]
            stored = r.prompt_len + generated[r.id]  # a preempted request resumes where it was
            if not policy.can_admit(r, stored):
                break
            policy.admit(waiting.popleft(), stored)
            running.append(r)
        if not running:
            r = waiting[0]
            raise RuntimeError(f"request {r.id} (prompt_len={r.prompt_len}, output_len="
                               f"{r.output_len}) does not fit in {policy.name}'s "
                               f"{policy.capacity} slots even alone")

        i = 0
        while i < len(running):  # each running request decodes one token
            r = running[i]
            while not policy.can_append(r.id):  # paging only: preempt the latest request
                victim = running.pop()
                policy.free(victim.id)
                waiting.appendleft(victim)
                preemptions += 1
                memory_full = True
                if victim is r:
                    break
            else:
                policy.append(r.id)
                generated[r.id] += 1
                i += 1
        record.append((now, policy.breakdown(waiting[0] if waiting else None),
                       len(running), len(waiting)))

        still_running = []
        for r in running:
            if generated[r.id] == r.output_len:
                policy.free(r.id)
                finished += 1
                memory_full = False
            else:
                still_running.append(r)
        running = still_running
        now += step_seconds

    breakdowns = [b for _, b, _, _ in record]
    return SimResult(
        policy=policy.name,
        capacity=policy.capacity,
        time=np.array([t for t, _, _, _ in record]),
        duration=np.full(len(record), float(step_seconds)),
        slots={c: np.array([getattr(b, c) for b in breakdowns]) for c in CATEGORIES},
        running=np.array([n for _, _, n, _ in record]),
        waiting=np.array([w for _, _, _, w in record]),
        finished=finished,
        preemptions=preemptions,
    )
