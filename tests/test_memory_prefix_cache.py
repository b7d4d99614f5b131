"""Prefix caching: hits on freed and live prompts, LRU eviction (tail before head), collisions
that never return a wrong block, counters, and failures that change nothing."""

import pytest

from pagedlab.memory import KVCacheManager, OutOfBlocks, PrefixStats, block_key
from pagedlab.memory import prefix_cache


def manager(num_gpu_blocks=8, block_size=2, **kwargs):
    return KVCacheManager(num_gpu_blocks, block_size, enable_prefix_caching=True, **kwargs)


def evicted(mgr):
    return [e.blocks for e in mgr.events if e.kind == "evict"]


def test_a_freed_prompt_is_a_prefix_hit_for_the_next_request():
    mgr = manager(block_size=4)
    prompt = list(range(10))  # two full blocks and a partial one
    assert mgr.allocate("a", prompt) == 0
    blocks = mgr.block_table("a")
    mgr.free("a")
    assert mgr.num_free_blocks == 8 and mgr.num_cached_blocks == 2  # parked, not lost
    assert mgr.allocate("b", prompt + [10]) == 8  # the full blocks; the partial one is private
    assert mgr.block_table("b")[:2] == blocks[:2]
    assert mgr.prefix_stats == PrefixStats(hits=8, misses=10 + 3, evictions=0)
    assert mgr.prefix_stats.hit_rate == pytest.approx(8 / 21)
    mgr.check_invariants()


def test_a_live_prefix_is_shared():
    mgr = manager()
    mgr.allocate("a", [1, 1, 2, 2, 3])
    assert mgr.allocate("b", [1, 1, 2, 2, 4, 4]) == 4
    assert mgr.block_table("b")[:2] == mgr.block_table("a")[:2]
    assert mgr.gpu.refcount(mgr.block_table("a")[0]) == 2 and mgr.num_used_blocks == 4
    assert mgr.usage().tokens_stored == 5 + 2  # the shared prefix counts once
    mgr.check_invariants()


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute():
    mgr = manager()
    mgr.allocate("a", [1, 1, 2, 2])
    mgr.free("a")
    assert mgr.allocate("b", [1, 1, 2, 2]) == 2  # not 4: the model needs the last token's logits
    assert mgr.block_table("b") == [0, 2] and mgr.num_cached_blocks == 2  # block 2 duplicates 1
    mgr.check_invariants()


def test_decoded_tokens_are_cached_once_their_block_is_full():
    mgr = manager()
    mgr.allocate("a", [1])
    mgr.append("a", [1, 2])
    mgr.append("a", [2, 3])
    assert mgr.num_cached_blocks == 2
    mgr.free("a")
    assert mgr.allocate("b", [1, 1, 2, 2, 5]) == 4
    mgr.check_invariants()


def test_one_token_at_a_time_each_filled_block_is_cached():
    """Decode's path: single tokens into the last block, filling it, then opening the next."""
    mgr = KVCacheManager(8, 4, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3])
    for token in range(4, 11):
        mgr.append("a", [token])
        assert mgr.num_cached_blocks == mgr.num_tokens("a") // 4
    assert mgr.block_table("a") == [0, 1, 2]
    mgr.free("a")
    assert mgr.allocate("b", list(range(1, 10))) == 8  # both blocks the decode filled
    mgr.check_invariants()


def test_parked_blocks_count_as_free_and_are_taken_only_when_the_free_list_is_empty():
    mgr = manager(num_gpu_blocks=6, record_events=True)
    mgr.allocate("A", [1, 1, 2, 2])  # blocks 0, 1
    mgr.free("A")  # parked tail first: 1, 0
    mgr.allocate("B", [3, 3, 4, 4])  # blocks 2, 3
    mgr.free("B")  # parked: 1, 0, 3, 2
    assert mgr.num_free_blocks == 6 and mgr.can_allocate(12)
    mgr.allocate("C", [5, 5, 6, 6])  # the two never-used blocks: no eviction
    assert mgr.block_table("C") == [4, 5] and evicted(mgr) == []
    mgr.allocate("D", [7])  # evicts the least recently used: A's tail
    assert mgr.block_table("D") == [1] and evicted(mgr) == [(1,)]
    assert mgr.allocate("E", [1, 1, 2, 2, 9]) == 2  # A's head is still cached
    assert evicted(mgr) == [(1,), (3, 2)]  # then B, tail before head
    assert mgr.block_table("E") == [0, 2, 3]
    assert mgr.prefix_stats == PrefixStats(hits=2, misses=4 + 4 + 4 + 1 + 3, evictions=3)
    assert [e.seq_id for e in mgr.events if e.kind == "evict"] == [None, None]
    mgr.check_invariants()


