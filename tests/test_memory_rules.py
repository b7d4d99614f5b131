"""Rules of the KV memory that mutation testing found unchecked (tests/MUTATION.md): capacity
edges, arguments named in errors, forks keeping their prefix-cache keys, the invariant checks'
own messages, and the contiguous baselines' slot maps agreeing with their breakdowns."""

import numpy as np
import pytest

from pagedlab.memory import (
    CATEGORIES,
    BlockAllocator,
    BuddyAllocator,
    ContiguousKV,
    FixedSlots,
    InvariantError,
    KVCacheManager,
    OutOfBlocks,
    PrefixCache,
    StateError,
    UnknownSequence,
    orca,
    static_max,
)
from pagedlab.sim.traces import Request

# --- the manager ---------------------------------------------------------------------------


def test_capacity_questions_take_whole_token_counts_and_name_them():
    mgr = KVCacheManager(4, 4)
    mgr.allocate("a", [1, 2, 3])
    for call in (lambda: mgr.can_allocate(2.5), lambda: mgr.can_append("a", 1.0)):
        with pytest.raises(ValueError, match=r"num_tokens=.* must be an integer"):
            call()
    with pytest.raises(ValueError, match=r"start=1.0 must be an integer"):
        mgr.slot_mapping("a", 1.0, 2)
    with pytest.raises(ValueError, match=r"end=-1 must be >= 0"):
        mgr.slot_mapping("a", 0, -1)
    with pytest.raises(ValueError, match=r"start=True must be an integer"):
        mgr.slot_mapping("a", True, 2)
    assert mgr.slot_mapping("a", 1, 3) == [1, 2]
    assert mgr.slot_mapping("a", np.int64(1), np.int32(3)) == [1, 2]  # any integer type


def test_a_request_that_needs_exactly_the_free_blocks_fits():
    mgr = KVCacheManager(3, 4, num_cpu_blocks=4)
    mgr.allocate("a", list(range(4)))  # one full block
    mgr.allocate("b", list(range(7)))  # two blocks, one slot left: the pool is full
    assert mgr.can_append("b")  # the default is one token: it fits the last slot
    assert not mgr.can_append("b", 2)
    mgr.swap_out("a")  # one block free
    assert mgr.can_append("b", 5) and not mgr.can_append("b", 6)  # 1 slot + 1 block, exactly
    mgr.allocate("c", [1])  # takes it
    assert not mgr.can_swap_in("a")
    mgr.free("c")
    assert mgr.can_swap_in("a")  # one block needed, one free


def test_a_fork_keeps_caching_the_blocks_it_fills():
    """A forked sequence goes on registering its full blocks in the prefix cache."""
    mgr = KVCacheManager(8, 4, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3, 4, 5, 6])  # a full block and half of one
    mgr.fork("a", "b")
    mgr.append("b", [7, 8])  # b's second block: a copy of a's half block, now full
    mgr.free("b")
    mgr.free("a")
    assert mgr.allocate("c", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8  # both blocks come from cache


def test_a_swapped_in_sequence_caches_its_full_blocks_again():
    mgr = KVCacheManager(4, 2, num_cpu_blocks=4, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3, 4, 5])
    mgr.swap_out("a")
    mgr.allocate("x", [9, 9, 9, 9, 9, 9])  # evicts a's cached GPU blocks: all 3 are needed
    mgr.free("x")
    mgr.swap_in("a")  # a's blocks come back to new GPU blocks, cached again from the first
    mgr.free("a")
    assert mgr.allocate("b", [1, 2, 3, 4, 6]) == 4
    with pytest.raises(ValueError, match="^name at least one sequence$"):
        mgr.swap_out()


def test_eviction_without_a_listener():
    mgr = KVCacheManager(2, 2, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3])
    mgr.free("a")  # the full block [1, 2] is parked
    mgr.allocate("b", [5, 6, 7, 8])  # needs both blocks: the parked one is evicted
    assert mgr.prefix_stats.evictions == 1
    mgr.check_invariants()


def forked_pair():
    """A manager (blocks of 2, prefix caching) where "a" holds 5 tokens and "b" forks it."""
    mgr = KVCacheManager(8, 2, 4, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3, 4, 5])
    mgr.fork("a", "b")
    mgr.check_invariants()
    return mgr, mgr._running["a"], mgr._running["b"]


