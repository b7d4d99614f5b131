"""Hidden checks of A3: keys against the library, lookups that never return a wrong block under
forced collisions, and seeded runs beside KVCacheManager with other pool sizes and seeds."""

import random

from hypothesis import given
from hypothesis import strategies as st

from pagedlab_course.grade import task
from pagedlab_course.grade.checks import GRADING, expect, plain
from pagedlab.memory import KVCacheManager, OutOfBlocks, block_key

tokens = st.lists(st.integers(0, 3), max_size=20)


@task("A3.1")
@GRADING
@given(tokens, st.integers(1, 6))
def check_keys_match_the_library(nb, token_ids, bs):
    """block_keys chains chain_key over the full blocks only, with the library's block_key values,
    and through whatever key_fn it is given."""
    expected, key = [], None
    for start in range(0, len(token_ids) - bs + 1, bs):
        key = block_key(key, tuple(token_ids[start : start + bs]))
        expected.append(key)
    assert plain(nb.block_keys(token_ids, bs)) == expected, f"keys of {token_ids} in blocks of {bs}"
    nested = plain(nb.block_keys(token_ids, bs, key_fn=lambda parent, t: (parent, tuple(t))))
    chain, key = [], None
    for start in range(0, len(token_ids) - bs + 1, bs):
        key = (key, tuple(token_ids[start : start + bs]))
        chain.append(key)
    assert nested == chain, f"with key_fn=(parent, tokens), keys of {token_ids}\n    expected: {chain}\n    actual:   {nested}"


@task("A3.2")
@GRADING
@given(st.lists(tokens, min_size=1, max_size=6), st.lists(tokens, min_size=1, max_size=6), st.integers(1, 3),
       st.sampled_from(["every key collides", "keys mod 3", "no collisions"]))
