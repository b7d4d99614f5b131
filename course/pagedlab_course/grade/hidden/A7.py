"""Hidden checks of A7: a seeded fuzz of verification steps beside KVCacheManager, with and
without prefix caching. Each task is checked with the student's function for it and this file's
reference for the other two, so a bug is charged to its own task. Cases run smallest first
(fewest operations, then block size), so the case reported is the smallest that diverges."""

import random

from pagedlab_course.grade import task
from pagedlab_course.grade.checks import Diverged, expect, outcome, plain
from pagedlab.memory import KVCacheManager


def _append(table, token_ids, num_speculative=0):
    """What A7.1 asks: the library's order (copy's block last of one allocate call)."""
    n, bs, pool = len(table.token_ids), table.block_size, table.pool
    if not token_ids or not 0 <= num_speculative <= len(token_ids):
        raise ValueError("bad append")
    shared = n % bs != 0 and pool.refcount(table.blocks[-1]) > 1
    new = pool.allocate(-(-(n + len(token_ids)) // bs) - len(table.blocks) + shared)
    copy = None
    if shared:
        copy = (table.blocks[-1], new.pop())
        table.blocks[-1] = copy[1]
        pool.release([copy[0]])
    table.blocks += new
    table.token_ids += list(token_ids)
    table.num_verified = len(table.token_ids) - num_speculative
    return copy


def _roll_back(table, num_tokens):
    """What A7.2 asks."""
    bs, n = table.block_size, len(table.token_ids)
    if not max(1, table.num_verified // bs * bs) <= num_tokens <= n:
        raise ValueError("bad cut")
    keep = -(-num_tokens // bs)
    released = table.blocks[keep:][::-1]
    table.pool.release(released)
    del table.blocks[keep:]
    del table.token_ids[num_tokens:]
    table.num_verified = num_tokens
    return released


def _cacheable(table):
    """What A7.3 asks."""
    return table.blocks[: table.num_verified // table.block_size]


def _cases():
    """(operations, block size, most proposals, seed, pool size), smallest first."""
    for num_ops in (1, 2, 3, 4, 6, 9, 14, 20, 30, 45, 70):
        for bs in (1, 2, 3, 4, 8):
            for seed in range(3):
                yield num_ops, bs, 1 + (seed + bs) % 5, seed, 6 + (seed * 7 + bs) % 13


KINDS = ["prompt", "fork", "free", "verify", "verify", "verify", "cut"]  # how often each happens


def _run(nb, case, append, roll_back, cacheable):
    """Replay one case on the student's tables and two library managers; raise Diverged at the
    first operation where they part, naming the case and the operations that led there."""
    num_ops, bs, k_max, seed, size = case
    rng, token, log = random.Random(seed * 1000 + num_ops * 10 + bs), 0, []
    lib = KVCacheManager(size, bs)  # blocks and free list, exactly
    cached = KVCacheManager(size, bs, enable_prefix_caching=True)  # what may be cached, and refusals
    pool, mine, verified = nb.Pool(size), {}, {}  # verified: each sequence's num_verified, as it must be

    def at():
        """The last operation, the case and the operations that led to it."""
        return (f"{log[-1]} (case: a pool of {size} blocks of {bs} tokens, up to {k_max} proposals; "
                f"the operations so far: {'; '.join(log)})")

    def compare():
        op = at()
        for sid in sorted(mine):
            t = mine[sid]
            expect(len(log), op, f"{sid}'s blocks", lib.block_table(sid), plain(t.blocks))
            expect(len(log), op, f"{sid}'s number of tokens", lib.num_tokens(sid), len(t.token_ids))
            expect(len(log), op, f"{sid}'s num_verified", verified[sid], t.num_verified)
            expected = [b for b, c in zip(t.blocks, cached.block_table(sid)) if cached.prefix_cache.tokens_of(c) is not None]
            expect(len(log), op, f"cacheable_blocks of {sid}", expected, plain(list(cacheable(t))))
        expect(len(log), op, "the pool's free list", lib.gpu._free, plain(pool.free_list))

    for _ in range(num_ops):
        kind = rng.choice(KINDS) if mine else "prompt"
        if kind == "prompt":
            sid, n = f"s{len(log)}", rng.randint(1, 3 * bs)
            tokens, token = list(range(token, token + n)), token + n
            log.append(f"new {sid} with {n} tokens")
            if lib.can_allocate(n):
                lib.allocate(sid, tokens)
                cached.allocate(sid, tokens)
                mine[sid] = nb.Table(pool, bs)
                _append(mine[sid], tokens)
                verified[sid] = n
        elif kind == "fork":
            parent, sid = rng.choice(sorted(mine)), f"s{len(log)}"
            log.append(f"fork {parent} as {sid}")
            lib.fork(parent, sid)
            cached.fork(parent, sid)
            mine[sid] = mine[parent].fork()
            verified[sid] = verified[parent]
        elif kind == "free":
            sid = rng.choice(sorted(mine))
            log.append(f"free {sid}")
            lib.free(sid)
            cached.free(sid)
            mine.pop(sid).free()
            del verified[sid]
        elif kind == "cut":  # a cut the library may refuse: the student's must agree
            sid = rng.choice(sorted(mine))
            keep = rng.randint(0, lib.num_tokens(sid) + 1)
            log.append(f"{sid}: keep {keep} of {lib.num_tokens(sid)} tokens")
            exp = outcome(lambda: cached.truncate(sid, keep))
            before = (mine[sid].blocks.copy(), len(mine[sid].token_ids), pool.free_list.copy())
            got = outcome(lambda: roll_back(mine[sid], keep))
            expect(len(log), at(), "roll_back succeeded (not ValueError)", exp[0], got[0])
            if exp[0] == "ok":
                lib.truncate(sid, keep)
                verified[sid] = keep
                expect(len(log), at(), "blocks returned", before[0][-(-keep // bs):][::-1], plain(list(got[1])))
            else:
                expect(len(log), at(), "table and free list after a refused cut", before,
                       (plain(mine[sid].blocks), len(mine[sid].token_ids), plain(pool.free_list)))
        else:  # a verification step: every chosen sequence proposes, then each keeps a prefix
            proposed = []
            for sid in rng.sample(sorted(mine), rng.randint(1, len(mine))):
                k = rng.randint(0, k_max)
                tokens, token = list(range(token, token + 1 + k)), token + 1 + k
                log.append(f"{sid}: the pending token and {k} proposals")
                exp = outcome(lambda: lib.append(sid, tokens, num_speculative=k))
                got = outcome(lambda: append(mine[sid], tokens, k))
                expect(len(log), at(), "append succeeded (not OutOfBlocks)", exp[0], got[0])
                if exp[0] == "ok":
                    cached.append(sid, tokens, num_speculative=k)
                    copies = lib.take_copies()
                    cached.take_copies()
                    expect(len(log), at(), "the copy returned", copies[0] if copies else None,
                           None if got[1] is None else tuple(plain(list(got[1]))))
                    proposed.append((sid, k))
                    verified[sid] = lib.num_tokens(sid) - k
                compare()
            for sid, k in proposed:
                accepted = rng.choice([0, k, rng.randint(0, k)])
                keep = lib.num_tokens(sid) - k + accepted
                log.append(f"{sid}: {accepted} of {k} accepted, keep {keep} tokens")
                before = mine[sid].blocks.copy()
                lib.truncate(sid, keep)
                cached.truncate(sid, keep)
                verified[sid] = keep
                got = outcome(lambda: roll_back(mine[sid], keep))
                expect(len(log), at(), "roll_back succeeded", "ok", got[0])
                expect(len(log), at(), "blocks returned (released, last first)",
                       before[-(-keep // bs):][::-1], plain(list(got[1])))
                compare()
            continue
        compare()


def _fuzz(nb, **functions):
    """Every case, smallest first, with the student's function where given."""
    reference = {"append": _append, "roll_back": _roll_back, "cacheable": _cacheable}
    reference.update(functions)
    for case in _cases():
        try:
            _run(nb, case, **reference)
        except Diverged:
            raise
        except Exception as e:  # the student's code raised where the library did not
            raise Diverged(f"case: pool of {case[4]} blocks of {case[1]} tokens, seed {case[3]}, "
                           f"{case[0]} operations: {type(e).__name__}: {e}") from None


@task("A7.1")
def check_append_tokens_fuzz(nb):
    """append_tokens beside KVCacheManager.append(num_speculative=k): the same blocks, copies,
    refusals and free list, through verification steps, forks and frees."""
    _fuzz(nb, append=nb.append_tokens)


@task("A7.2")
def check_roll_back_fuzz(nb):
    """roll_back beside KVCacheManager.truncate for accept lengths 0 to k: the same blocks
    released (last first), tables and free list; the cuts the library refuses refused."""
    _fuzz(nb, roll_back=nb.roll_back)


@task("A7.3")
def check_cacheable_blocks_fuzz(nb):
    """cacheable_blocks equals the blocks KVCacheManager with prefix caching holds in its cache,
    during verification steps and after each rollback."""
    _fuzz(nb, cacheable=nb.cacheable_blocks)