def doubled(mgr, a):
    """"a" lists its first block twice, with refcounts to match the entries."""
    first, second = a.blocks[:2]
    a.blocks[1] = first
    mgr.gpu._refs[first], mgr.gpu._refs[second] = 3, 1


def emptied(mgr, a):
    """"a" holds no tokens and no blocks (an empty table is never valid)."""
    for block in a.blocks:
        mgr.gpu._refs[block] = 1
    a.blocks, a.token_ids, a.keys = [], [], []


MANAGER_CORRUPTIONS = {
    "a refcount too high": (lambda m, a, b: m.gpu._refs.__setitem__(a.blocks[0], 3),
                            r"^block \d of pool 'gpu' has refcount 3 but 2 block-table entries$"),
    "a cpu refcount": (lambda m, a, b: (m.swap_out("a", "b"),
                                        m.cpu._refs.__setitem__(m._swapped["a"].blocks[0], 5)),
                       r"^block \d of pool 'cpu' has refcount 5 but 2 block-table entries$"),
    "tokens past the blocks": (lambda m, a, b: a.token_ids.extend([6, 7]),
                               r"^sequence 'a': 7 tokens in blocks \[\d, \d, \d\]$"),
    "no tokens": (lambda m, a, b: a.token_ids.clear(),
                  r"^sequence 'a': 0 tokens in blocks \[\d, \d, \d\]$"),
    "an empty table": (lambda m, a, b: emptied(m, a), r"^sequence 'a': 0 tokens in blocks \[\]$"),
    "a block twice": (lambda m, a, b: doubled(m, a),
                      r"^sequence 'a': 5 tokens in blocks \[(\d), \1, \d\]$"),
    "a key missing": (lambda m, a, b: a.keys.pop(), r"^sequence 'a': 1 keys, 2 full blocks$"),
    "sharers disagree": (lambda m, a, b: b.token_ids.__setitem__(4, 9),
                         r"^block \d of pool 'gpu' holds different tokens for sequences 'a' "
                         r"and 'b'$"),
    "not what was cached": (lambda m, a, b: (a.token_ids.__setitem__(0, 9),
                                             b.token_ids.__setitem__(0, 9)),
                            r"^cached block \d does not hold 'a''s tokens$"),
}


@pytest.mark.parametrize("case", MANAGER_CORRUPTIONS)
def test_the_managers_invariants_name_what_is_wrong(case):
    mgr, a, b = forked_pair()
    corrupt, message = MANAGER_CORRUPTIONS[case]
    corrupt(mgr, a, b)
    with pytest.raises(InvariantError, match=message):
        mgr.check_invariants()


def test_an_error_without_an_owner_says_a_request():
    assert str(OutOfBlocks(3, 1, "gpu")) == "a request needs 3 blocks, pool 'gpu' has 1 free"


def test_only_a_parked_block_can_be_unparked():
    allocator = BlockAllocator(3)
    (used,) = allocator.allocate(1)
    for block in (used, 1, 3, -1):  # in use, free, past the pool, before it
        with pytest.raises(StateError, match=rf"^block {block} of pool 'gpu' is not parked; "
                                             "cannot free it$"):
            allocator.unpark([block])
    assert allocator.num_free == 2
    allocator.check_invariants()


def test_a_rollback_forgets_blocks_evicted_and_recached_in_the_same_step():
    """Blocks of 2, three of them: "a" caches p and q, then parks them; "b" caches r; "c"
    evicts q and caches it again under its own tokens. Rolling the step back forgets every
    entry (q's first one is already gone) and frees the parked p."""
    mgr = KVCacheManager(3, 2, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3, 4])
    mgr.free("a")  # p and q parked, q (the tail) first in line for eviction
    mgr.allocate("b", [5, 6])  # r, the free block
    mgr.allocate("c", [7, 8])  # evicts q
    assert mgr.prefix_stats.evictions == 1
    free = mgr.num_free_blocks
    mgr.rollback()
    mgr.check_invariants()
    for prompt in ([1, 2, 3, 4, 9], [5, 6, 9], [7, 8, 9]):
        assert mgr.cached_prefix(prompt) == 0
    assert mgr.num_free_blocks == free  # p, parked before, is free now: as much room


def test_only_a_parked_block_can_be_revived():
    allocator = BlockAllocator(2)
    for block in (2, -1):  # past the pool, before it
        with pytest.raises(StateError, match=f"block {block} of pool 'gpu' is not parked"):
            allocator.revive(block)


