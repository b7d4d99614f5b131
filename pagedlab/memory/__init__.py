"""Paged KV-cache memory: block pools, block tables, prefix caching and the manager facade.

Chapter 2's contiguous baselines are in ``contiguous`` (static and Orca-style reservation over a
buddy allocator). Chapters 4 and 5 of the book: ``allocator`` (free list, reference counts), ``block_table``
(one sequence's blocks, fork and copy-on-write), ``prefix_cache`` (chained block hashes, LRU
eviction) and ``manager`` (:class:`KVCacheManager`, what the engine and simulator use).
"""

from pagedlab.memory.allocator import BlockAllocator
from pagedlab.memory.block_table import BlockTable
from pagedlab.memory.contiguous import (
    CATEGORIES,
    BuddyAllocator,
    ContiguousKV,
    FixedSlots,
    MemoryBreakdown,
    OutOfSlots,
    orca,
    static_max,
)
from pagedlab.memory.errors import InvariantError, OutOfBlocks, StateError, UnknownSequence
from pagedlab.memory.manager import Event, KVCacheManager, PrefixStats, Usage
from pagedlab.memory.prefix_cache import PrefixCache, block_key

__all__ = [
    "CATEGORIES",
    "BlockAllocator",
    "BlockTable",
    "BuddyAllocator",
    "ContiguousKV",
    "FixedSlots",
    "MemoryBreakdown",
    "OutOfSlots",
    "orca",
    "static_max",
    "Event",
    "InvariantError",
    "KVCacheManager",
    "OutOfBlocks",
    "PrefixCache",
    "PrefixStats",
    "StateError",
    "UnknownSequence",
    "Usage",
    "block_key",
]
