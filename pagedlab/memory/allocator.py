"""A fixed pool of physical KV blocks: a free list and reference counts (chapter 4).

Blocks are numbered ``0..num_blocks-1``; an id indexes the KV cache tensors. Each block is in
exactly one of three states:

- free: on the free list, no users;
- used: its reference count is the number of block-table entries pointing at it;
- parked: no users, but kept by an evictor (a prefix-cache block whose last user left). It
  counts as free capacity; when the free list runs dry, the allocator asks the evictor for it.

Every operation is O(1) per block and all-or-nothing: one that raises changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from pagedlab._checks import check_positive
from pagedlab.memory.errors import InvariantError, OutOfBlocks, StateError


class Evictor(Protocol):
    """What the allocator asks of a keeper of parked blocks (see PrefixCache)."""

    @property
    def num_evictable(self) -> int:
        """Blocks parked now."""

    def park(self, block: int) -> bool:
        """A block lost its last user: keep it (True) or let it go to the free list (False)."""

    def evict(self, n: int) -> list[int]:
        """Forget ``n`` parked blocks, least valuable first, and hand them back."""


class BlockAllocator:
    """Free list plus reference counts over a pool of ``num_blocks`` blocks named ``name``.

    The free list is a stack, so a freed block is the next one handed out (it is likeliest to
    be warm in a hardware cache), and a fresh pool hands out 0, 1, 2, ... in order.
    """

    def __init__(self, num_blocks: int, name: str = "gpu"):
        check_positive("num_blocks", num_blocks, integer=True, allow_zero=True)
        self.name = name
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks  # users of each block
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() yields 0 first
        self.evictor: Evictor | None = None

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: the free list plus parked (evictable) blocks."""
        return len(self._free) + (self.evictor.num_evictable if self.evictor else 0)

    @property
    def num_used(self) -> int:
        """Blocks with at least one user."""
        return self.num_blocks - self.num_free

    def refcount(self, block: int) -> int:
        """How many block-table entries point at ``block``."""
        return self._refs[block]

    def allocate(self, n: int, owner=None) -> list[int]:
        """Take ``n`` blocks, each with one user, evicting parked blocks if the free list is short.

        All or nothing: if fewer than ``n`` are available, raise :class:`OutOfBlocks` naming
        ``owner`` (the sequence asking) and take none.
        """
        if type(n) is not int or n < 0:  # the fast path skips the full check
            check_positive("n", n, integer=True, allow_zero=True)
            n = int(n)
        if n == 0:
            return []
        free = self._free
        if n > len(free):  # evict parked blocks for the rest, if there are enough
            short, evictor = n - len(free), self.evictor
            if evictor is None or short > evictor.num_evictable:
                raise OutOfBlocks(n, self.num_free, self.name, owner)
            free += evictor.evict(short)
        # >>> take
        blocks = free[-n:]
        del free[-n:]
        blocks.reverse()
        refs = self._refs
        for b in blocks:
            refs[b] = 1
        # <<< take
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Add one user to each block (fork, prefix hit); each must already be in use."""
        refs = self._refs
        for b in blocks:
            if not (0 <= b < self.num_blocks and refs[b] > 0):
                raise StateError(f"block {b} of pool {self.name!r} is not in use; cannot share it")
        for b in blocks:
            refs[b] += 1

    def revive(self, block: int) -> None:
        """Give a parked block its first user again; the evictor has already let go of it."""
        if not (0 <= block < self.num_blocks and self._refs[block] == 0):
            raise StateError(f"block {block} of pool {self.name!r} is not parked; cannot revive it")
        self._refs[block] = 1

    def unpark(self, blocks: Sequence[int]) -> None:
        """Put blocks the evictor has let go of without handing them out back on the free list."""
        for b in blocks:
            if not (0 <= b < self.num_blocks and self._refs[b] == 0) or b in self._free:
                raise StateError(f"block {b} of pool {self.name!r} is not parked; cannot free it")
        self._free.extend(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one user from each block, in order; a block left with none is parked or freed.

        Order matters to an evictor: release a sequence's blocks tail first so the tail of a
        cached chain is evicted before its head. Releasing a free block raises
        :class:`StateError` naming it, and changes nothing: no count ever goes below zero.
        """
        refs = self._refs
        # >>> check
        for b in blocks:
            if not (0 <= b < self.num_blocks and refs[b] > 0):
                raise StateError(f"block {b} of pool {self.name!r} is already free")
        # <<< check
        if len(blocks) > 1 and len(set(blocks)) < len(blocks):  # a block named twice
            for b, times in Counter(blocks).items():
                if times > refs[b]:
                    raise StateError(
                        f"block {b} of pool {self.name!r} has {refs[b]} user(s), "
                        f"cannot release it {times} times"
                    )
        free, park = self._free, self.evictor.park if self.evictor else None
        for b in blocks:
            refs[b] -= 1
            if not refs[b] and (park is None or not park(b)):
                free.append(b)

    def check_invariants(self) -> None:
        """Counts are never negative; the free list holds distinct unused blocks; every unused
        block is either on it or parked, never both."""
        refs, free = self._refs, self._free
        if any(c < 0 for c in refs):
            bad = next(b for b, c in enumerate(refs) if c < 0)
            raise InvariantError(f"block {bad} of pool {self.name!r} has refcount {refs[bad]}")
        if len(set(free)) != len(free):
            bad = next(b for b, k in Counter(free).items() if k > 1)
            raise InvariantError(f"block {bad} is twice on the free list of pool {self.name!r}")
        for b in free:
            if not 0 <= b < self.num_blocks or refs[b]:
                raise InvariantError(
                    f"block {b} is on the free list of pool {self.name!r} but in use"
                )
        unused = refs.count(0)
        parked = self.evictor.num_evictable if self.evictor else 0
        if unused != len(free) + parked:
            raise InvariantError(
                f"pool {self.name!r}: {unused} blocks have no users but {len(free)} are free "
                f"and {parked} parked"
            )
