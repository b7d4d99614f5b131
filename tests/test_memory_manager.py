"""KVCacheManager scenarios in the spirit of vLLM's block-manager tests: the request lifecycle,
fork and copy-on-write, swapping, slot mappings, usage, events and misuse."""

import pytest

from pagedlab.memory import (
    Event,
    KVCacheManager,
    OutOfBlocks,
    StateError,
    UnknownSequence,
    Usage,
)


def manager(num_gpu_blocks=8, block_size=4, **kwargs):
    return KVCacheManager(num_gpu_blocks, block_size, **kwargs)


# --- prefill and decode -------------------------------------------------------------------------


def test_a_prompt_takes_ceil_tokens_over_block_size_blocks():
    mgr = manager()
    assert mgr.can_allocate(10) and not mgr.can_allocate(33)
    assert mgr.allocate("a", range(10)) == 0
    assert mgr.block_table("a") == [0, 1, 2]
    assert (mgr.num_tokens("a"), mgr.token_ids("a")) == (10, list(range(10)))
    assert (mgr.num_free_blocks, mgr.num_used_blocks) == (5, 3)
    assert mgr.usage() == Usage(used_blocks=3, tokens_stored=10, slots_allocated=12)
    mgr.check_invariants()


def test_decode_takes_a_new_block_only_when_the_last_is_full():
    mgr = manager()
    mgr.allocate("a", range(8))  # two full blocks
    assert mgr.can_append("a")
    mgr.append("a", [8])
    assert mgr.block_table("a") == [0, 1, 2]
    mgr.append("a", [9, 10, 11])  # fills block 2
    assert mgr.block_table("a") == [0, 1, 2]
    mgr.append("a", [12, 13, 14, 15, 16])  # 4 into a new block, 1 into another
    assert mgr.block_table("a") == [0, 1, 2, 3, 4]
    assert mgr.token_ids("a") == list(range(17)) and mgr.take_copies() == []
    mgr.check_invariants()


def test_free_returns_every_block():
    mgr = manager()
    mgr.allocate("a", range(10))
    mgr.allocate("b", range(3))
    mgr.free("a")
    assert mgr.num_free_blocks == 7 and mgr.block_table("b") == [3]
    mgr.free("b")
    assert mgr.num_free_blocks == 8 and mgr.usage() == Usage(0, 0, 0)
    mgr.check_invariants()


def test_waste_is_under_one_block_per_sequence():
    mgr = manager(num_gpu_blocks=64, block_size=16)
    for i, n in enumerate([1, 15, 16, 17, 100, 255]):
        mgr.allocate(i, range(n))
    usage = mgr.usage()
    assert usage.slots_allocated - usage.tokens_stored < 6 * 16
    assert usage.tokens_stored == 404 and usage.utilization == pytest.approx(404 / (28 * 16))


# --- fork and copy-on-write ---------------------------------------------------------------------


def test_fork_shares_every_block_and_appending_copies_the_partial_block_once():
    mgr = manager()
    mgr.allocate("parent", range(10))  # blocks 0, 1 full; block 2 holds 2 tokens
    mgr.fork("parent", "child")
    assert mgr.block_table("child") == [0, 1, 2] and mgr.num_used_blocks == 3
    assert [mgr.gpu.refcount(b) for b in range(3)] == [2, 2, 2]
    assert mgr.usage().tokens_stored == 10  # shared states count once

    mgr.append("child", [100])  # block 2 is shared and partly filled: copy it first
    assert mgr.take_copies() == [(2, 3)] and mgr.take_copies() == []
    assert mgr.block_table("child") == [0, 1, 3] and mgr.block_table("parent") == [0, 1, 2]

    mgr.append("parent", [200])  # now its sole owner: written in place
    assert mgr.take_copies() == []
    mgr.append("child", [101])  # its own copy: no copy either
    assert mgr.take_copies() == []
    assert mgr.token_ids("parent") == [*range(10), 200]
    assert mgr.token_ids("child") == [*range(10), 100, 101]
    assert mgr.usage().tokens_stored == 8 + 3 + 4
    mgr.check_invariants()