@pytest.mark.parametrize("corrupt, message", [
    (lambda a: a._refs.__setitem__(2, -1), r"^block 2 of pool 'gpu' has refcount -1$"),
    (lambda a: a._free.append(a._free[-1]), r"^block 1 is twice on the free list of pool 'gpu'$"),
    (lambda a: a._free.append(4), r"^block 4 is on the free list of pool 'gpu' but in use$"),
    (lambda a: a._free.pop(), r"^pool 'gpu': 3 blocks have no users but 2 are free and 0 parked$"),
])
def test_the_allocators_invariants_name_the_block(corrupt, message):
    allocator = BlockAllocator(4)
    allocator.allocate(1)
    allocator.check_invariants()
    corrupt(allocator)
    with pytest.raises(InvariantError, match=message):
        allocator.check_invariants()


def test_only_a_used_block_can_be_shared():
    with pytest.raises(StateError, match="block 2"):
        BlockAllocator(2).share([2])


# --- the prefix cache's own checks ---------------------------------------------------------


def cached_pair():
    """A prefix cache holding a two-block chain, both blocks parked."""
    mgr = KVCacheManager(4, 2, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3, 4, 5])
    mgr.free("a")
    cache = mgr.prefix_cache
    (head, tail) = sorted(cache._entry, key=lambda b: cache._entry[b][1] is not None)
    return mgr, cache, head, tail


def test_tokens_of_a_block_are_the_ones_cached_in_it():
    mgr, cache, head, tail = cached_pair()
    assert cache.tokens_of(head) == (1, 2) and cache.tokens_of(tail) == (3, 4)
    free = next(b for b in range(4) if b not in (head, tail))
    assert cache.tokens_of(free) is None


