"""Automatic prefix caching: full blocks indexed by a chained hash of their contents (chapter 5).

A full block's key is ``hash((parent block's key, its token ids))``, so a key stands for the
block's tokens *and every token before them*: two prompts share the blocks of their longest
common prefix of full blocks. The cache stores, for each cached block, its key, its tokens and
its parent block, and a lookup compares all three, so a hash collision costs a miss, never a
wrong block.

When its last user leaves, a cached block is parked, not freed: it still holds valid keys and
values and counts as free capacity. The allocator evicts parked blocks, least recently used
first, only when its free list is empty. Sequences release their blocks tail first, so within
one chain the tail is evicted before the head, and a cached block's parent is always cached
too (the chain stays reachable from its head).

A block is cached when a sequence's tokens fill it, before the step that writes its keys and
values has run. The cache therefore remembers what it indexed since the engine last called
:meth:`PrefixCache.commit` (after a forward pass); if a step fails, :meth:`PrefixCache.rollback`
forgets those blocks, so no later request can hit a block that was never written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from pagedlab.memory.allocator import BlockAllocator
from pagedlab.memory.errors import InvariantError


def block_key(parent_key: int | None, tokens: tuple[int, ...]) -> int:
    """The key of a full block holding ``tokens`` after the block keyed ``parent_key``."""
    return hash((parent_key, tokens))


class PrefixCache:
    """Index of cached full blocks in ``allocator``'s pool; parks and evicts them (LRU).

    It installs itself as the allocator's evictor. ``evictions`` counts evicted blocks;
    ``on_evict``, if set, is called with each batch of evicted blocks.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self._block_of: dict[int, int] = {}  # key -> cached block
        # block -> (its key, its parent block or None, its tokens)
        self._entry: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()  # no users; least recently used first
        self._pending: list[int] = []  # cached since the last commit: K/V maybe not written yet
        self.evictions = 0
        self.on_evict: Callable[[list[int]], None] | None = None
        allocator.evictor = self

    @property
    def num_cached(self) -> int:
        """Blocks in the index, in use or parked."""
        return len(self._entry)

    @property
    def num_evictable(self) -> int:
        """Parked blocks: cached, no users, reclaimable."""
        return len(self._parked)

    def extend_keys(self, keys: list[int], token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        """Append to ``keys`` the keys of ``token_ids``' full blocks that it lacks; return
        those blocks' tokens (for :meth:`match` and :meth:`insert`, so each is sliced once)."""
        bs, chunks = self.block_size, []
        key = keys[-1] if keys else None
        for start in range(len(keys) * bs, len(token_ids) - bs + 1, bs):
            chunk = tuple(token_ids[start : start + bs])
            key = block_key(key, chunk)
            keys.append(key)
            chunks.append(chunk)
        return chunks

    def match(self, keys: Sequence[int], chunks: Sequence[tuple[int, ...]],
              max_blocks: int) -> list[int]:
        """Cached blocks holding the longest prefix of a prompt (at most ``max_blocks``), given
        its full blocks' keys and tokens (``chunks``, from :meth:`extend_keys`).

        Read-only: the caller decides whether to take them (:meth:`acquire`).
        """
        # >>> walk
        hits, parent = [], None
        for i in range(min(max_blocks, len(keys))):
            block = self._block_of.get(keys[i])
            if block is None:
                break
            _, block_parent, tokens = self._entry[block]
            if block_parent != parent or tokens != chunks[i]:
                break  # a hash collision: same key, different prefix
            hits.append(block)
            parent = block
        return hits
        # <<< walk

    def acquire(self, blocks: Sequence[int]) -> None:
        """Add a user to each matched block: share it if in use, take it back if parked."""
        in_use = []
        for block in blocks:
            if block in self._parked:
                del self._parked[block]
                self.allocator.revive(block)
            else:
                in_use.append(block)
        self.allocator.share(in_use)

    def insert(self, blocks: Sequence[int], keys: Sequence[int],
               chunks: Sequence[tuple[int, ...]], start: int) -> None:
        """Cache a table's full blocks ``blocks[start:len(keys)]``; ``chunks`` holds their
        tokens (``chunks[0]`` is block ``start``'s).

        A block is cached only if its parent is (so lookups reach it) and no other block holds
        its key already (the first copy of a prefix wins; a duplicate stays private).
        """
        entry, block_of, pending = self._entry, self._block_of, self._pending
        parent = blocks[start - 1] if start else None
        for block, key, tokens in zip(blocks[start:], keys[start:], chunks):
            if (parent is not None and parent not in entry) or key in block_of:
                return  # nor can any later block, whose parent this one is
            block_of[key] = block
            entry[block] = (key, parent, tokens)
            pending.append(block)
            parent = block

    def commit(self) -> None:
        """The keys and values of every block cached so far are written: keep them."""
        self._pending.clear()

    def rollback(self) -> list[int]:
        """Forget the blocks cached since the last :meth:`commit`, newest first (a child
        before its parent); return those that were parked, which are now free capacity."""
        unparked = []
        for block in reversed(self._pending):
            entry = self._entry.pop(block, None)
            if entry is None:  # evicted since
                continue
            del self._block_of[entry[0]]
            if block in self._parked:
                del self._parked[block]
                unparked.append(block)
        self._pending.clear()
        return unparked

    def park(self, block: int) -> bool:
        """Keep ``block``, which just lost its last user, if it is cached (the allocator asks)."""
        if block in self._entry:
            self._parked[block] = None
            return True
        return False

    def evict(self, n: int) -> list[int]:
        """Forget the ``n`` least recently used parked blocks and hand them to the allocator."""
        evicted = []
        for _ in range(n):
            block, _ = self._parked.popitem(last=False)
            del self._block_of[self._entry.pop(block)[0]]
            evicted.append(block)
        self.evictions += n
        if self.on_evict is not None:
            self.on_evict(evicted)
        return evicted

    def tokens_of(self, block: int) -> tuple[int, ...] | None:
        """The tokens cached in ``block``, or None if it is not cached."""
        entry = self._entry.get(block)
        return None if entry is None else entry[2]

    def check_invariants(self) -> None:
        """Index and entries agree; keys match contents; parked blocks are unused; a cached
        block's parent is cached, in use whenever the child is, and evicted after it."""
        refcount, name = self.allocator.refcount, self.allocator.name
        if len(self._block_of) != len(self._entry):
            raise InvariantError(f"{len(self._block_of)} keys for {len(self._entry)} cached blocks")
        order = {block: i for i, block in enumerate(self._parked)}  # eviction order
        for block, (key, parent, tokens) in self._entry.items():
            where = f"cached block {block} of pool {name!r}"
            if self._block_of.get(key) != block:
                raise InvariantError(f"{where}: its key does not map back to it")
            if len(tokens) != self.block_size:
                raise InvariantError(f"{where} holds {len(tokens)} tokens, not a full block")
            if (refcount(block) == 0) != (block in order):
                raise InvariantError(f"{where}: {refcount(block)} users, parked: {block in order}")
            if parent is None:
                parent_key = None
            elif parent not in self._entry:
                raise InvariantError(f"{where}: its parent block {parent} is not cached")
            else:
                parent_key = self._entry[parent][0]
                if refcount(block) and not refcount(parent):
                    raise InvariantError(f"{where} is in use but its parent {parent} is not")
                if block in order and parent in order and order[parent] < order[block]:
                    raise InvariantError(f"{where} would be evicted after its parent {parent}")
            if block_key(parent_key, tokens) != key:
                raise InvariantError(f"{where}: key does not match its tokens and parent")
        for block in order:
            if block not in self._entry:
                raise InvariantError(f"parked block {block} of pool {name!r} is not cached")