def test_a_hit_makes_a_block_recently_used():
    mgr = manager(num_gpu_blocks=5, record_events=True)
    for sid, prompt in (("A", [1, 1, 2, 2]), ("B", [3, 3, 4, 4])):
        mgr.allocate(sid, prompt)
        mgr.free(sid)  # parked: A1, A0, B1, B0 = blocks 1, 0, 3, 2
    assert mgr.allocate("X", [1, 1, 8]) == 2  # a hit on A's head ...
    mgr.free("X")  # ... parks it last: 1, 3, 2, 0
    mgr.allocate("Y", [9] * 10)  # five blocks: the free one, then evict all four
    assert evicted(mgr) == [(1, 3, 2, 0)]
    assert mgr.num_cached_blocks == 5  # Y's own blocks, now
    mgr.check_invariants()


def test_running_out_with_parked_hits_changes_nothing():
    mgr = manager(num_gpu_blocks=3)
    mgr.allocate("A", [1, 1, 2, 2])
    mgr.free("A")  # blocks 1, 0 parked, block 2 free
    before = (list(mgr.prefix_cache._parked), mgr.prefix_stats, mgr.num_cached_blocks)
    with pytest.raises(OutOfBlocks, match="sequence 'B' needs 4 blocks, pool 'gpu' has 3 free"):
        mgr.allocate("B", [1, 1, 2, 2, 3, 3, 4])  # 2 hits (parked) + 2 new blocks
    assert (list(mgr.prefix_cache._parked), mgr.prefix_stats, mgr.num_cached_blocks) == before
    assert mgr.allocate("C", [1, 1, 2, 2, 3]) == 4  # exactly fits: hits revived, one new
    mgr.check_invariants()


def test_a_swapped_out_sequence_leaves_its_prefix_cached():
    mgr = manager(num_cpu_blocks=4)
    mgr.allocate("a", [1, 1, 2, 2, 3])
    mgr.swap_out("a")
    assert mgr.allocate("b", [1, 1, 2, 2, 4]) == 4  # served from the parked GPU blocks
    mgr.swap_in("a")
    assert mgr.token_ids("a") == [1, 1, 2, 2, 3]
    mgr.check_invariants()


# --- hash collisions: a hit compares tokens and parent, never just the key --------------------


def test_colliding_keys_never_return_another_prompts_blocks(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: 0)  # every key collides
    mgr = manager()
    mgr.allocate("a", [1, 1, 2, 2, 3])
    a_blocks = mgr.block_table("a")
    mgr.free("a")
    assert mgr.allocate("b", [5, 5, 2, 2, 3]) == 0  # same key as a's first block: a miss
    assert mgr.block_table("b")[0] != a_blocks[0] and mgr.gpu.refcount(a_blocks[0]) == 0
    assert mgr.num_cached_blocks == 1  # only one block can hold key 0
    assert mgr.allocate("c", [1, 1, 2, 2, 3]) == 2  # a's first block, verified by its tokens
    mgr.check_invariants()


def test_a_block_is_a_hit_only_after_its_own_parent(monkeypatch):
    """Keys that ignore the parent make [2, 2] after [1, 1] collide with [2, 2] after [4, 4]."""
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: hash(tokens))
    mgr = manager()
    mgr.allocate("a", [1, 1, 2, 2, 0])
    mgr.allocate("d", [4, 4, 0])
    a_blocks, d_blocks = mgr.block_table("a"), mgr.block_table("d")
    mgr.free("a")
    mgr.free("d")
    assert mgr.allocate("b", [4, 4, 2, 2, 9]) == 2  # d's [4, 4]; a's [2, 2] has another parent
    assert mgr.block_table("b")[0] == d_blocks[0] and mgr.block_table("b")[1] != a_blocks[1]
    mgr.check_invariants()


def test_keys_chain_the_whole_prefix():
    first = block_key(None, (1, 2))
    assert block_key(first, (3, 4)) != block_key(block_key(None, (9, 9)), (3, 4))
    keys = []
    manager().prefix_cache.extend_keys(keys, [1, 2, 3, 4, 5])
    assert keys == [first, block_key(first, (3, 4))]


def test_extending_keys_returns_the_new_blocks_tokens():
    keys, cache = [], manager().prefix_cache
    assert cache.extend_keys(keys, [1, 2, 3, 4, 5]) == [(1, 2), (3, 4)]
    assert cache.extend_keys(keys, [1, 2, 3, 4, 5, 6, 7]) == [(5, 6)]  # only the new block
    assert keys[2] == block_key(keys[1], (5, 6)) and cache.extend_keys(keys, [1, 2, 3]) == []


def test_counters_without_prefix_caching():
    mgr = KVCacheManager(8, 2)
    assert mgr.prefix_stats == PrefixStats(0, 0, 0) and mgr.prefix_stats.hit_rate == 0.0
    mgr.allocate("a", [1, 1, 2])
    mgr.free("a")
    assert mgr.allocate("b", [1, 1, 2]) == 0
    assert mgr.prefix_stats == PrefixStats(hits=0, misses=6, evictions=0)
    assert mgr.num_cached_blocks == 0
