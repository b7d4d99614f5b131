"""Contiguous KV baselines: buddy allocator, fixed slots, reservation rules, waste categories."""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlab.memory.contiguous import (
    CATEGORIES,
    BuddyAllocator,
    FixedSlots,
    OutOfSlots,
    next_pow2,
    orca,
    static_max,
)


def request(id, prompt_len, output_len):
    return SimpleNamespace(id=id, prompt_len=prompt_len, output_len=output_len)


# --- buddy allocator ---------------------------------------------------------------------------


def test_buddy_splits_a_non_power_of_two_pool_into_roots_and_merges_back():
    b = BuddyAllocator(100)  # 100 = 64 + 32 + 4
    assert b.free_extents() == [(0, 64), (64, 32), (96, 4)]
    offsets = [b.allocate(s) for s in (3, 10, 30, 17)]
    # 3 -> the 4-slot root; 10 -> 16 split from the 32 root; 30 -> 32 from the 64 root, which
    # leaves its buddy (32, 32) free; 17 -> that 32 block.
    assert offsets == [96, 64, 0, 32]
    assert b.used_blocks() == [(0, 32), (32, 32), (64, 16), (96, 4)]
    assert b.free_extents() == [(80, 16)]
    assert (b.num_used, b.num_free) == (84, 16)
    for o in offsets:
        b.free(o)
    assert b.free_extents() == [(0, 64), (64, 32), (96, 4)]


def test_buddy_merges_only_with_its_own_buddy():
    b = BuddyAllocator(64)
    a, c, d, e = (b.allocate(16) for _ in range(4))
    assert (a, c, d, e) == (0, 16, 32, 48)
    b.free(c)
    b.free(d)  # 16 and 32 are neighbours but not buddies: no merge
    assert b.free_extents() == [(16, 16), (32, 16)]
    assert not b.can_allocate(17)
    b.free(a)  # 0 and 16 merge into 0..32
    assert b.free_extents() == [(0, 32), (32, 16)]
    assert b.allocate(32) == 0


def test_buddy_errors_name_the_offset_and_size():
    b = BuddyAllocator(64)
    o = b.allocate(8)
    b.free(o)
    with pytest.raises(ValueError, match=r"offset=0\).*double free"):
        b.free(o)
    with pytest.raises(ValueError, match="offset=5"):
        b.free(5)
    b.allocate(64)
    with pytest.raises(OutOfSlots, match=r"size=1\).*largest free block: 0"):
        b.allocate(1)
    with pytest.raises(ValueError, match="size=0"):
        b.allocate(0)
    with pytest.raises(ValueError, match="capacity"):
        BuddyAllocator(0)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 300), ops=st.lists(st.tuples(st.booleans(), st.integers(1, 80))))
def test_buddy_blocks_never_overlap_and_free_plus_used_is_capacity(capacity, ops):
    b = BuddyAllocator(capacity)
    roots = b.free_extents()
    live = []
    for alloc, value in ops:
        if alloc:
            if b.can_allocate(value):
                offset = b.allocate(value)
                assert offset % next_pow2(value) == 0  # buddy blocks are aligned to their size
                live.append(offset)
            else:
                with pytest.raises(OutOfSlots):
                    b.allocate(value)
        elif live:
            b.free(live.pop(value % len(live)))
        extents = sorted(b.used_blocks() + b.free_extents())
        assert all(o1 + s1 <= o2 for (o1, s1), (o2, _) in zip(extents, extents[1:]))
        assert sum(s for _, s in extents) == capacity
        assert b.num_used + sum(s for _, s in b.free_extents()) == capacity
    for offset in live:
        b.free(offset)
    assert b.free_extents() == roots  # every merge happened


# --- fixed slots -------------------------------------------------------------------------------


def test_fixed_slots_take_whole_slots_and_leave_a_tail():
    f = FixedSlots(70, 32)
    assert f.free_extents() == [(0, 32), (32, 32), (64, 6)]
    assert f.allocate(5) == 0 and f.block_size(5) == 32
    assert f.allocate(32) == 32
    assert not f.can_allocate(1)
    with pytest.raises(OutOfSlots, match="size=1"):
        f.allocate(1)
    with pytest.raises(ValueError, match="size=33 exceeds slot_size=32"):
        f.block_size(33)
    f.free(0)
    with pytest.raises(ValueError, match="offset=0"):
        f.free(0)
    assert f.free_extents() == [(0, 32), (64, 6)] and f.num_free == 38


# --- reservation rules and categories, by hand -------------------------------------------------


@pytest.mark.parametrize("reserve, reserved, block", [
    ("max", 32, 32),  # the model's max length
    ("pow2", 5 + 8, 16),  # prompt + next power of two of the output, in a 16 block
    ("oracle", 5 + 6, 16),  # prompt + true output, in a 16 block
])
def test_orca_categories_for_one_request(reserve, reserved, block):
    kv = orca(64, reserve, max_seq_len=32)
    a = request(0, 5, 6)
    kv.admit(a, 5)
    kv.append(0)  # 6 tokens stored, 5 still to come, final length 11
    b = kv.breakdown()
    assert b.as_dict() == dict(tokens=6, reservation=5, overreservation=reserved - 11,
                               rounding=block - reserved, external=0, free=64 - block)
    assert b.internal == block - 11 and b.capacity == 64


