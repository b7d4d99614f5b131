"""Contiguous KV allocation, the baseline PagedAttention replaces, and the memory it wastes.

Before paging, a serving system kept each request's KV cache in one contiguous region of a
pool of ``capacity`` token slots, reserved when the request was admitted and never grown:
the attention kernel then reads a plain ``[seq_len, ...]`` array. Because a request's final
length is unknown at admission, the region is sized by a *reservation rule* and placed by an
*allocator*:

- static preallocation (FasterTransformer-style): the pool is cut once into equal slots of
  ``max_seq_len`` tokens, one per request (:class:`FixedSlots`, rule ``"max"``);
- Orca (Yu et al., OSDI 2022), as the PagedAttention paper models it (§6.1): reserve the
  model's maximum length (``"max"``), the prompt plus the output length rounded up to a power
  of two (``"pow2"``: "over-reserves the space for outputs by at most 2x"), or exactly the
  prompt plus the true output length (``"oracle"``); the region is placed by a buddy
  allocator (:class:`BuddyAllocator`).

:class:`MemoryBreakdown` sorts every slot of the pool into the categories of the paper's
Fig. 2; chapter 2 measures them over time with :mod:`pagedlab.sim.memory_sim`.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import numpy as np

from pagedlab._checks import check_positive

CATEGORIES = ("tokens", "reservation", "overreservation", "rounding", "external", "free")
CATEGORY_INDEX = {c: i for i, c in enumerate(CATEGORIES)}  # the codes of slot maps


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where every slot of a KV pool goes at one instant; the fields sum to the capacity.

    - ``tokens``: slots holding a token's KV now.
    - ``reservation``: slots reserved for tokens a request has not generated yet but will
      (its final length minus its current length). Idle now, used later.
    - ``overreservation``: slots reserved beyond a request's final length: never used.
    - ``rounding``: slots an allocator handed out beyond what was asked for (a buddy block's
      power-of-two rounding, the rest of a fixed slot, the unfilled tail of a sequence's last
      page). ``overreservation + rounding`` is the internal fragmentation.
    - ``external``: free slots in extents too small for the region the next waiting request
      needs (zero when no request waits): free, yet unusable for it.
    - ``free``: the other free slots.
    """

    tokens: int
    reservation: int
    overreservation: int
    rounding: int
    external: int
    free: int

    @property
    def internal(self) -> int:
        """Internal fragmentation: slots inside allocated regions that will never hold a token."""
        return self.overreservation + self.rounding

    @property
    def capacity(self) -> int:
        return sum(astuple(self))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class OutOfSlots(RuntimeError):
    """No free region is large enough for an allocation."""


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (n >= 1)."""
    return 1 << (n - 1).bit_length()


class BuddyAllocator:
    """Buddy allocation over ``capacity`` slots: blocks are powers of two, split in halves on
    demand and merged with their buddy (the other half of their parent) when both are free.

    A capacity that is not a power of two is split into power-of-two roots, largest first (its
    binary digits): blocks never merge across roots. Allocation takes the smallest free block
    that fits, lowest offset first.
    """

    def __init__(self, capacity: int):
        check_positive("capacity", capacity, integer=True)
        self.capacity = capacity
        self._free: dict[int, set[int]] = {}  # block size -> offsets of free blocks of that size
        self._used: dict[int, int] = {}  # offset -> size of each allocated block
        offset = 0
        for bit in reversed(range(capacity.bit_length())):
            if capacity >> bit & 1:
                self._free.setdefault(1 << bit, set()).add(offset)
                offset += 1 << bit
        self.num_used = 0  # slots in allocated blocks

    @property
    def num_free(self) -> int:
        return self.capacity - self.num_used

    def block_size(self, size: int) -> int:
        """Slots an allocation of ``size`` occupies: the next power of two."""
        check_positive("size", size, integer=True)
        return next_pow2(size)

    def can_allocate(self, size: int) -> bool:
        need = self.block_size(size)
        return any(offsets for s, offsets in self._free.items() if s >= need)

    def allocate(self, size: int) -> int:
        """Place ``size`` slots; return the offset of the block that holds them."""
        need = self.block_size(size)
        fits = [s for s, offsets in self._free.items() if s >= need and offsets]
        if not fits:
            largest = max((s for s, o in self._free.items() if o), default=0)
            raise OutOfSlots(f"allocate(size={size}): no free block of {need} slots "
                             f"(largest free block: {largest} of {self.num_free} free slots)")
        s = min(fits)
        offset = min(self._free[s])
        self._free[s].remove(offset)
        while s > need:  # keep the lower half, free the upper half (its buddy)
            s //= 2
            self._free.setdefault(s, set()).add(offset + s)
        self._used[offset] = need
        self.num_used += need
        return offset

    def free(self, offset: int) -> None:
        """Free the block at ``offset`` and merge it with its buddy as long as the buddy is free."""
        if offset not in self._used:
            raise ValueError(f"free(offset={offset!r}): no allocated block starts there "
                             f"(double free, or an offset allocate() did not return)")
        size = self._used.pop(offset)
        self.num_used -= size
        # No merge crosses a root, with no bound needed: the roots lie largest first, so a
        # root's offset is a multiple of twice its size and its buddy's offset is the next,
        # smaller root's (or the pool's end), where no block of its size can ever be.
        while (offset ^ size) in self._free.get(size, ()):
            self._free[size].remove(offset ^ size)
            offset, size = min(offset, offset ^ size), 2 * size
        self._free.setdefault(size, set()).add(offset)

    def free_extents(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free block, by offset."""
        return sorted((o, s) for s, offsets in self._free.items() for o in offsets)

    def used_blocks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every allocated block, by offset."""
        return sorted(self._used.items())


class FixedSlots:
    """Static preallocation: the pool cut once into ``capacity // slot_size`` equal slots.

    Any allocation up to ``slot_size`` takes a whole slot, lowest offset first; the
    ``capacity % slot_size`` slots past the last full slot can never be allocated.
    """

    def __init__(self, capacity: int, slot_size: int):
        check_positive("capacity", capacity, integer=True)
        check_positive("slot_size", slot_size, integer=True)
        self.capacity, self.slot_size = capacity, slot_size
        self._free = set(range(0, capacity - slot_size + 1, slot_size))  # offsets of free slots
        self._used: set[int] = set()
        self.num_used = 0

    @property
    def num_free(self) -> int:
        return self.capacity - self.num_used

    def block_size(self, size: int) -> int:
        check_positive("size", size, integer=True)
        if size > self.slot_size:
            raise ValueError(f"size={size} exceeds slot_size={self.slot_size}")
        return self.slot_size

    def can_allocate(self, size: int) -> bool:
        return size <= self.slot_size and bool(self._free)

    def allocate(self, size: int) -> int:
        self.block_size(size)  # checks size
        if not self._free:
            raise OutOfSlots(f"allocate(size={size}): all {len(self._used)} slots are taken")
        offset = min(self._free)
        self._free.remove(offset)
        self._used.add(offset)
        self.num_used += self.slot_size
        return offset

    def free(self, offset: int) -> None:
        if offset not in self._used:
            raise ValueError(f"free(offset={offset!r}): no allocated slot starts there "
                             f"(double free, or an offset allocate() did not return)")
        self._used.remove(offset)
        self._free.add(offset)
        self.num_used -= self.slot_size

    def free_extents(self) -> list[tuple[int, int]]:
        """Free slots, and the tail past the last full slot, as ``(offset, size)``."""
        tail = self.capacity % self.slot_size
        extents = [(o, self.slot_size) for o in sorted(self._free)]
        return extents + ([(self.capacity - tail, tail)] if tail else [])

    def used_blocks(self) -> list[tuple[int, int]]:
        return [(o, self.slot_size) for o in sorted(self._used)]


# Reservation rules: slots reserved at admission for (prompt_len, output_len, max_seq_len).
RESERVATIONS = {
    "max": lambda prompt, output, max_len: max_len,
    "pow2": lambda prompt, output, max_len: min(prompt + next_pow2(output), max_len),
    "oracle": lambda prompt, output, max_len: prompt + output,
}


@dataclass
class _Region:
    """One admitted request's contiguous region, in slots."""

    offset: int
    block: int  # slots the allocator handed out
    reserved: int  # slots the reservation rule asked for
    final: int  # prompt + output: the length the request will reach
    tokens: int  # slots holding KV now