CORRUPTIONS = {
    "a key too many": (lambda c, h, t: c._block_of.__setitem__(99, h),
                       r"^3 keys for 2 cached blocks$"),
    "a key to another block": (lambda c, h, t: c._block_of.__setitem__(c._entry[t][0], h),
                               r"^cached block \d of pool 'gpu': its key does not map back to it$"),
    "a short block": (lambda c, h, t: c._entry.__setitem__(h, (*c._entry[h][:2], (1,))),
                      r"^cached block \d of pool 'gpu' holds 1 tokens, not a full block$"),
    "in use and parked": (lambda c, h, t: c.allocator._refs.__setitem__(h, 1),
                          r"^cached block \d of pool 'gpu': 1 users, parked: True$"),
    "unused, not parked": (lambda c, h, t: c._parked.pop(t),
                           r"^cached block \d of pool 'gpu': 0 users, parked: False$"),
    "an orphan": (lambda c, h, t: c._entry.__setitem__(t, (c._entry[t][0], 99, c._entry[t][2])),
                  r"^cached block \d of pool 'gpu': its parent block 99 is not cached$"),
    "parent evicted first": (lambda c, h, t: c._parked.move_to_end(h, last=False),
                             r"^cached block \d of pool 'gpu' would be evicted after its parent"),
    "a wrong key": (lambda c, h, t: c._entry.__setitem__(h, (c._entry[h][0], None, (7, 7))),
                    r"^cached block \d of pool 'gpu': key does not match its tokens and parent$"),
    "a parked stranger": (lambda c, h, t: c._parked.__setitem__(3, None),
                          r"^parked block 3 of pool 'gpu' is not cached$"),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_each_invariant_names_what_is_wrong(case):
    mgr, cache, head, tail = cached_pair()
    cache.check_invariants()
    corrupt, message = CORRUPTIONS[case]
    corrupt(cache, head, tail)
    with pytest.raises(InvariantError, match=message):
        cache.check_invariants()


def test_a_child_in_use_needs_its_parent_in_use():
    mgr, cache, head, tail = cached_pair()
    cache._parked.pop(tail)
    cache.allocator._refs[tail] = 1
    with pytest.raises(InvariantError, match=rf"block {tail} .* is in use but its parent {head}"):
        cache.check_invariants()


def test_a_standalone_prefix_cache_evicts_in_lru_order():
    allocator = BlockAllocator(3)
    cache = PrefixCache(allocator, 2)
    for block in (2, 0, 1):
        cache._entry[block] = (block, None, (block, block))
        cache._block_of[block] = block
        cache.park(block)
    assert cache.evict(2) == [2, 0] and cache.num_cached == 1


# --- the contiguous baselines --------------------------------------------------------------


def test_fixed_slots_cut_only_whole_slots():
    for capacity, slots in ((10, 2), (9, 1), (14, 2)):  # a tail shorter than a slot is no slot
        pool = FixedSlots(capacity, 5)
        assert [pool.allocate(5) for _ in range(slots)] == list(range(0, 5 * slots, 5))
        assert not pool.can_allocate(1)
        assert pool.used_blocks() == [(o, 5) for o in range(0, 5 * slots, 5)]
    assert FixedSlots(9, 5).free_extents() == [(0, 5), (5, 4)]  # a slot, then the tail
    assert FixedSlots(10, 5).free_extents() == [(0, 5), (5, 5)]  # no empty tail
    for args, name in (((10.0, 5), "capacity"), ((10, 5.0), "slot_size")):
        with pytest.raises(ValueError, match=f"^{name}=.* must be an integer$"):
            FixedSlots(*args)
    with pytest.raises(ValueError, match=r"size=2.5 must be an integer"):
        FixedSlots(10, 5).block_size(2.5)


def test_buddy_blocks_merge_back_whatever_the_order_of_frees():
    with pytest.raises(ValueError, match=r"^capacity=16.0 must be an integer$"):
        BuddyAllocator(16.0)
    buddy = BuddyAllocator(16)
    with pytest.raises(ValueError, match=r"^size=2.5 must be an integer$"):
        buddy.block_size(2.5)
    offsets = [buddy.allocate(4) for _ in range(4)]
    for offset in (offsets[1], offsets[0], offsets[3], offsets[2]):
        buddy.free(offset)
    assert buddy.free_extents() == [(0, 16)]
    assert buddy.allocate(16) == 0


def test_baselines_are_named_as_in_the_paper():
    with pytest.raises(ValueError, match="^max_seq_len=0 must be > 0$"):
        orca(64, "max", 0)
    with pytest.raises(ValueError, match="^max_seq_len=2.5 must be an integer$"):
        orca(64, "max", 2.5)
    assert ContiguousKV(BuddyAllocator(64), "pow2", 16).name == "BuddyAllocator (pow2)"


def test_admission_stores_one_to_all_of_a_requests_tokens():
    kv = orca(64, "oracle", 16)
    request = Request(0, 0.0, 3, 5)
    for bad in (0, 9):
        with pytest.raises(ValueError, match=rf"num_tokens={bad} must lie in \[1, 8\]"):
            kv.admit(request, bad)
    kv.admit(request, 8)  # a whole request, as after a recomputation
    assert kv.breakdown().tokens == 8
    assert static_max(64, 16).name == "Static (Max)"
    assert [orca(64, r, 16).name for r in ("max", "pow2", "oracle")] == [
        "Orca (Max)", "Orca (Pow2)", "Orca (Oracle)"]


@pytest.mark.parametrize("make", [lambda: static_max(64, 16), lambda: orca(64, "pow2", 16),
                                  lambda: orca(60, "oracle", 16)])
def test_the_slot_map_counts_what_the_breakdown_says(make, seed_offset):
    """Slot by slot (slot_map) and in totals (breakdown), every state, with and without a
    request waiting; a free extent exactly the waiting request's size is free, not external."""
    kv = make()
    rng = np.random.default_rng(seed_offset)
    waiting = [None, Request(99, 0.0, 3, 5), Request(98, 0.0, 1, 15), Request(97, 0.0, 2, 2)]
    live, next_id = [], 0
    for _ in range(40):
        request = Request(next_id, 0.0, int(rng.integers(1, 6)), int(rng.integers(1, 9)))
        if rng.random() < 0.6 and kv.can_admit(request, request.prompt_len):
            kv.admit(request, request.prompt_len)
            live.append(request.id)
            next_id += 1
        elif live and rng.random() < 0.5:
            kv.free(live.pop(int(rng.integers(len(live)))))
        for rid in live:
            if kv.can_append(rid):
                kv.append(rid)
        for w in waiting:
            slots = kv.slot_map(w)
            assert slots.dtype == np.int8 and slots.shape == (kv.capacity,)
            counts = np.bincount(slots, minlength=len(CATEGORIES))
            assert dict(zip(CATEGORIES, counts.tolist())) == vars(kv.breakdown(w))


def test_a_shared_full_last_block_is_not_copied_on_append():
    mgr = KVCacheManager(2, 4)
    mgr.allocate("a", [1, 2, 3, 4])
    mgr.fork("a", "b")
    assert mgr.can_append("b", 1)  # one free block is enough
    mgr.append("b", [5])  # b's new token starts a block of its own: nothing to copy
    assert mgr.take_copies() == [] and mgr.num_used_blocks == 2
    assert mgr.block_table("b")[0] == mgr.block_table("a")[0]


def test_swaps_are_recorded_per_sequence_with_their_pairs():
    mgr = KVCacheManager(4, 2, 4, record_events=True)
    mgr.allocate("a", [1, 2, 3])
    mgr.fork("a", "b")
    gpu = mgr.block_table("a")
    out = dict(mgr.swap_out("a", "b"))  # the two shared blocks move once
    back = dict(mgr.swap_in("a", "b"))
    events = [e for e in mgr.events if e.kind.startswith("swap")]
    assert [(e.kind, e.seq_id) for e in events] == [
        ("swap_out", "a"), ("swap_out", "b"), ("swap_in", "a"), ("swap_in", "b")]
    cpu = [out[b] for b in gpu]
    assert all(e.blocks == tuple(cpu) and e.pairs == tuple(zip(gpu, cpu)) for e in events[:2])
    new = [back[b] for b in cpu]
    assert all(e.blocks == tuple(new) and e.pairs == tuple(zip(cpu, new)) for e in events[2:])


def test_a_swapped_sequence_keeps_its_tokens_and_an_unknown_one_is_named():
    mgr = KVCacheManager(4, 2, 4)
    mgr.allocate("a", [1, 2, 3])
    mgr.swap_out("a")
    assert mgr.num_tokens("a") == 3 and mgr.token_ids("a") == [1, 2, 3]
    with pytest.raises(UnknownSequence, match=r"^sequence 'b' is not allocated \(never, or "
                                              r"already freed\)$"):
        mgr.num_tokens("b")


def test_appends_are_recorded_with_the_blocks_they_take():
    mgr = KVCacheManager(4, 2, record_events=True)
    mgr.allocate("a", [1])
    first = mgr.block_table("a")[0]
    mgr.append("a", [2])  # fills its own last block: no new block
    mgr.append("a", [3])  # after a full block: a fresh one
    appends = [(e.seq_id, e.blocks, e.num_tokens) for e in mgr.events if e.kind == "append"]
    assert appends == [("a", (), 1), ("a", (mgr.block_table("a")[1],), 1)]
    assert mgr.block_table("a")[0] == first
    blocks = mgr.block_table("a")
    mgr.free("a")
    last = mgr.events[-1]
    assert (last.kind, last.seq_id, last.blocks) == ("free", "a", tuple(blocks[::-1]))


def test_only_a_block_in_use_can_be_released():
    allocator = BlockAllocator(4)
    allocator.allocate(1)
    for block in (1, 4, -1):  # free, past the pool, before it
        with pytest.raises(StateError, match=rf"^block {block} of pool 'gpu' is already free$"):
            allocator.release([block])
    assert allocator.num_free == 3


def test_a_block_released_more_times_than_it_has_users_is_refused():
    allocator = BlockAllocator(4)
    (block,) = allocator.allocate(1)
    with pytest.raises(StateError, match=rf"^block {block} of pool 'gpu' has 1 user\(s\), "
                                         "cannot release it 2 times$"):
        allocator.release([block, block])
    assert allocator.refcount(block) == 1


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_prompt_that_fills_the_pool_exactly_fits_and_one_more_block_is_named(prefix_caching):
    mgr = KVCacheManager(3, 2, enable_prefix_caching=prefix_caching)
    mgr.allocate("fits", [1, 2, 3, 4, 5, 6])  # three blocks of three free
    mgr.free("fits")
    with pytest.raises(OutOfBlocks, match=r"^sequence 'big' needs 4 blocks, pool 'gpu' has 3 "):
        mgr.allocate("big", [1, 2, 3, 4, 5, 6, 7])
    mgr.check_invariants()


def test_a_prompt_sharing_blocks_in_use_needs_only_its_own():
    mgr = KVCacheManager(3, 2, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3, 4])  # two blocks in use, one free
    assert mgr.allocate("b", [1, 2, 3, 4, 5]) == 4  # shares both, takes the last free block
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


