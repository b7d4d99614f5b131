"""The block allocator: free list order, all-or-nothing allocation, refcounts that never go
below zero, and invariant checks that catch a corrupted pool."""

import pytest

from pagedlab.memory import BlockAllocator, InvariantError, KVCacheManager, OutOfBlocks, StateError


def test_a_fresh_pool_hands_out_blocks_in_order_and_reuses_the_last_freed():
    pool = BlockAllocator(6)
    assert pool.allocate(2) == [0, 1] and pool.allocate(3) == [2, 3, 4]
    pool.release([3])
    assert pool.allocate(2) == [3, 5]  # the free list is a stack
    assert (pool.num_free, pool.num_used) == (0, 6)
    pool.check_invariants()


def test_running_out_is_all_or_nothing_and_names_the_sequence():
    pool = BlockAllocator(4)
    pool.allocate(3, owner="req-1")
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate(3, owner="req-7")
    err = info.value
    assert isinstance(err, RuntimeError)
    assert str(err) == "sequence 'req-7' needs 3 blocks, pool 'gpu' has 1 free"
    assert (err.needed, err.free, err.pool, err.owner) == (3, 1, "gpu", "req-7")
    assert pool.num_free == 1 and pool.allocate(1) == [3]  # nothing was half taken


def test_an_empty_cpu_pool_says_so():
    with pytest.raises(OutOfBlocks, match="needs 1 block, pool 'cpu' has 0 free"):
        BlockAllocator(0, name="cpu").allocate(1, owner=("req", 3))


@pytest.mark.parametrize("n, ok", [(0, True), (-1, False), (1.5, False), (True, False)])
def test_allocate_checks_its_count(n, ok):
    pool = BlockAllocator(2)
    if ok:
        assert pool.allocate(n) == []
    else:
        with pytest.raises(ValueError, match="n="):
            pool.allocate(n)
    assert pool.num_free == 2


def test_releasing_a_free_block_names_it_and_changes_nothing():
    pool = BlockAllocator(16)
    blocks = pool.allocate(13)
    pool.release([12])
    before = (pool._refs.copy(), pool._free.copy())
    with pytest.raises(StateError, match="block 12 of pool 'gpu' is already free"):
        pool.release([5, 12])  # 5 is in use: it must not be released either
    with pytest.raises(StateError, match="block 13 of pool 'gpu' is already free"):
        pool.release([13])  # never allocated
    with pytest.raises(StateError, match="block -1 of pool 'gpu'"):
        pool.release([-1])  # not an index from the end
    assert (pool._refs, pool._free) == before
    assert min(pool._refs) == 0 and pool.refcount(blocks[5]) == 1


def test_releasing_one_block_twice_in_one_call_is_refused_whole():
    pool = BlockAllocator(4)
    a, b = pool.allocate(2)
    pool.share([b])
    with pytest.raises(StateError, match=f"block {a} of pool 'gpu' has 1 user"):
        pool.release([b, a, a])
    assert (pool.refcount(a), pool.refcount(b)) == (1, 2)
    pool.release([b, b])  # two users, two releases: fine
    assert pool.refcount(b) == 0


def test_share_counts_users_and_a_block_is_freed_by_its_last_user():
    pool = BlockAllocator(3)
    (block,) = pool.allocate(1)
    pool.share([block])
    pool.share([block])
    assert pool.refcount(block) == 3
    pool.release([block])
    pool.release([block])
    assert pool.num_free == 2  # still used
    pool.release([block])
    assert pool.num_free == 3 and pool.refcount(block) == 0


def test_sharing_or_reviving_in_the_wrong_state_is_refused():
    pool = BlockAllocator(3)
    (used,) = pool.allocate(1)
    with pytest.raises(StateError, match="block 2 of pool 'gpu' is not in use"):
        pool.share([used, 2])
    assert pool.refcount(used) == 1
    with pytest.raises(StateError, match=f"block {used} of pool 'gpu' is not parked"):
        pool.revive(used)


# --- mutation checks: a broken allocator must not get past check_invariants -------------------


def test_check_invariants_catches_a_skipped_decrement(monkeypatch):
    mgr = KVCacheManager(8, 4)
    mgr.allocate("a", range(10))
    release = BlockAllocator.release
    monkeypatch.setattr(BlockAllocator, "release", lambda self, blocks: release(self, blocks[1:]))
    mgr.free("a")  # its last block keeps a phantom user
    with pytest.raises(InvariantError, match="block 2 of pool 'gpu' has refcount 1 but 0"):
        mgr.check_invariants()


def test_check_invariants_catches_a_double_free(monkeypatch):
    mgr = KVCacheManager(8, 4)
    mgr.allocate("a", range(10))
    release = BlockAllocator.release

    def double_free(self, blocks):
        release(self, blocks)
        self._free.append(blocks[0])  # pushed on the free list a second time

    monkeypatch.setattr(BlockAllocator, "release", double_free)
    mgr.free("a")
    with pytest.raises(InvariantError, match="is twice on the free list of pool 'gpu'"):
        mgr.check_invariants()


def test_check_invariants_catches_a_block_both_free_and_used():
    pool = BlockAllocator(4)
    pool.allocate(2)
    pool._free.append(1)
    with pytest.raises(InvariantError, match="block 1 is on the free list of pool 'gpu' but"):
        pool.check_invariants()