class ContiguousKV:
    """KV memory where each request holds one contiguous region, sized at admission.

    ``reserve`` names a rule of :data:`RESERVATIONS`; ``allocator`` is a
    :class:`BuddyAllocator` or :class:`FixedSlots` over the pool. Requests are any objects with
    ``id``, ``prompt_len`` and ``output_len`` (:class:`pagedlab.sim.traces.Request`). Requests
    longer than ``max_seq_len`` are refused: the model could not run them.
    """

    def __init__(self, allocator, reserve: str, max_seq_len: int, name: str | None = None):
        if reserve not in RESERVATIONS:
            raise ValueError(f"reserve={reserve!r} must be one of {tuple(RESERVATIONS)}")
        check_positive("max_seq_len", max_seq_len, integer=True)
        self.allocator, self.reserve, self.max_seq_len = allocator, reserve, max_seq_len
        self.name = name or f"{type(allocator).__name__} ({reserve})"
        self.capacity: int = allocator.capacity
        self._regions: dict[int, _Region] = {}  # request id -> its region

    def reservation_for(self, request) -> int:
        """Slots the reservation rule reserves for ``request``."""
        final = request.prompt_len + request.output_len
        if final > self.max_seq_len:
            raise ValueError(f"request {request.id}: prompt_len + output_len = {final} exceeds "
                             f"max_seq_len={self.max_seq_len}")
        return RESERVATIONS[self.reserve](request.prompt_len, request.output_len, self.max_seq_len)

    def can_admit(self, request, num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.reservation_for(request))

    def admit(self, request, num_tokens: int) -> None:
        """Reserve ``request``'s region and store its first ``num_tokens`` tokens (the prompt)."""
        if request.id in self._regions:
            raise ValueError(f"request {request.id} is already admitted")
        reserved = self.reservation_for(request)
        final = request.prompt_len + request.output_len
        if not 0 < num_tokens <= final:
            raise ValueError(f"request {request.id}: num_tokens={num_tokens} must lie in "
                             f"[1, {final}] (prompt_len + output_len)")
        offset = self.allocator.allocate(reserved)
        block = self.allocator.block_size(reserved)
        self._regions[request.id] = _Region(offset, block, reserved, final, num_tokens)

    def _region(self, request_id) -> _Region:
        if request_id not in self._regions:
            raise KeyError(f"request {request_id} is not admitted")
        return self._regions[request_id]

    def can_append(self, request_id) -> bool:
        """True until the request reaches its final length: its region covers that much."""
        region = self._region(request_id)
        return region.tokens < region.final

    def append(self, request_id) -> None:
        """Store one more token of ``request_id`` inside its region."""
        region = self._region(request_id)
        if region.tokens >= region.final:
            raise ValueError(f"request {request_id}: token {region.tokens + 1} is past its "
                             f"final length {region.final} (prompt_len + output_len)")
        region.tokens += 1

    def free(self, request_id) -> None:
        self.allocator.free(self._region(request_id).offset)
        del self._regions[request_id]

    def _need(self, waiting) -> int | None:
        """Slots the next request's region would occupy; None when no request waits."""
        return None if waiting is None else self.allocator.block_size(self.reservation_for(waiting))

    def breakdown(self, waiting=None) -> MemoryBreakdown:
        """The pool's slots by category; ``waiting`` is the next request in line, if any."""
        regions = self._regions.values()
        need = self._need(waiting)
        external = sum(s for _, s in self.allocator.free_extents() if need is not None and s < need)
        return MemoryBreakdown(
            tokens=sum(r.tokens for r in regions),
            reservation=sum(r.final - r.tokens for r in regions),
            overreservation=sum(r.reserved - r.final for r in regions),
            rounding=sum(r.block - r.reserved for r in regions),
            external=external,
            free=self.allocator.num_free - external,
        )

    def slot_map(self, waiting=None) -> np.ndarray:
        """The category of every slot, as an index into :data:`CATEGORIES`: ``[capacity]`` int8."""
        cat = CATEGORY_INDEX
        slots = np.full(self.capacity, cat["free"], dtype=np.int8)
        need = self._need(waiting)
        for offset, size in self.allocator.free_extents():
            if need is not None and size < need:
                slots[offset:offset + size] = cat["external"]
        for r in self._regions.values():  # tokens, then future tokens, then never-used slots
            bounds = np.cumsum([r.offset, r.tokens, r.final - r.tokens, r.reserved - r.final,
                                r.block - r.reserved])
            for c, start, stop in zip(CATEGORIES[:4], bounds[:-1], bounds[1:]):
                slots[start:stop] = cat[c]
        return slots


def static_max(capacity: int, max_seq_len: int) -> ContiguousKV:
    """FasterTransformer-style static preallocation: every request takes a max_seq_len slot."""
    return ContiguousKV(FixedSlots(capacity, max_seq_len), "max", max_seq_len, name="Static (Max)")


def orca(capacity: int, reserve: str, max_seq_len: int) -> ContiguousKV:
    """Orca as the PagedAttention paper models it: a reservation rule and a buddy allocator."""
    name = f"Orca ({reserve.title()})"  # Orca (Max), Orca (Pow2), Orca (Oracle)
    return ContiguousKV(BuddyAllocator(capacity), reserve, max_seq_len, name=name)