def test_a_prompt_that_hits_caches_its_own_blocks_after_the_hits():
    mgr = KVCacheManager(8, 2, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3, 4, 0])
    assert mgr.allocate("b", [1, 2, 3, 4, 5, 6, 0]) == 4  # and caches [5, 6] after them
    assert mgr.cached_prefix([1, 2, 3, 4, 5, 6, 9]) == 6


def test_a_first_chunk_counts_its_whole_prompt_in_the_stats():
    mgr = KVCacheManager(8, 2, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3], prompt_len=10)  # a chunked prefill's first 3 of 10 tokens
    assert (mgr.prefix_stats.hits, mgr.prefix_stats.misses) == (0, 10)


def test_an_allocation_is_recorded_with_its_cached_tokens_and_no_swap_space_is_the_default():
    mgr = KVCacheManager(4, 2, enable_prefix_caching=True, record_events=True)
    mgr.allocate("x", [1, 2, 3])
    mgr.allocate("y", [1, 2, 3])  # hits x's full block
    allocs = [(e.seq_id, e.num_tokens, e.cached_tokens) for e in mgr.events if e.kind == "allocate"]
    assert allocs == [("x", 3, 0), ("y", 3, 2)]
    assert mgr.cpu.num_blocks == 0 and not mgr.can_swap_out("x")