def test_fork_at_a_block_boundary_never_copies():
    mgr = manager()
    mgr.allocate("parent", range(8))
    mgr.fork("parent", "child")
    mgr.append("parent", [1])
    mgr.append("child", [2])
    assert mgr.take_copies() == []
    assert mgr.block_table("parent") == [0, 1, 2] and mgr.block_table("child") == [0, 1, 3]
    mgr.check_invariants()


def test_each_sharer_copies_until_one_owner_is_left():
    mgr = manager()
    mgr.allocate("p", range(5))  # block 1 holds 1 token
    mgr.fork("p", "c1")
    mgr.fork("p", "c2")
    mgr.append("c1", [7])
    mgr.append("c2", [8])
    assert mgr.take_copies() == [(1, 2), (1, 3)]  # one batch for copy_blocks
    mgr.append("p", [9])  # the last user of block 1
    assert mgr.take_copies() == []
    assert [mgr.block_table(s)[1] for s in ("p", "c1", "c2")] == [1, 2, 3]
    mgr.check_invariants()


def test_a_failed_copy_on_write_leaves_the_sequence_as_it_was():
    mgr = manager(num_gpu_blocks=2)
    mgr.allocate("p", range(5))
    mgr.fork("p", "c")
    assert not mgr.can_append("c")
    with pytest.raises(OutOfBlocks, match="sequence 'c' needs 1 block, pool 'gpu' has 0 free"):
        mgr.append("c", [1])
    assert mgr.block_table("c") == [0, 1] and mgr.token_ids("c") == list(range(5))
    assert mgr.take_copies() == []
    mgr.check_invariants()


def test_running_out_during_decode_leaves_the_table_unchanged():
    mgr = manager(num_gpu_blocks=4)
    mgr.allocate("a", range(8))
    mgr.allocate("b", range(3))
    with pytest.raises(OutOfBlocks) as info:
        mgr.append("a", list(range(5)))  # needs 2 blocks, 1 free
    assert (info.value.needed, info.value.free, info.value.owner) == (2, 1, "a")
    assert mgr.block_table("a") == [0, 1] and mgr.num_tokens("a") == 8
    assert mgr.num_free_blocks == 1
    mgr.check_invariants()


# --- slot mapping -------------------------------------------------------------------------------


def test_slot_mapping_follows_the_block_table():
    mgr = manager()
    mgr.allocate("a", range(4))  # block 0
    mgr.allocate("b", range(4))  # block 1
    mgr.append("a", [4, 5])  # block 2
    assert mgr.block_table("a") == [0, 2]
    assert mgr.slot_mapping("a", 0, 6) == [0, 1, 2, 3, 8, 9]
    assert mgr.slot_mapping("a", 4, 6) == [8, 9]  # the decode step's new tokens
    assert mgr.slot_mapping("b", 3, 4) == [7] and mgr.slot_mapping("a", 2, 2) == []
    for start, end in [(-1, 2), (3, 2), (0, 7)]:
        with pytest.raises(ValueError, match="'a'|start"):
            mgr.slot_mapping("a", start, end)


# --- swapping -----------------------------------------------------------------------------------