def check_lookup_under_collisions(nb, inserted, lookups, bs, keys):
    """Random inserts and lookups with colliding keys: a lookup returns only blocks that hold the
    prompt's tokens, chained, changes nothing, and finds the longest prefix without collisions."""
    key_fn = {"every key collides": lambda p, t: 0, "keys mod 3": lambda p, t: hash((p, t)) % 3,
              "no collisions": lambda p, t: (p, t)}[keys]
    index, first, next_block, tokens_of = nb.PrefixIndex(bs, key_fn), {}, 0, {}
    for seq in inserted:
        blocks = []
        for i in range(-(-len(seq) // bs)):  # reuse the cached prefix's blocks, as a pool would
            hit = index.lookup(seq)
            blocks.append(hit[i] if i < len(hit) else next_block + i)
        next_block += len(blocks) + 1
        index.insert(blocks, seq)
        for i in range(len(seq) // bs):
            first.setdefault(tuple(seq[: (i + 1) * bs]), blocks[i])
            tokens_of.setdefault(blocks[i], tuple(seq[i * bs : (i + 1) * bs]))
    for prompt in lookups:
        state = (dict(index.block_of), dict(index.entry))
        hits = plain(index.lookup(prompt))
        where = f"{keys}, blocks of {bs}: after inserting {inserted}, lookup({prompt})"
        assert (dict(index.block_of), dict(index.entry)) == state, f"{where} changed the index"
        for i, b in enumerate(hits):
            assert tokens_of.get(b) == tuple(prompt[i * bs : (i + 1) * bs]), \
                f"{where} returned {hits}: block {b} does not hold the prompt's block {i}"
        if keys == "no collisions":
            expected = []
            while len(expected) < len(prompt) // bs and tuple(prompt[: (len(expected) + 1) * bs]) in first:
                expected.append(first[tuple(prompt[: (len(expected) + 1) * bs])])
            assert hits == expected, f"{where}\n    expected: {expected}\n    actual:   {hits}"


def _broken_invariant(cache, live) -> str | None:
    """The first of the pool's invariants (the notebook's consistent()) that ``cache`` breaks, in
    words; None if all hold. The grader's own copy: a submission cannot change it."""
    users = [0] * len(cache.refs)
    for blocks in live:
        for b in blocks:
            users[b] += 1
    if users != list(cache.refs):
        return f"refs {list(cache.refs)}, but the live requests hold the blocks {users} times"
    for b in range(len(cache.refs)):
        places = (b in cache.free_list) + (b in cache.lru) + (cache.refs[b] > 0)
        if places != 1:
            return f"block {b} is in {places} of (free list, LRU, in use), not exactly one"
        if b in cache.lru and b not in cache.index.entry:
            return f"block {b} is parked in the LRU but not in the index"
    order = {b: i for i, b in enumerate(cache.lru)}
    for b, (_, parent, _) in cache.index.entry.items():
        if parent is not None and parent not in cache.index.entry:
            return f"cached block {b}'s parent {parent} is not cached"
        if b in order and parent in order and order[parent] < order[b]:
            return f"parked block {b} would be evicted after its parent {parent}"
    return None


@task("A3.3")
def check_cache_random_runs(nb):
    """Seeded runs on other pool sizes and block sizes beside KVCacheManager: the same cached
    tokens, refusals and evictions, and the pool's invariants, request by request."""
    for seed in range(8):
        rng, size, bs = random.Random(100 + seed), 6 + 2 * seed, 1 + seed % 3
        cache, lib, live = nb.PrefixCache(size, bs), KVCacheManager(size, bs, enable_prefix_caching=True), {}
        for step in range(150):
            if live and (len(live) == 4 or rng.random() < 0.4):
                sid = rng.choice(sorted(live))
                op = f"seed {seed}, {size} blocks of {bs}: release request {sid}"
                cache.release(list(live.pop(sid)))
                lib.free(sid)
            else:
                prompt = [rng.randrange(3) for _ in range(rng.randint(1, 3 * bs + 2))]
                op = f"seed {seed}, {size} blocks of {bs}: allocate({prompt})"
                try:
                    expected = lib.allocate(step, prompt)
                except OutOfBlocks:
                    expected = "refused"
                try:
                    blocks, got = cache.allocate(list(prompt))
                except nb.OutOfBlocks:
                    got = "refused"
                expect(step, op, "cached tokens", expected, got)
                if got != "refused":
                    live[step] = list(blocks)
            expect(step, op, "evictions so far", lib.prefix_stats.evictions, len(cache.evicted))
            expect(step, op, "the pool's invariants (see the notebook's consistent())", None,
                   _broken_invariant(cache, live.values()))


def _workloads():
    """Six seeded serving workloads, pool sizes and limits for serve (A3.4)."""
    cases = []
    for seed in range(6):
        rng = random.Random(seed)
        system = [rng.randrange(50) for _ in range(rng.randint(3, 12))]
        questions = [[rng.randrange(50) for _ in range(rng.randint(1, 6))] for _ in range(4)]
        prompts = [system + rng.choice(questions) for _ in range(15)]
        bs, live = 2 + seed % 3, 1 + seed % 3
        cases.append((seed, prompts, live * (-(-max(map(len, prompts)) // bs)) + seed, bs, live))
    return cases


def _served_by_the_library():
    """(hits, misses, evictions) of each workload through KVCacheManager, the oldest request
    released when max_live hold blocks (the notebook's serve_library, computed by the grader)."""
    counts = []
    for _, prompts, size, bs, max_live in _workloads():
        manager, live = KVCacheManager(size, bs, enable_prefix_caching=True), []
        for i, prompt in enumerate(prompts):
            if len(live) == max_live:
                manager.free(live.pop(0))
            manager.allocate(i, prompt)
            live.append(i)
        counts.append([manager.prefix_stats.hits, manager.prefix_stats.misses, manager.prefix_stats.evictions])
    return counts


@task("A3.4", reference=_served_by_the_library)
def check_serve_other_workloads(nb, library):
    """serve on other seeded workloads, pool sizes and limits gives the library's counts."""
    for (seed, prompts, size, bs, live), expected in zip(_workloads(), library):
        mine = nb.serve([list(p) for p in prompts], size, bs, live)
        expect(seed, f"serve(workload {seed}, {size} blocks of {bs}, max_live {live})",
               "[hits, misses, evictions]", expected, [mine["hits"], mine["misses"], mine["evictions"]])