@pytest.mark.parametrize("args, message", [
    ((2.5, 4), r"^num_gpu_blocks=2.5 must be an integer$"),
    ((0, 4), r"^num_gpu_blocks=0 must be > 0$"),
    ((4, 0), r"^block_size=0 must be > 0$"),
    ((4, 2.0), r"^block_size=2.0 must be an integer$"),
])
def test_a_manager_names_its_bad_size(args, message):
    with pytest.raises(ValueError, match=message):
        KVCacheManager(*args)


def test_a_pool_takes_numpy_counts_and_names_a_bad_one():
    """Counts that are not Python ints (a numpy integer, say) take the checked path."""
    assert BlockAllocator(0).num_free == 0  # an empty CPU pool is a pool
    for size, message in ((2.5, r"^num_blocks=2.5 must be an integer$"),
                          (-1, r"^num_blocks=-1 must be >= 0$")):
        with pytest.raises(ValueError, match=message):
            BlockAllocator(size)
    allocator = BlockAllocator(3)
    assert allocator.allocate(np.int64(0)) == [] and allocator.allocate(np.int64(2)) == [0, 1]
    for n, message in ((-1, r"^n=-1 must be >= 0$"), (1.0, r"^n=1.0 must be an integer$")):
        with pytest.raises(ValueError, match=message):
            allocator.allocate(n)
    assert allocator.num_free == 1


@pytest.mark.parametrize("seed", range(6))
def test_the_blocks_needed_are_the_blocks_taken(seed):
    """For any group of running sequences, forked so that they share partly filled blocks,
    ``blocks_needed`` for any token counts is exactly what ``allocate_slots`` then takes from
    the pool; and a swapped group's ``blocks_to_swap_in`` is what its return and one decode
    token each take."""
    rng = np.random.default_rng(seed)
    for _ in range(20):
        mgr = KVCacheManager(64, 4, num_cpu_blocks=64)
        mgr.allocate("s0", list(range(int(rng.integers(1, 12)))))
        seqs = ["s0"]
        for i in range(1, int(rng.integers(2, 5))):  # forks, each of a live sequence
            mgr.fork(seqs[int(rng.integers(len(seqs)))], f"s{i}")
            seqs.append(f"s{i}")
            for sid in rng.permutation(seqs)[:2]:  # some grow, so blocks are shared in part
                mgr.append(sid, [7] * int(rng.integers(0, 3)) or [7])
        counts = {sid: int(rng.integers(1, 7)) for sid in rng.permutation(seqs)}
        need, free = mgr.blocks_needed(counts), mgr.num_free_blocks
        assert mgr.allocate_slots({sid: [1] * n for sid, n in counts.items()}) is not None
        assert free - mgr.num_free_blocks == need, counts
        mgr.take_copies()
        mgr.swap_out(*seqs)
        back, free = mgr.blocks_to_swap_in(*seqs), mgr.num_free_blocks
        mgr.swap_in(*seqs)
        assert mgr.allocate_slots({sid: [2] for sid in seqs}) is not None
        assert free - mgr.num_free_blocks == back
        mgr.check_invariants()