def test_swapping_a_forked_group_copies_each_block_once_and_round_trips():
    mgr = manager(num_gpu_blocks=6, num_cpu_blocks=4)
    mgr.allocate("a", range(10))
    mgr.fork("a", "b")
    mgr.append("b", [99])  # b copies block 2 -> 3
    mgr.take_copies()
    gpu_kv = {b: f"kv{b}" for b in range(4)}  # stand-in contents of each GPU block
    assert mgr.can_swap_out("a", "b")
    out = mgr.swap_out("a", "b")
    assert out == [(0, 0), (1, 1), (2, 2), (3, 3)]  # 4 distinct blocks, not 6 entries
    assert mgr.is_swapped("a") and mgr.is_swapped("b")
    assert mgr.num_free_blocks == 6 and mgr.cpu.num_free == 0
    assert mgr.cpu.refcount(0) == 2  # still shared on the CPU
    cpu_kv = {cpu: gpu_kv[gpu] for gpu, cpu in out}
    mgr.check_invariants()

    mgr.allocate("other", range(4))  # the GPU is reused meanwhile
    assert mgr.can_swap_in("a", "b")
    back = mgr.swap_in("a", "b")
    assert sorted(cpu for cpu, _ in back) == [0, 1, 2, 3]
    new_kv = {gpu: cpu_kv[cpu] for cpu, gpu in back}
    assert [new_kv[g] for g in mgr.block_table("a")] == ["kv0", "kv1", "kv2"]
    assert [new_kv[g] for g in mgr.block_table("b")] == ["kv0", "kv1", "kv3"]
    assert mgr.block_table("a")[:2] == mgr.block_table("b")[:2]  # shared again
    assert mgr.token_ids("b") == [*range(10), 99] and not mgr.is_swapped("b")
    assert mgr.cpu.num_free == 4
    mgr.check_invariants()


def test_swapping_out_one_sharer_copies_and_the_other_keeps_the_gpu_blocks():
    mgr = manager(num_gpu_blocks=4, num_cpu_blocks=4)
    mgr.allocate("a", range(6))
    mgr.fork("a", "b")
    assert mgr.swap_out("b") == [(0, 0), (1, 1)]
    assert mgr.block_table("a") == [0, 1] and mgr.num_used_blocks == 2
    mgr.append("a", [6])  # a is now the only user: no copy
    assert mgr.take_copies() == []
    mgr.free("a")
    assert mgr.swap_in("b") == [(0, 0), (1, 1)] and mgr.token_ids("b") == list(range(6))
    mgr.check_invariants()


def test_swap_needs_room_and_a_failed_swap_changes_nothing():
    mgr = manager(num_gpu_blocks=4, num_cpu_blocks=1)
    mgr.allocate("a", range(6))
    assert not mgr.can_swap_out("a")
    with pytest.raises(OutOfBlocks, match="sequence 'a' needs 2 blocks, pool 'cpu' has 1 free"):
        mgr.swap_out("a")
    assert not mgr.is_swapped("a") and mgr.block_table("a") == [0, 1]
    mgr.allocate("b", range(2))
    mgr.fork("b", "c")
    with pytest.raises(OutOfBlocks, match="sequences 'a', 'c' needs 3 blocks"):
        mgr.swap_out("a", "c")
    mgr.check_invariants()

    mgr = manager(num_gpu_blocks=2, num_cpu_blocks=2)
    mgr.allocate("a", range(6))
    mgr.swap_out("a")
    mgr.allocate("b", range(1))
    assert not mgr.can_swap_in("a")
    with pytest.raises(OutOfBlocks, match="pool 'gpu' has 1 free"):
        mgr.swap_in("a")
    assert mgr.is_swapped("a")
    mgr.check_invariants()


# --- events -------------------------------------------------------------------------------------


def test_events_record_the_history_when_asked():
    assert manager().events is None
    mgr = manager(num_cpu_blocks=4, record_events=True)
    mgr.allocate("a", range(5))
    mgr.fork("a", "b")
    mgr.append("b", [5])
    mgr.swap_out("a")
    mgr.swap_in("a")
    mgr.free("b")
    assert [e.kind for e in mgr.events] == [
        "allocate", "fork", "cow", "append", "swap_out", "swap_in", "free"]
    assert mgr.events[0] == Event("allocate", "a", (0, 1), num_tokens=5)
    assert mgr.events[1] == Event("fork", "b", (0, 1), num_tokens=5, parent="a")
    assert mgr.events[2] == Event("cow", "b", pairs=((1, 2),))
    assert mgr.events[3] == Event("append", "b", (), num_tokens=1)
    assert mgr.events[4].pairs == ((0, 0), (1, 1)) and mgr.events[6].blocks == (2, 0)


