"""One sequence's block table: logical blocks -> physical blocks, and the tokens in them.

Token ``i`` lives in logical block ``i // block_size`` at offset ``i % block_size``; the table
maps logical block ``j`` to physical block ``blocks[j]``. Only the last block can be partly
filled, so a sequence wastes less than one block (chapter 4). Blocks may be shared with other
tables (fork, prefix hits); a shared block is never written: appending into a shared, partly
filled last block first copies it (copy-on-write, chapter 5).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedlab._arith import cdiv
from pagedlab.memory.allocator import BlockAllocator


class BlockTable:
    """Physical blocks and token ids of one sequence; ``keys`` holds the prefix-cache keys of
    its full blocks (``None`` when prefix caching is off)."""

    __slots__ = ("seq_id", "block_size", "blocks", "token_ids", "keys")

    def __init__(
        self,
        seq_id: Hashable,
        block_size: int,
        blocks: list[int],
        token_ids: list[int],
        keys: list[int] | None = None,
    ):
        self.seq_id = seq_id
        self.block_size = block_size
        self.blocks = blocks
        self.token_ids = token_ids
        self.keys = keys

    def __repr__(self) -> str:
        return f"BlockTable({self.seq_id!r}, blocks={self.blocks}, tokens={len(self.token_ids)})"

    def _growth(self, num_tokens: int, allocator: BlockAllocator) -> tuple[int, bool]:
        """(new blocks an append of ``num_tokens`` needs, whether the last block must be copied)."""
        # >>> grow
        n, bs = len(self.token_ids), self.block_size
        grow = cdiv(n + num_tokens, bs) - len(self.blocks)  # ceil: a block only when full
        # <<< grow
        shared_tail = n % bs != 0 and allocator.refcount(self.blocks[-1]) > 1
        return grow, shared_tail

    def blocks_needed(self, num_tokens: int, allocator: BlockAllocator) -> int:
        """Blocks an append of ``num_tokens`` would take from ``allocator``."""
        grow, shared_tail = self._growth(num_tokens, allocator)
        return grow + shared_tail

    def append(self, token_ids: Sequence[int], allocator: BlockAllocator) -> tuple[int, int] | None:
        """Store ``token_ids`` after the current tokens; return the (src, dst) copy it requires.

        A shared, partly filled last block is replaced by a fresh copy before anything is
        written into it; the caller must copy src's contents to dst before the new tokens'
        keys and values are written. All blocks are taken at once, so an :class:`OutOfBlocks`
        leaves the table as it was.
        """
        # >>> copy_on_write
        grow, shared_tail = self._growth(len(token_ids), allocator)
        copy = None
        if grow > 0 or shared_tail:
            new = allocator.allocate(grow + shared_tail, owner=self.seq_id)
            if shared_tail:
                copy = (self.blocks[-1], new.pop())
                self.blocks[-1] = copy[1]
                allocator.release(copy[:1])  # still used by the other sharers
            self.blocks += new
        self.token_ids += token_ids
        return copy
        # <<< copy_on_write

    def fork(self, child_id: Hashable, allocator: BlockAllocator) -> BlockTable:
        """A table for ``child_id`` sharing every block with this one: no copy, one more user."""
        allocator.share(self.blocks)
        keys = None if self.keys is None else self.keys.copy()
        tokens = self.token_ids.copy()
        return BlockTable(child_id, self.block_size, self.blocks.copy(), tokens, keys)

    def free(self, allocator: BlockAllocator) -> None:
        """Release every block, tail first (the prefix cache then evicts tails before heads)."""
        allocator.release(self.blocks[::-1])
        self.blocks = []
