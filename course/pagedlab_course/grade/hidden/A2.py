"""Hidden checks of A2: seeded random runs beside the library, and the invariant checker on
states corrupted at random. Block ids are compared exactly only for the allocator, whose
free-list order is the lesson; elsewhere only what does not depend on them."""

import random
import types
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from pagedlab_course.grade import task
from pagedlab_course.grade.checks import GRADING, Diverged, Renaming, expect, outcome, plain
from pagedlab.memory import BlockAllocator, KVCacheManager

# The library's exception classes under the notebook's names for them.
AS_NOTEBOOK = {"OutOfBlocks": "OutOfBlocks", "StateError": "NotInUse"}


def _did(call, mine: bool = True) -> tuple:
    """('ok', the value, the student's as plain data) or ('raised', the class of the exception,
    the library's named as the notebook's): a RuntimeError where NotInUse is asked for differs."""
    kind, what = outcome(call)
    if kind == "ok":
        return "ok", plain(what) if mine else what
    return "raised", AS_NOTEBOOK.get(what, what)


def _ok_or_raised(did: tuple) -> str:
    return "ok" if did[0] == "ok" else f"raised {did[1]}"


@task("A2.1")
def check_allocator_random_runs(nb):
    """20 seeded runs of allocate / share / release (double frees and all-or-nothing failures
    included) give the library's blocks, refcounts and free counts, call by call."""
    for seed in range(20):
        rng, size = random.Random(seed), 1 + seed % 9
        mine, ref = nb.Allocator(size), BlockAllocator(size)
        for step in range(120):
            kind = rng.choice(["allocate", "share", "release", "release"])
            if kind == "allocate":
                n = rng.randint(0, 4)
                op = f"allocate({n})"
                expect(step, f"seed {seed}, pool of {size}: {op}", "result", _did(lambda: ref.allocate(n), mine=False),
                       _did(lambda: mine.allocate(n)))
            else:
                blocks = rng.sample(range(size), rng.randint(1, min(3, size)))
                op = f"{kind}({blocks})"
                exp = _ok_or_raised(_did(lambda: getattr(ref, kind)(blocks), mine=False))
                got = _ok_or_raised(_did(lambda: getattr(mine, kind)(blocks)))
                expect(step, f"seed {seed}, pool of {size}: {op}", "succeeded or raised", exp, got)
            expect(step, f"seed {seed}, pool of {size}: {op}", "refcounts after it",
                   [ref.refcount(b) for b in range(size)], [mine.refcount(b) for b in range(size)])
            expect(step, f"seed {seed}, pool of {size}: {op}", "num_free after it", ref.num_free, mine.num_free)