def test_pow2_reserves_as_in_the_paper_example():
    # Kwon et al. 6.1: "if the true output length is 25, it reserves 32 positions for outputs"
    assert orca(4096, "pow2", 2048).reservation_for(request(0, 100, 25)) == 132
    assert orca(4096, "pow2", 2048).reservation_for(request(0, 2000, 40)) == 2048  # capped


def test_external_fragmentation_is_free_space_too_small_for_the_next_request():
    kv = orca(48, "max", max_seq_len=32)  # roots 32 and 16
    kv.admit(request(0, 3, 3), 3)
    waiting = request(1, 2, 2)  # needs a 32 block; only the 16 root is free
    assert kv.breakdown(waiting).external == 16 and kv.breakdown(waiting).free == 0
    assert kv.breakdown().external == 0 and kv.breakdown().free == 16  # nobody waits
    oracle = orca(48, "oracle", max_seq_len=32)
    oracle.admit(request(0, 3, 3), 3)  # an 8 block from the 16 root
    # Free: the 32 root and the 8-slot buddy of the request's block.
    assert oracle.breakdown(request(1, 10, 10)).external == 8  # a 32 block: only the root fits
    assert oracle.breakdown(request(1, 2, 2)).external == 0  # a 4 block fits in either


def test_static_preallocation_loses_the_tail_to_external_fragmentation():
    kv = static_max(70, max_seq_len=32)
    kv.admit(request(0, 4, 4), 4)
    b = kv.breakdown(request(1, 1, 1))
    assert b.as_dict() == dict(tokens=4, reservation=4, overreservation=24, rounding=0,
                               external=6, free=32)


def test_slot_map_counts_match_the_breakdown():
    kv = orca(150, "pow2", max_seq_len=64)  # regions of 32, 32 and 64 slots
    for i, (p, o) in enumerate([(3, 9), (20, 5), (7, 30)]):
        kv.admit(request(i, p, o), p)
    kv.append(1)
    waiting = request(9, 40, 20)
    slots = kv.slot_map(waiting)
    counts = {c: int((slots == i).sum()) for i, c in enumerate(CATEGORIES)}
    assert counts == kv.breakdown(waiting).as_dict()


def test_errors_name_the_request():
    kv = orca(4096, "oracle", 2048)
    with pytest.raises(ValueError, match="request 7: prompt_len \\+ output_len = 2049"):
        kv.admit(request(7, 2000, 49), 2000)
    kv.admit(request(3, 2, 2), 2)
    with pytest.raises(ValueError, match="request 3 is already admitted"):
        kv.admit(request(3, 2, 2), 2)
    kv.append(3)
    kv.append(3)
    assert not kv.can_append(3)
    with pytest.raises(ValueError, match="request 3: token 5 is past its final length 4"):
        kv.append(3)
    with pytest.raises(ValueError, match="request 5: num_tokens=9 must lie in \\[1, 8\\]"):
        kv.admit(request(5, 4, 4), 9)
    with pytest.raises(KeyError, match="request 4 is not admitted"):
        kv.free(4)
    with pytest.raises(ValueError, match="reserve='half'"):
        orca(64, "half", 32)


# --- properties over random workloads ----------------------------------------------------------

lengths = st.tuples(st.integers(1, 40), st.integers(1, 24))


@settings(max_examples=60, deadline=None)
@given(reserve=st.sampled_from(["max", "pow2", "oracle", "static"]), capacity=st.integers(64, 400),
       reqs=st.lists(lengths, min_size=1, max_size=20), steps=st.lists(st.integers(0, 30)))
def test_categories_sum_to_capacity_and_oracle_never_overreserves(reserve, capacity, reqs, steps):
    kv = static_max(capacity, 64) if reserve == "static" else orca(capacity, reserve, 64)
    live = {}
    for i, (p, o) in enumerate(reqs):
        r = request(i, p, o)
        if kv.can_admit(r, p):
            kv.admit(r, p)
            live[i] = r
        for k in steps[: len(live)]:  # grow some requests by a token, free the finished
            rid = list(live)[k % len(live)]
            if kv.can_append(rid):
                kv.append(rid)
            else:
                kv.free(live.pop(rid).id)
            if not live:
                break
        nxt = request(99, *reqs[(i + 1) % len(reqs)])
        b = kv.breakdown(nxt)
        assert b.capacity == capacity and min(b.as_dict().values()) >= 0
        assert kv.capacity - b.free - b.external == kv.allocator.num_used
        if reserve == "oracle":
            assert b.overreservation == 0
        if reserve == "max":
            assert b.rounding == 0  # 64 is a power of two
