"""The paged KV-cache manager: the one object the engine and the simulator talk to.

It ties together a GPU block pool, a CPU pool for swapped-out sequences, one block table per
sequence and, optionally, the prefix cache (Kwon et al. 2023, sections 4.2-4.5; vLLM's block
manager). Sequence ids are any hashable values. Every method that raises leaves the manager
as it was.

Copies are the engine's job: :meth:`swap_out` and :meth:`swap_in` return block pairs to copy
between GPU and CPU, :meth:`take_copies` the copy-on-write pairs (``copy_blocks``). A block
released in a step may be handed out again in the same step, so a step runs its swap copies,
then the copy-on-write batch, then the forward pass that writes new keys and values. That is
safe when the scheduler, like vLLM's, preempts a sequence before appending to it, frees
finished sequences after the step, and swaps in only in steps that swapped nothing out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from pagedlab._arith import cdiv
from pagedlab._checks import check_positive
from pagedlab.memory.allocator import BlockAllocator
from pagedlab.memory.block_table import BlockTable
from pagedlab.memory.errors import InvariantError, OutOfBlocks, StateError, UnknownSequence
from pagedlab.memory.prefix_cache import PrefixCache


@dataclass(frozen=True)
class Usage:
    """How well the GPU pool's memory is used: ``utilization`` is the paper's Fig. 2 metric.

    ``tokens_stored`` counts token states physically present in used blocks: a block shared by
    several sequences (fork, prefix hit) is counted once, as memory is. Parked prefix-cache
    blocks are free capacity, so they count in neither field.
    """

    used_blocks: int
    tokens_stored: int
    slots_allocated: int  # used_blocks * block_size

    @property
    def utilization(self) -> float:
        """Fraction of allocated token slots that hold a token's keys and values."""
        return self.tokens_stored / self.slots_allocated if self.slots_allocated else 0.0