def _check_tables(pool, tables, size, bs, where):
    """What any correct run satisfies, whatever the block ids."""
    entries = Counter(b for t in tables for b in t.blocks)
    for t in tables:
        expect(*where, "blocks of a table holding %d tokens" % t.num_tokens, -(-t.num_tokens // bs), len(t.blocks))
    expect(*where, "refcount of each block == entries pointing at it",
           {b: entries[b] for b in range(size)}, {b: pool.refcount(b) for b in range(size)})
    expect(*where, "num_free", size - len(entries), pool.num_free)


@task("A2.2")
def check_block_tables_random_runs(nb):
    """Random appends to several tables: a block only when the last is full, slot mapping by the
    formula, a refused append changes nothing (block ids free to differ)."""
    for seed in range(15):
        rng, size, bs = random.Random(seed), 12 + seed, 1 + seed % 5
        pool = nb.Allocator(size)
        tables = [nb.BlockTable(pool, bs) for _ in range(4)]
        for step in range(60):
            i, n = rng.randrange(4), rng.randint(1, 3 * bs)
            t, where = tables[i], (step, f"seed {seed}, block size {bs}: table {i}.append({n})")
            needed = -(-(t.num_tokens + n) // bs) - len(t.blocks)
            expect(*where, "blocks_needed", needed, t.blocks_needed(n))
            before = (t.blocks.copy(), t.num_tokens, pool.num_free)
            fits = needed <= pool.num_free
            expect(*where, "succeeded or raised", "ok" if fits else "raised OutOfBlocks",
                   _ok_or_raised(_did(lambda: t.append(n))))
            if not fits:
                expect(*where, "table and pool after a refused append", before, (t.blocks, t.num_tokens, pool.num_free))
            _check_tables(pool, tables, size, bs, where)
            slots = [t.blocks[p // bs] * bs + p % bs for p in range(t.num_tokens)]
            expect(*where, "slot_mapping(0, num_tokens)", slots, t.slot_mapping(0, t.num_tokens))


@task("A2.3")
def check_fork_and_copy_on_write_random_runs(nb):
    """Random prompts, appends, forks and frees beside KVCacheManager: the same refusals and
    copies, refcounts equal to table entries, a written partial block never shared, and every
    table the library's up to a renaming of blocks."""
    for seed in range(12):
        rng, size, bs = random.Random(seed), 16 + seed, 2 + seed % 3
        lib, pool, mine, names = KVCacheManager(size, bs), nb.Allocator(size), {}, Renaming()
        for step in range(80):
            kind = rng.choice(["prompt", "append", "append", "fork", "free"]) if mine else "prompt"
            if kind == "prompt":
                sid, n = f"s{step}", rng.randint(1, 3 * bs)
                op = f"new sequence {sid} with {n} tokens"
                exp = _ok_or_raised(_did(lambda: lib.allocate(sid, [0] * n), mine=False))
                t = nb.SharedBlockTable(pool, bs)
                got = _ok_or_raised(_did(lambda: t.append(n)))
                expect(step, op, "succeeded or raised", exp, got)
                if exp == "ok":
                    mine[sid] = t
            elif kind == "append":
                sid, n = rng.choice(sorted(mine)), rng.randint(1, 2 * bs)
                op = f"{sid}.append({n})"
                t = mine[sid]
                shared = t.num_tokens % bs and pool.refcount(t.blocks[-1]) > 1
                exp = _ok_or_raised(_did(lambda: lib.append(sid, [0] * n), mine=False))
                got = _did(lambda: t.append(n))
                expect(step, op, "succeeded or raised", exp, _ok_or_raised(got))
                if exp == "ok":
                    copies = lib.take_copies()
                    expect(step, op, "a (src, dst) copy returned (the last block was partly filled and shared)",
                           bool(shared), got[1] is not None)
                    expect(step, op, "copies made", len(copies), int(got[1] is not None))
                    if t.num_tokens % bs:
                        expect(step, op, "refcount of the partly filled last block written", 1, pool.refcount(t.blocks[-1]))
            elif kind == "fork":
                parent, sid = rng.choice(sorted(mine)), f"s{step}"
                op = f"fork {parent} as {sid}"
                lib.fork(parent, sid)
                mine[sid] = mine[parent].fork()
                expect(step, op, "child's tokens", mine[parent].num_tokens, mine[sid].num_tokens)
            else:
                sid = rng.choice(sorted(mine))
                op = f"free {sid}"
                lib.free(sid)
                nb.free_table(mine.pop(sid))
            _check_tables(pool, list(mine.values()), size, bs, (step, f"seed {seed}: {op}"))
            expect(step, f"seed {seed}: {op}", "blocks in use", lib.num_used_blocks, size - pool.num_free)
            names.forget([b for b in range(size) if pool.refcount(b) == 0])
            for sid in sorted(mine):
                if not names.match(mine[sid].blocks, lib.block_table(sid)):
                    raise Diverged(f"operation {step}, seed {seed}: {op}: {sid}'s blocks {mine[sid].blocks} are not "
                                   f"the library's {lib.block_table(sid)} under any renaming that fits the other tables")


def _pool(refs, free_list):
    """A bare allocator state for find_violations (refs, free_list and the accessors), of types
    that travel to the submission's process as copies."""
    return types.SimpleNamespace(refs=refs, free_list=free_list, num_blocks=len(refs), num_free=len(free_list),
                                 refcount=refs.__getitem__)


def _violations(refs, free_list, tables):
    """The two rules of A2.4, straight from the statement."""
    entries, on_list = Counter(b for t in tables for b in t), Counter(free_list)
    return [b for b in range(len(refs)) if refs[b] != entries[b] or on_list[b] != (refs[b] == 0)]


@task("A2.4")
@GRADING
@given(st.lists(st.lists(st.integers(0, 9), max_size=4), max_size=4),
       st.lists(st.tuples(st.sampled_from(["leak", "extra ref", "lost", "twice", "used on list", "entry to free", "drop ref"]),
                          st.integers(0, 9)), max_size=3))
def check_find_violations(nb, tables, corruptions):
    """find_violations on random states with random corruptions (a leaked block with no table
    entry included): exactly the blocks that break a rule, sorted, each once."""
    tables = [list(dict.fromkeys(t)) for t in tables]
    entries = Counter(b for t in tables for b in t)
    refs = [entries[b] for b in range(10)]
    free_list = [b for b in range(9, -1, -1) if refs[b] == 0]
    for kind, b in corruptions:
        if kind == "leak" and b in free_list and refs[b] == 0:  # taken off the free list, refcount 1, no table entry
            free_list.remove(b)
            refs[b] = 1
        elif kind == "extra ref" and refs[b]:
            refs[b] += 1
        elif kind == "drop ref" and refs[b]:
            refs[b] -= 1
        elif kind == "lost" and b in free_list:
            free_list.remove(b)
        elif kind == "twice" and b in free_list:
            free_list.append(b)
        elif kind == "used on list" and refs[b]:
            free_list.append(b)
        elif kind == "entry to free" and tables and refs[b] == 0:
            tables[0].append(b)
    expected = _violations(refs, free_list, tables)
    got = nb.find_violations(_pool(refs, free_list.copy()), [types.SimpleNamespace(blocks=t.copy()) for t in tables])
    state = f"refcounts {refs}, free list {free_list}, tables {tables}"
    assert list(got) == expected, f"{state}\n    expected: {expected}\n    actual:   {list(got)}"


@task("A2.4")
def check_free_table_releases_tail_first(nb):
    """free_table releases every block, last block first (so the head is the next out), and
    empties the table."""
    pool = nb.Allocator(8)
    t = nb.SharedBlockTable(pool, 2)
    t.append(5)
    blocks = plain(t.blocks)
    nb.free_table(t)
    expect(0, "free_table of a table of blocks %s" % blocks, "the top of the free list (released last first)",
           blocks[::-1], plain(pool.free_list)[-len(blocks):])
    expect(0, "the same free_table", "blocks, tokens and free blocks after it", [[], 0, 8],
           [plain(t.blocks), t.num_tokens, pool.num_free])