# --- misuse -------------------------------------------------------------------------------------


def test_misuse_names_the_sequence_and_changes_nothing():
    mgr = manager(num_cpu_blocks=4)
    mgr.allocate("a", range(5))
    mgr.allocate("s", range(3))
    mgr.swap_out("s")
    mgr.free("a")
    cases = [
        (UnknownSequence, "sequence 'a' is not allocated", mgr.append, "a", [1]),
        (UnknownSequence, "sequence 'a' is not allocated", mgr.free, "a"),  # double free
        (UnknownSequence, "sequence 'a' is not allocated", mgr.fork, "a", "x"),
        (UnknownSequence, "sequence 'a' is not allocated", mgr.block_table, "a"),
        (UnknownSequence, "sequence 'a' is not allocated", mgr.is_swapped, "a"),
        (UnknownSequence, "sequence 'zz' is not allocated", mgr.swap_in, "zz"),
        (StateError, "sequence 's' already exists", mgr.allocate, "s", [1]),
        (StateError, "sequence 's' already exists", mgr.fork, "b", "s"),
        (StateError, "sequence 's' is swapped out", mgr.append, "s", [1]),
        (StateError, "sequence 's' is swapped out", mgr.fork, "s", "x"),
        (StateError, "sequence 's' is swapped out", mgr.slot_mapping, "s", 0, 1),
        (StateError, "sequence 's' is already swapped out", mgr.swap_out, "s"),
        (StateError, "sequence 'b' is already running", mgr.swap_in, "b"),
        (ValueError, "'b': append needs at least one token", mgr.append, "b", []),
        (ValueError, "'new': a prompt needs at least one token", mgr.allocate, "new", []),
        (ValueError, "num_tokens=0", mgr.can_append, "b", 0),
        (ValueError, "num_tokens=-3", mgr.can_allocate, -3),
        (ValueError, "one sequence twice", mgr.swap_out, "b", "b"),
        (ValueError, "at least one sequence", mgr.swap_out),
    ]
    mgr.allocate("b", range(6))
    before = (mgr._running.keys(), mgr._swapped.keys(), mgr.gpu._refs.copy(), mgr.cpu._refs.copy())
    for error, message, call, *args in cases:
        with pytest.raises(error, match=message):
            call(*args)
    assert (mgr._running.keys(), mgr._swapped.keys(), mgr.gpu._refs, mgr.cpu._refs) == before
    assert str(UnknownSequence("sequence 'a' is not allocated")) == "sequence 'a' is not allocated"
    assert issubclass(UnknownSequence, KeyError) and issubclass(StateError, ValueError)
    mgr.check_invariants()


@pytest.mark.parametrize(
    "kwargs, field", [({"num_gpu_blocks": 0}, "num_gpu_blocks"), ({"block_size": 0}, "block_size"),
                      ({"num_cpu_blocks": -1}, "num_blocks"), ({"block_size": 2.0}, "block_size")],
)
def test_the_constructor_checks_its_sizes(kwargs, field):
    with pytest.raises(ValueError, match=field):
        manager(**kwargs)