def test_a_truncation_records_the_tokens_and_blocks_it_gave_back():
    mgr = KVCacheManager(8, 4, record_events=True)
    mgr.allocate("a", list(range(5)))
    mgr.append("a", [5, 6, 7, 8, 9], num_speculative=5)  # 10 tokens in blocks 0, 1, 2
    blocks = mgr.block_table("a")
    mgr.truncate("a", 3)
    event = mgr.events[-1]
    assert (event.kind, event.blocks, event.num_tokens) == ("truncate", (blocks[2], blocks[1]), 7)
    assert event.seq_id == "a"
    # released last block first, so the block right after the kept ones is the next one out
    mgr.allocate("b", [1])
    assert mgr.block_table("b") == [blocks[1]]


@pytest.mark.parametrize("keep, message", [
    (2.5, r"^num_tokens=2.5 must be an integer$"),
    (0, r"^num_tokens=0 must be > 0$"),
    (3, r"^sequence 'a': cannot keep 3 of its 10 tokens; need 4 <= num_tokens <= 10 \(its "
        r"first 4 are in cached blocks\)$"),
    (11, r"^sequence 'a': cannot keep 11 of its 10 tokens; need 4 <= num_tokens <= 10"),
])
def test_a_truncation_it_cannot_do_is_named(keep, message):
    mgr = KVCacheManager(8, 4, enable_prefix_caching=True)
    mgr.allocate("a", list(range(5)))  # its first block is cached: 4 verified tokens
    mgr.append("a", [5, 6, 7, 8, 9], num_speculative=5)
    with pytest.raises(ValueError, match=message):
        mgr.truncate("a", keep)
    assert mgr.num_tokens("a") == 10


def test_a_truncation_without_a_prefix_cache_has_no_cached_tokens_to_keep():
    """Without prefix caching no block is cached, so the bound a refused truncation names
    starts at 0 tokens, not at some count of verified ones."""
    mgr = KVCacheManager(4, 4)
    mgr.allocate("a", list(range(6)))
    with pytest.raises(ValueError, match=r"^sequence 'a': cannot keep 7 of its 6 tokens; need 0 "
                                         r"<= num_tokens <= 6 \(its first 0 are in cached "
                                         r"blocks\)$"):
        mgr.truncate("a", 7)
    assert mgr.num_tokens("a") == 6


def test_every_sharer_of_a_partly_filled_block_but_the_last_copies_it():
    """Copy-on-write counted by hand: three sequences share a last block holding 1 token.
    When all three decode, the first two to append copy it and the third finds it its own:
    2 blocks. When two of them decode, the third still holds the block, so both copy: 2 again.
    A pool with 1 free block refuses such a step (nothing changes) rather than run out halfway."""
    mgr = KVCacheManager(3, 4)
    mgr.allocate("a", list(range(5)))  # 2 blocks, the last holding 1 token; 1 block free
    mgr.fork("a", "b")
    mgr.fork("a", "c")
    assert mgr.blocks_needed({"a": 1, "b": 1, "c": 1}) == 2
    assert mgr.blocks_needed({"a": 1, "b": 1}) == 2
    assert mgr.allocate_slots({"a": [5], "b": [6], "c": [7]}) is None
    assert [mgr.num_tokens(s) for s in "abc"] == [5, 5, 5] and mgr.num_free_blocks == 1
    assert mgr.take_copies() == []
    mgr.free("c")  # now a and b share it: the first copies, the second keeps it
    assert mgr.blocks_needed({"a": 1, "b": 1}) == 1
    assert mgr.allocate_slots({"a": [5], "b": [6]}) == {"a": 5, "b": 5}
    assert mgr.num_free_blocks == 0 and len(mgr.take_copies()) == 1
    mgr.check_invariants()


def test_a_shared_prompt_of_one_sequence_is_allocated_as_that_sequence_alone():
    """A group of one (a request with n=1) sharing its prompt with nobody: allocate_shared
    gives what allocate gives, its tokens in blocks_for(10) = 3 blocks, computing from 0."""
    mgr = KVCacheManager(8, 4)
    assert mgr.allocate_shared(["a"], [list(range(10))], shared=8) == [0]
    assert mgr.token_ids("a") == list(range(10)) and mgr.num_used_blocks == 3
    mgr.check_invariants()