@dataclass(frozen=True)
class PrefixStats:
    """Prefix-cache counters since the manager was built: hits and misses count prompt tokens,
    evictions count blocks."""

    hits: int  # prompt tokens served from cached blocks
    misses: int  # prompt tokens that must be computed
    evictions: int  # cached blocks evicted to make room

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens served from the cache."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(frozen=True)
class Event:
    """One step of the manager's history, for replay (``record_events=True``).

    ``kind`` is allocate, append, fork, cow, free, truncate, evict, swap_out or swap_in.
    ``blocks`` are the blocks taken (allocate, append), shared (fork), released (free: CPU
    blocks if the sequence was swapped out; truncate) or evicted (evict, whose ``seq_id`` is
    None: the next event's sequence caused it); ``pairs`` the (src, dst) copies (cow, swap_out, swap_in).
    """

    kind: str
    seq_id: Hashable
    blocks: tuple[int, ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()
    num_tokens: int = 0  # allocate: prompt tokens; append: new tokens; truncate: tokens cut
    cached_tokens: int = 0  # allocate: prompt tokens served from the prefix cache
    parent: Hashable = None  # fork: the sequence forked from


class KVCacheManager:
    """Paged KV-cache bookkeeping for ``num_gpu_blocks`` blocks of ``block_size`` tokens.

    ``num_cpu_blocks`` sizes the swap space; ``enable_prefix_caching`` shares the full blocks
    of common prompt prefixes across requests; ``record_events`` keeps :attr:`events`.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        *,
        record_events: bool = False,
    ):
        check_positive("num_gpu_blocks", num_gpu_blocks, integer=True)
        check_positive("block_size", block_size, integer=True)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.gpu = BlockAllocator(num_gpu_blocks, "gpu")
        self.cpu = BlockAllocator(num_cpu_blocks, "cpu")
        self.prefix_cache = PrefixCache(self.gpu, block_size) if enable_prefix_caching else None
        self._running: dict[Hashable, BlockTable] = {}  # tables of GPU blocks
        self._swapped: dict[Hashable, BlockTable] = {}  # tables of CPU blocks
        self._copies: list[tuple[int, int]] = []  # copy-on-write pairs not yet taken
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self.events: list[Event] | None = [] if record_events else None
        if record_events and self.prefix_cache is not None:
            self.prefix_cache.on_evict = lambda blocks: self._record("evict", None, blocks)

    def __contains__(self, seq_id: Hashable) -> bool:
        """Does the manager hold blocks for ``seq_id`` (running or swapped out)?"""
        return seq_id in self._running or seq_id in self._swapped

    # --- capacity ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """GPU blocks available now, counting parked (evictable) prefix-cache blocks."""
        return self.gpu.num_free

    @property
    def num_used_blocks(self) -> int:
        """GPU blocks used by at least one live sequence."""
        return self.gpu.num_used

    @property
    def num_cached_blocks(self) -> int:
        """GPU blocks in the prefix cache, in use or parked (0 without prefix caching)."""
        return self.prefix_cache.num_cached if self.prefix_cache is not None else 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens fill, the last one perhaps partly."""
        return cdiv(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Would a new sequence of ``num_tokens`` prompt tokens fit now, ignoring prefix hits?

        Conservative: prefix hits only lower the need, so True means :meth:`allocate` succeeds.
        """
        check_positive("num_tokens", num_tokens, integer=True)
        return self.blocks_for(num_tokens) <= self.gpu.num_free

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Would appending ``num_tokens`` tokens to ``seq_id`` fit now (copy-on-write included)?"""
        check_positive("num_tokens", num_tokens, integer=True)
        return self._table(seq_id).blocks_needed(num_tokens, self.gpu) <= self.gpu.num_free

    def room(self, seq_id: Hashable) -> int:
        """Tokens running ``seq_id`` can append now: the rest of its last block and every free
        block. A shared, partly filled last block would first take one free block for its copy,
        which this count does not subtract: the scheduler asks after the decode's own token has
        made the last block private."""
        return -self.num_tokens(seq_id) % self.block_size + self.gpu.num_free * self.block_size

    def blocks_needed(self, num_tokens: Mapping[Hashable, int], shared: int = 0) -> int:
        """GPU blocks that :meth:`allocate_slots` with ``num_tokens[seq_id]`` new tokens for
        each sequence would take.

        For running sequences, exactly: the blocks their new tokens fill, plus a copy of a
        shared, partly filled last block, except for the last of its sharers to append, who
        finds it unshared by then. For new sequences, as if nothing were cached (prefix hits
        only lower it), their first ``shared`` tokens counted once.
        """
        bs = self.block_size
        if not any(seq_id in self._running for seq_id in num_tokens):
            return shared // bs + sum(cdiv(n - shared, bs) for n in num_tokens.values())
        tables = [self._table(seq_id) for seq_id in num_tokens]
        return self._append_need(tables, list(num_tokens.values()), self.gpu)

    def _append_need(self, tables: list[BlockTable], counts: list[int],
                     pool: BlockAllocator) -> int:
        """Blocks that appending ``counts[i]`` tokens to each of ``tables`` (one group, in this
        order, their blocks in ``pool``) takes: the blocks the tokens fill, and a copy of each
        shared, partly filled last block for each of its sharers but the last to append."""
        bs, need, sharers = self.block_size, 0, {}
        for table, n in zip(tables, counts):
            held = len(table.token_ids)
            need += cdiv(held + n, bs) - cdiv(held, bs)
            if held % bs:
                last = table.blocks[-1]
                sharers[last] = sharers.get(last, 0) + 1
        return need + sum(count - (pool.refcount(block) == count)
                          for block, count in sharers.items())

    def allocate_slots(self, token_ids: Mapping[Hashable, Sequence[int]], *, keep_free: int = 0,
                       num_speculative: int = 0, shared: int = 0,
                       prompt_len: int | None = None) -> dict[Hashable, int] | None:
        """The scheduler's one question, "does it fit?", answered by doing it (vLLM V1's
        ``allocate_slots``): slots for ``token_ids[seq_id]`` after each sequence's tokens, if
        the blocks they take (:meth:`blocks_needed`) leave ``keep_free`` free; else None, and
        nothing changes. Returns where each sequence's tokens to compute start: after those
        it held, or after those the prefix cache served.

        One group at a time: running sequences append (``num_speculative``: each one's last
        tokens are unverified proposals); new ones are allocated (their first ``shared``
        tokens held once, :meth:`allocate_shared`; ``prompt_len``: the whole prompt's length
        when the tokens are its first chunk).
        """
        if self.blocks_needed({s: len(t) for s, t in token_ids.items()}, shared) > (
                self.gpu.num_free - keep_free):
            return None
        if any(seq_id in self._running for seq_id in token_ids):
            starts = {seq_id: self.num_tokens(seq_id) for seq_id in token_ids}
            for seq_id, tokens in token_ids.items():
                self.append(seq_id, tokens, num_speculative=num_speculative)
            return starts
        if len(token_ids) > 1:
            return dict(zip(token_ids, self.allocate_shared(list(token_ids),
                                                            list(token_ids.values()), shared)))
        ((seq_id, tokens),) = token_ids.items()
        return {seq_id: self.allocate(seq_id, tokens, prompt_len=prompt_len)}

    # --- the request lifecycle --------------------------------------------------------------

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens of a prompt that :meth:`allocate` would serve from the prefix cache now
        (0 without prefix caching). Read-only: a scheduler sizes a first chunk with it."""
        if self.prefix_cache is None or not len(token_ids):
            return 0
        return len(self._lookup(token_ids)[2]) * self.block_size

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *,
                 prompt_len: int | None = None) -> int:
        """Blocks for a new sequence's prompt; return how many prompt tokens the cache served.

        With prefix caching, the prompt's longest cached prefix of full blocks is shared, not
        recomputed; at least one token is always left to compute (the engine needs its
        logits), as in vLLM. The engine writes keys and values for the rest, positions
        ``[returned, len(token_ids))``. A chunked prefill allocates its first chunk here and
        appends the rest; ``prompt_len`` is then the whole prompt's length, for
        :attr:`prefix_stats`.
        """
        self._check_new(seq_id)
        tokens = list(token_ids)
        n, bs, cache = len(tokens), self.block_size, self.prefix_cache
        if n == 0:
            raise ValueError(f"sequence {seq_id!r}: a prompt needs at least one token")
        num_blocks = cdiv(n, bs)
        if cache is None:
            keys, hits = None, []
            blocks = self.gpu.allocate(num_blocks, owner=seq_id)
        else:
            keys, chunks, hits = self._lookup(tokens)
            free = self.gpu.num_free
            if num_blocks > free:  # then count exactly: a parked hit uses up free capacity too
                needed = num_blocks - len(hits) + sum(self.gpu.refcount(b) == 0 for b in hits)
                if needed > free:
                    raise OutOfBlocks(needed, free, self.gpu.name, seq_id)
            cache.acquire(hits)  # before allocating, so evicting cannot take them
            blocks = hits + self.gpu.allocate(num_blocks - len(hits), owner=seq_id)
            cache.insert(blocks, keys, chunks[len(hits):], len(hits))
        self._running[seq_id] = BlockTable(seq_id, bs, blocks, tokens, keys)
        cached = len(hits) * bs
        self._prompt_tokens += n if prompt_len is None else prompt_len
        self._hit_tokens += cached
        if self.events is not None:
            self._record("allocate", seq_id, blocks, num_tokens=n, cached_tokens=cached)
        return cached

    def allocate_shared(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]],
                        shared: int) -> list[int]:
        """Blocks for new sequences whose first ``shared`` tokens (whole blocks, the same in
        each) are held once: the first sequence allocates them, the others fork it before
        anyone appends the rest. Returns each sequence's first token to compute (after its
        prefix hits, or after the shared part), as :meth:`allocate` does for one."""
        if not shared:
            return [self.allocate(i, t) for i, t in zip(seq_ids, token_ids)]
        if shared % self.block_size:
            raise ValueError(f"sequences {list(seq_ids)!r}: shared={shared} tokens must fill "
                             f"whole blocks of {self.block_size}")
        first = seq_ids[0]
        starts = [self.allocate(first, token_ids[0][:shared])] + [shared] * (len(seq_ids) - 1)
        for seq_id in seq_ids[1:]:
            self.fork(first, seq_id)
        for seq_id, tokens in zip(seq_ids, token_ids):
            self.append(seq_id, tokens[shared:])
        return starts

    def append(self, seq_id: Hashable, token_ids: Sequence[int], *,
               num_speculative: int = 0) -> None:
        """Store decoded ``token_ids`` after ``seq_id``'s tokens, taking blocks as they fill.

        A shared, partly filled last block is copied first; the pair goes to
        :meth:`take_copies`. :class:`OutOfBlocks` leaves the sequence as it was. The last
        ``num_speculative`` tokens are proposals not yet verified: they get slots, but no
        block holding one enters the prefix cache until :meth:`truncate` keeps it.
        """
        try:
            table = self._running[seq_id]
        except KeyError:
            table = self._table(seq_id)  # raises, saying why
        tokens, bs = table.token_ids, self.block_size
        n, num_new = len(tokens), len(token_ids)
        if not 0 <= num_speculative <= num_new:
            raise ValueError(f"sequence {seq_id!r}: num_speculative={num_speculative} must be "
                             f"in [0, {num_new}], the tokens appended")
        room = -n % bs  # free slots in the last block
        if 0 < num_new <= room and self.gpu.refcount(table.blocks[-1]) == 1 and (
                self.events is None):
            tokens += token_ids  # most decode steps: room in the last block, ours alone
            if num_new < room:
                return  # and no block filled
        elif room == 0 and num_new and self.events is None:  # a full last block: nothing to copy
            table.blocks += self.gpu.allocate(cdiv(num_new, bs), owner=seq_id)
            tokens += token_ids
        else:
            if not num_new:
                raise ValueError(f"sequence {seq_id!r}: append needs at least one token")
            num_blocks = len(table.blocks)
            copy = table.append(token_ids, self.gpu)
            if copy is not None:
                self._copies.append(copy)
            if self.events is not None:
                if copy is not None:
                    self._record("cow", seq_id, pairs=(copy,))
                self._record("append", seq_id, table.blocks[num_blocks:], num_tokens=num_new)
        self._cache_full_blocks(table, n + num_new - num_speculative)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of running ``seq_id``: the slots of the tokens
        after them are released, and a block left empty goes back to the pool (a verification
        step rejected proposals). Only unverified tokens may go: a block the prefix cache holds
        is never cut. The full blocks kept are cached now."""
        table = self._table(seq_id)
        n, bs = len(table.token_ids), self.block_size
        check_positive("num_tokens", num_tokens, integer=True)
        verified = len(table.keys) * bs if table.keys is not None else 0
        if not verified <= num_tokens <= n:
            raise ValueError(
                f"sequence {seq_id!r}: cannot keep {num_tokens} of its {n} tokens; need "
                f"{verified} <= num_tokens <= {n} (its first {verified} are in cached blocks)"
            )
        released = table.blocks[cdiv(num_tokens, bs):]
        del table.blocks[cdiv(num_tokens, bs):]
        del table.token_ids[num_tokens:]
        self.gpu.release(released[::-1])
        if self.events is not None:
            self._record("truncate", seq_id, released[::-1], num_tokens=n - num_tokens)
        self._cache_full_blocks(table, num_tokens)

    def _cache_full_blocks(self, table: BlockTable, num_verified: int) -> None:
        """Cache the table's full blocks among its first ``num_verified`` tokens not yet
        cached (nothing without prefix caching)."""
        cache, done = self.prefix_cache, len(table.keys or ())
        if cache is not None and num_verified // self.block_size > done:
            chunks = cache.extend_keys(table.keys, table.token_ids[:num_verified])
            cache.insert(table.blocks, table.keys, chunks, done)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its blocks (no copy)."""
        parent = self._table(parent_id)
        self._check_new(child_id)
        self._running[child_id] = parent.fork(child_id, self.gpu)
        if self.events is not None:
            self._record("fork", child_id, parent.blocks, num_tokens=len(parent.token_ids),
                         parent=parent_id)

    def free(self, seq_id: Hashable) -> None:
        """Release every block of ``seq_id`` (running or swapped out) and forget it."""
        if seq_id in self._running:
            tables, pool = self._running, self.gpu
        elif seq_id in self._swapped:
            tables, pool = self._swapped, self.cpu
        else:
            raise self._unknown(seq_id)
        table = tables[seq_id]
        if self.events is not None:
            self._record("free", seq_id, table.blocks[::-1])
        table.free(pool)
        del tables[seq_id]

    def commit(self) -> None:
        """The step's keys and values are written: blocks cached during it may be hit from now
        on as before. Call after every forward pass that succeeded."""
        if self.prefix_cache is not None:
            self.prefix_cache.commit()

    def rollback(self) -> None:
        """A step failed before its keys and values were all written: forget the blocks
        cached since the last :meth:`commit` (parked ones go back to the free list). Free the
        step's sequences first, so that no live sequence relies on them."""
        if self.prefix_cache is not None:
            self.gpu.unpark(self.prefix_cache.rollback())

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copy-on-write pairs since the last call: one ``copy_blocks`` batch."""
        copies, self._copies = self._copies, []
        return copies

    # --- swapping (preemption) --------------------------------------------------------------

    def can_swap_out(self, *seq_ids: Hashable) -> bool:
        """Would the CPU pool hold these running sequences (each shared block once)?"""
        return len(self._distinct_blocks(seq_ids, self._running)) <= self.cpu.num_free

    def can_swap_in(self, *seq_ids: Hashable) -> bool:
        """Would the GPU pool hold these swapped-out sequences (each shared block once)?"""
        return len(self._distinct_blocks(seq_ids, self._swapped)) <= self.gpu.num_free

    def swap_out(self, *seq_ids: Hashable) -> list[tuple[int, int]]:
        """Move running sequences to the CPU pool; return the (gpu, cpu) block copies to make.

        Pass a whole group of sequences that share blocks (parallel samples, beams) together:
        each physical block is then copied once and stays shared on the CPU. Blocks also used
        by a sequence left running are copied, and that sequence keeps the GPU original.
        """
        return self._swap(seq_ids, self._running, self._swapped, self.gpu, self.cpu, "swap_out")

    def blocks_to_swap_in(self, *seq_ids: Hashable) -> int:
        """GPU blocks that bringing swapped-out sequences back and decoding each one token
        takes (each shared block once, copy-on-write as :meth:`blocks_needed` counts it)."""
        back = len(self._distinct_blocks(seq_ids, self._swapped))
        tables = [self._swapped[seq_id] for seq_id in seq_ids]
        return back + self._append_need(tables, [1] * len(tables), self.cpu)

    def swap_in(self, *seq_ids: Hashable, keep_free: int | None = None
                ) -> list[tuple[int, int]] | None:
        """Bring swapped-out sequences back; return the (cpu, gpu) block copies to make.

        With ``keep_free``, only if they and their next decode (:meth:`blocks_to_swap_in`)
        leave that many blocks free; else None, and nothing changes.
        """
        if keep_free is not None and (
                self.blocks_to_swap_in(*seq_ids) > self.gpu.num_free - keep_free):
            return None
        pairs = self._swap(seq_ids, self._swapped, self._running, self.cpu, self.gpu, "swap_in")
        if self.prefix_cache is not None:  # the copies hold full blocks worth caching again
            for seq_id in seq_ids:
                table = self._running[seq_id]
                chunks = self.prefix_cache.extend_keys([], table.token_ids)  # block by block
                self.prefix_cache.insert(table.blocks, table.keys, chunks, 0)
        return pairs

    def is_swapped(self, seq_id: Hashable) -> bool:
        """True if ``seq_id`` lives in the CPU pool, False if it is running."""
        if seq_id in self._swapped:
            return True
        if seq_id in self._running:
            return False
        raise self._unknown(seq_id)

    # --- what the kernels and the book read -------------------------------------------------

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical GPU block of each logical block of running sequence ``seq_id``."""
        return self._table(seq_id).blocks.copy()

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens stored for ``seq_id`` (running or swapped out)."""
        return len(self._any_table(seq_id).token_ids)

    def token_ids(self, seq_id: Hashable) -> list[int]:
        """Token ids stored for ``seq_id`` (running or swapped out)."""
        return self._any_table(seq_id).token_ids.copy()

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Cache slot ``block * block_size + offset`` of token positions ``[start, end)``:
        where ``reshape_and_cache`` writes those tokens' keys and values."""
        table = self._table(seq_id)
        n = len(table.token_ids)
        if not (type(start) is int and type(end) is int and 0 <= start <= end <= n):
            for name, value in (("start", start), ("end", end)):  # then say what is wrong
                check_positive(name, value, integer=True, allow_zero=True)
            if not start <= end <= n:
                raise ValueError(
                    f"sequence {seq_id!r}: need 0 <= start={start} <= end={end} <= {n} tokens"
                )
        bs, blocks = self.block_size, table.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def usage(self) -> Usage:
        """Blocks used, token states stored (a shared block once) and slots allocated, now."""
        bs, full, partial = self.block_size, set(), {}
        for table in self._running.values():
            n = len(table.token_ids)
            full.update(table.blocks[: n // bs])
            if n % bs:
                partial[table.blocks[-1]] = n % bs  # sharers of a partial block agree on its fill
        used = self.gpu.num_used
        return Usage(used, len(full) * bs + sum(partial.values()), used * bs)

    @property
    def prefix_stats(self) -> PrefixStats:
        """Prefix-cache hits and misses (prompt tokens) and evictions (blocks) so far."""
        evictions = self.prefix_cache.evictions if self.prefix_cache is not None else 0
        return PrefixStats(self._hit_tokens, self._prompt_tokens - self._hit_tokens, evictions)

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` unless the bookkeeping is consistent.

        In each pool, every block is free, parked or used, exactly one of them, and a used
        block's refcount equals the number of table entries pointing at it; every table has
        ``ceil(tokens / block_size)`` distinct blocks; sequences that share a block agree on
        the tokens in it; cached blocks hold what the cache says. O(blocks + tokens): for tests.
        """
        bs, cache = self.block_size, self.prefix_cache
        for pool, tables in ((self.gpu, self._running), (self.cpu, self._swapped)):
            pool.check_invariants()
            entries = Counter(b for table in tables.values() for b in table.blocks)
            for block in range(pool.num_blocks):
                if pool.refcount(block) != entries[block]:
                    raise InvariantError(
                        f"block {block} of pool {pool.name!r} has refcount {pool.refcount(block)} "
                        f"but {entries[block]} block-table entries"
                    )
            contents: dict[int, tuple[Hashable, tuple[int, ...]]] = {}  # block -> (a seq, tokens)
            for seq_id, table in tables.items():
                n = len(table.token_ids)
                blocks = table.blocks
                if n == 0 or len(blocks) != cdiv(n, bs) or len(set(blocks)) != len(blocks):
                    raise InvariantError(f"sequence {seq_id!r}: {n} tokens in blocks {blocks}")
                if cache is not None and len(table.keys) != n // bs:
                    raise InvariantError(
                        f"sequence {seq_id!r}: {len(table.keys)} keys, {n // bs} full blocks"
                    )
                for i, block in enumerate(blocks):
                    tokens = tuple(table.token_ids[i * bs : (i + 1) * bs])
                    other, seen = contents.setdefault(block, (seq_id, tokens))
                    if seen != tokens:
                        raise InvariantError(
                            f"block {block} of pool {pool.name!r} holds different tokens for "
                            f"sequences {other!r} and {seq_id!r}"
                        )
            if cache is not None and pool is self.gpu:
                cache.check_invariants()
                for block, (seq_id, tokens) in contents.items():
                    if cache.tokens_of(block) not in (None, tokens):
                        raise InvariantError(
                            f"cached block {block} does not hold {seq_id!r}'s tokens"
                        )

    # --- helpers ----------------------------------------------------------------------------

    def _lookup(self, tokens: Sequence[int]) -> tuple[list[int], list[tuple[int, ...]], list[int]]:
        """A prompt's full-block keys and tokens, and its cached blocks (one token always left
        to compute, for its logits)."""
        keys: list[int] = []
        chunks = self.prefix_cache.extend_keys(keys, tokens)
        hits = self.prefix_cache.match(keys, chunks, (len(tokens) - 1) // self.block_size)
        return keys, chunks, hits

    def _table(self, seq_id: Hashable) -> BlockTable:
        """The running table of ``seq_id``, or an error saying why there is none."""
        table = self._running.get(seq_id)
        if table is None:
            if seq_id in self._swapped:
                raise StateError(f"sequence {seq_id!r} is swapped out to the CPU; swap it in first")
            raise self._unknown(seq_id)
        return table

    def _any_table(self, seq_id: Hashable) -> BlockTable:
        table = self._running.get(seq_id) or self._swapped.get(seq_id)
        if table is None:
            raise self._unknown(seq_id)
        return table

    def _check_new(self, seq_id: Hashable) -> None:
        if seq_id in self._running or seq_id in self._swapped:
            raise StateError(f"sequence {seq_id!r} already exists; free it first or pick a new id")

    @staticmethod
    def _unknown(seq_id: Hashable) -> UnknownSequence:
        return UnknownSequence(f"sequence {seq_id!r} is not allocated (never, or already freed)")

    def _group(self, seq_ids: tuple, tables: dict) -> list[BlockTable]:
        """The tables of ``seq_ids``, all in ``tables`` (running or swapped) and distinct."""
        if not seq_ids:
            raise ValueError("name at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequences {seq_ids!r} name one sequence twice")
        for seq_id in seq_ids:
            if seq_id not in tables:
                if seq_id in self._running or seq_id in self._swapped:
                    where = "running" if seq_id in self._running else "swapped out"
                    raise StateError(f"sequence {seq_id!r} is already {where}")
                raise self._unknown(seq_id)
        return [tables[seq_id] for seq_id in seq_ids]

    def _distinct_blocks(self, seq_ids: tuple, tables: dict) -> list[int]:
        """Physical blocks of the group, each once, in order of first use."""
        tables = self._group(seq_ids, tables)
        return list(dict.fromkeys(b for table in tables for b in table.blocks))

    def _swap(self, seq_ids, src_tables, dst_tables, src, dst, kind) -> list[tuple[int, int]]:
        """Move a group's tables from pool ``src`` to ``dst``, each shared block once."""
        distinct = self._distinct_blocks(seq_ids, src_tables)
        owner = seq_ids[0] if len(seq_ids) == 1 else list(seq_ids)
        mapping = dict(zip(distinct, dst.allocate(len(distinct), owner=owner)))
        tables = [src_tables[seq_id] for seq_id in seq_ids]
        # Each new block has one user; every further table entry pointing at it adds one.
        entries = Counter(mapping[b] for table in tables for b in table.blocks)
        dst.share([block for block, k in entries.items() for _ in range(k - 1)])
        for table in tables:
            old = table.blocks
            src.release(old[::-1])
            table.blocks = [mapping[b] for b in old]
            dst_tables[table.seq_id] = src_tables.pop(table.seq_id)
            if self.events is not None:
                self._record(kind, table.seq_id, table.blocks, pairs=[(b, mapping[b]) for b in old])
        return list(mapping.items())

    def _record(self, kind, seq_id, blocks=(), pairs=(), **fields) -> None:
        self.events.append(Event(kind, seq_id, tuple(blocks), tuple(pairs), **fields))