def test_allocate_shared_holds_the_shared_blocks_once_and_the_rest_apiece():
    """Three sequences sharing a 10-token prompt's two full blocks (block size 4), each with
    its own tail: the two blocks once, with three holders; each tail in blocks of its own."""
    m = KVCacheManager(num_gpu_blocks=16, block_size=4)
    prompt = list(range(10))
    tokens = [prompt + [90, 91], prompt + [80, 81, 82], prompt + [70]]
    starts = m.allocate_shared(["a", "b", "c"], tokens, shared=8)
    assert starts == [0, 8, 8]
    tails = sum(-(-(len(t) - 8) // 4) for t in tokens)  # ceil over each tail
    assert m.num_used_blocks == 2 + tails == m.blocks_for(8) + tails
    tables = [m.block_table(s) for s in "abc"]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert [m.gpu.refcount(b) for b in tables[0][:2]] == [3, 3]
    assert len({tuple(t[2:]) for t in tables}) == 3  # tails not shared
    assert [m.token_ids(s) for s in "abc"] == tokens
    m.check_invariants()


def test_allocate_shared_refuses_a_part_block_and_without_sharing_allocates_each():
    m = KVCacheManager(num_gpu_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="whole blocks of 4"):
        m.allocate_shared(["a", "b"], [[1] * 9, [1] * 9], shared=6)
    assert m.num_used_blocks == 0
    assert m.allocate_shared(["a", "b"], [[1] * 9, [2] * 5], shared=0) == [0, 0]
    assert m.num_used_blocks == m.blocks_for(9) + m.blocks_for(5) == 5


# --- allocate_slots: the scheduler's one question -----------------------------------------

def test_allocate_slots_takes_the_blocks_above_keep_free_or_changes_nothing():
    mgr = KVCacheManager(6, 4)
    assert mgr.allocate_slots({"a": list(range(9))}, keep_free=3) == {"a": 0}  # 3 blocks
    assert mgr.num_free_blocks == 3
    assert mgr.allocate_slots({"b": list(range(5))}, keep_free=2) is None  # 2 > 3 - 2
    assert "b" not in mgr and mgr.num_free_blocks == 3
    # a forked group recomputed: its first 4 tokens (one block) held once
    starts = mgr.allocate_slots({"c": [7] * 8, "d": [7] * 4 + [1, 2]}, shared=4)
    assert starts == {"c": 0, "d": 4} and mgr.num_free_blocks == 0  # 1 + 1 + 1 blocks
    assert mgr.block_table("c")[0] == mgr.block_table("d")[0]
    assert mgr.allocate_slots({"a": [0, 1, 2, 3]}) is None  # a full pool refuses an append
    assert mgr.num_tokens("a") == 9
    mgr.check_invariants()


def test_allocate_slots_counts_the_copy_of_a_shared_last_block_once_per_copy():
    """Two sequences sharing a partly filled last block both decode: the first to append
    copies it, the second finds it its own (vLLM's last-sharer rule)."""
    mgr = KVCacheManager(8, 4)
    mgr.allocate("a", list(range(5)))  # 2 blocks, the last holding 1 token
    mgr.fork("a", "b")
    free = mgr.num_free_blocks
    assert mgr.blocks_needed({"a": 1, "b": 1}) == 1
    assert mgr.allocate_slots({"a": [5], "b": [6]}) == {"a": 5, "b": 5}
    assert free - mgr.num_free_blocks == 1 and len(mgr.take_copies()) == 1
    assert mgr.token_ids("a")[-1] == 5 and mgr.token_ids("b")[-1] == 6


def test_swap_in_with_keep_free_counts_the_return_and_the_next_decode():
    mgr = KVCacheManager(8, 4, num_cpu_blocks=8)
    mgr.allocate("a", list(range(8)))  # 2 full blocks
    mgr.fork("a", "b")
    mgr.swap_out("a", "b")
    assert mgr.blocks_to_swap_in("a", "b") == 4  # 2 shared blocks back, a fresh one each
    free = mgr.num_free_blocks
    assert mgr.swap_in("a", "b", keep_free=free - 3) is None
    assert mgr.is_swapped("a") and mgr.num_free_blocks == free
    assert len(mgr.swap_in("a", "b", keep_free=free - 4)) == 2
    assert mgr.allocate_slots({"a": [8], "b": [9]}, keep_free=free - 4) is not None
    assert mgr.num_free_blocks == free - 4
