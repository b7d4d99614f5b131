"""How fast the paged KV-cache manager runs in CPython: ops per second over long random traces,
and a race against a minimal block manager of nano-vllm's shape on the same serving trace.

    python benchmarks/bench_memory.py [--scale 0.1] [--out benchmarks/results/memory-cpu.json]

Targets: at least 1,000,000 one-token appends and 300,000 allocate+free pairs per second, and
the serving race at a ratio of at least 1.0 (ours no slower than the nano-vllm-shaped manager).
Nothing about speed is asserted (speed is never a test); the race does check that both
managers computed the same thing (blocks used after every step, prompt tokens hit).
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from collections import deque
from functools import partial
from pathlib import Path

from bench_decode import save

from pagedlab.memory import KVCacheManager, OutOfBlocks

BLOCK_SIZE = 16


def best_rate(run, repeats: int = 3) -> float:
    """Best ops/s of ``repeats`` runs; ``run()`` sets up, then returns (timed callable, ops)."""
    rates = []
    for _ in range(repeats):
        body, ops = run()
        start = time.perf_counter()
        body()
        rates.append(ops / (time.perf_counter() - start))
    return max(rates)


def appends(num_appends: int, caching: bool):
    """One-token appends to 256 sequences in random order, as decode steps make them."""
    rng = random.Random(0)
    mgr = KVCacheManager(num_appends // BLOCK_SIZE + 256 * 16, BLOCK_SIZE,
                         enable_prefix_caching=caching)
    for sid in range(256):
        mgr.allocate(sid, [rng.randrange(32000) for _ in range(rng.randint(1, 200))])
    trace = [rng.randrange(256) for _ in range(num_appends)]
    tokens = [[rng.randrange(32000)] for _ in range(1000)]

    def body():
        append = mgr.append
        for i, sid in enumerate(trace):
            append(sid, tokens[i % 1000])

    return body, num_appends


def allocate_free(num_pairs: int):
    """Allocate a 1-128-token prompt, then free a random live sequence (about 64 live)."""
    rng = random.Random(1)
    mgr = KVCacheManager(64 * 8 + 8, BLOCK_SIZE)
    prompts = [list(range(rng.randint(1, 128))) for _ in range(1000)]
    victims = [rng.randrange(64) for _ in range(num_pairs)]
    for sid in range(64):
        mgr.allocate(sid, prompts[sid])

    def body():
        allocate, free, live = mgr.allocate, mgr.free, list(range(64))
        for i, v in enumerate(victims):
            sid = i + 64
            allocate(sid, prompts[i % 1000])
            free(live[v])
            live[v] = sid

    return body, num_pairs


def fork_free(num_pairs: int):
    """Fork a 512-token sequence (a parallel sample) and free the child."""
    mgr = KVCacheManager(64, BLOCK_SIZE)
    mgr.allocate("parent", range(512))

    def body():
        fork, free = mgr.fork, mgr.free
        for i in range(num_pairs):
            fork("parent", i)
            free(i)

    return body, num_pairs


def prefix_hit(num_lookups: int):
    """Allocate (lookup, hit on all 128 blocks but the last) and free a 2,048-token prompt."""
    rng = random.Random(2)
    prompt = [rng.randrange(32000) for _ in range(2048)]
    mgr = KVCacheManager(256, BLOCK_SIZE, enable_prefix_caching=True)
    mgr.allocate("warm", prompt)
    mgr.free("warm")

    def body():
        for i in range(num_lookups):
            mgr.allocate(i, prompt)  # 2,032 tokens served from the cache
            mgr.free(i)

    return body, num_lookups


def serving_trace(num_steps: int):
    """A serving loop: requests with shared system prompts arrive, some fork (parallel
    sampling), every running sequence decodes a token a step, finished ones are freed, and
    the newest is swapped out when the pool is full. Counts every manager call."""
    rng = random.Random(3)
    systems = [[rng.randrange(32000) for _ in range(rng.choice([32, 64, 160]))] for _ in range(4)]
    requests = [
        (rng.choice(systems) + [rng.randrange(32000) for _ in range(rng.randint(1, 200))],
         rng.randint(1, 400), rng.random() < 0.2)
        for _ in range(num_steps)
    ]
    mgr = KVCacheManager(2048, BLOCK_SIZE, num_cpu_blocks=2048, enable_prefix_caching=True)
    running, swapped, ops = {}, [], 0  # running: seq id -> tokens left to decode, oldest first
    start = time.perf_counter()
    for step, (prompt, length, fork) in enumerate(requests):
        if swapped and mgr.can_swap_in(swapped[0][0]):
            sid, todo = swapped.pop(0)
            mgr.swap_in(sid)
            running[sid] = todo
            ops += 2
        ops += 1
        if mgr.can_allocate(len(prompt)):
            mgr.allocate(step, prompt)
            running[step] = length
            ops += 1
            if fork:
                mgr.fork(step, -step - 1)
                running[-step - 1] = length
                ops += 1
        for sid in list(running):
            if sid not in running:  # swapped out earlier in this step
                continue
            ops += 1
            try:
                mgr.append(sid, [step])
            except OutOfBlocks:  # preempt the newest request: swap it out, or drop it
                victim = running.popitem()
                if mgr.can_swap_out(victim[0]):
                    mgr.swap_out(victim[0])
                    swapped.append(victim)
                else:
                    mgr.free(victim[0])  # recomputation would start it again later
                ops += 2
                continue
            running[sid] -= 1
            if not running[sid]:
                mgr.free(sid)
                del running[sid]
                ops += 1
        mgr.take_copies()
    return ops / (time.perf_counter() - start), ops


class _Block:
    """One physical block: its users, and the chained hash and tokens of its contents once full."""

    __slots__ = ("block_id", "ref_count", "key", "tokens")

    def __init__(self, block_id: int):
        self.block_id, self.ref_count, self.key, self.tokens = block_id, 0, None, None


class _Seq:
    """What nano-vllm's block manager reads of a sequence (nano-vllm's ``Sequence``, trimmed
    to that): its tokens and their count, its block table, and the prompt tokens cached."""

    __slots__ = ("token_ids", "num_tokens", "block_table", "num_cached_tokens", "block_size")

    def __init__(self, token_ids: list[int], block_size: int):
        self.token_ids, self.num_tokens, self.block_size = token_ids, len(token_ids), block_size
        self.block_table, self.num_cached_tokens = [], 0

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        self.num_tokens += 1


class NanoBlockManager:
    """A minimal block manager of the shape of nano-vllm's ``engine/block_manager.py``, written
    here for the race (not copied): a deque of free block ids taken from the left, freed blocks
    put back on the right with their contents kept (so a later prompt can still hit them), a
    dict from chained hash to block, refcounts on block objects; the sequence holds its tokens
    and block table. Two changes make it compute what ours computes: it hashes with Python's
    ``hash((parent hash, tokens))``, as ours does, where nano-vllm uses xxhash over numpy bytes
    (slower; the race is about bookkeeping); and it leaves a prompt's last token uncached.
    It also hashes inline and leaves out nano-vllm's asserts and small helper calls, which
    only makes it faster."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.block_of: dict[int, int] = {}  # chained hash of a full block -> block id
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.used_ids: set[int] = set()
        self.cached_tokens = 0  # prompt tokens served by hits, as PrefixStats.hits

    def _take(self, block_id: int) -> _Block:
        block = self.blocks[block_id]
        block.ref_count, block.key, block.tokens = 1, None, None
        self.free_ids.remove(block_id)  # the head, unless a freed cached block comes back
        self.used_ids.add(block_id)
        return block

    def can_allocate(self, seq: _Seq) -> bool:
        return len(self.free_ids) >= seq.num_blocks

    def allocate(self, seq: _Seq) -> None:
        bs, key, miss = self.block_size, None, False
        hittable = (len(seq) - 1) // bs  # full blocks before the prompt's last token
        for i in range(seq.num_blocks):
            chunk = tuple(seq.block(i))
            key = hash((key, chunk)) if len(chunk) == bs else None
            block_id = self.block_of.get(key, -1) if i < hittable else -1
            miss = miss or block_id == -1 or self.blocks[block_id].tokens != chunk
            if miss:
                block = self._take(self.free_ids[0])
            else:
                seq.num_cached_tokens += bs
                self.cached_tokens += bs
                if block_id in self.used_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._take(block_id)
            if key is not None:
                block.key, block.tokens = key, chunk
                self.block_of[key] = block.block_id
            seq.block_table.append(block.block_id)

    def can_append(self, seq: _Seq) -> bool:
        return len(self.free_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: _Seq) -> None:
        """After the sequence took a token: a fresh block if it opened one, a key if it
        filled one."""
        bs, table = self.block_size, seq.block_table
        if len(seq) % bs == 1:
            table.append(self._take(self.free_ids[0]).block_id)
        elif len(seq) % bs == 0:
            last = self.blocks[table[-1]]
            parent = self.blocks[table[-2]].key if len(table) > 1 else None
            last.tokens = tuple(seq.block(seq.num_blocks - 1))
            last.key = hash((parent, last.tokens))
            self.block_of[last.key] = last.block_id

    def deallocate(self, seq: _Seq) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_ids.remove(block_id)
                self.free_ids.append(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()


def race_plan(num_requests: int, seed: int = 4):
    """A serving trace with prefix caching: one request a step, its prompt one of four shared
    system prompts (2, 4 or 10 blocks) and 1-200 tokens of its own; then 1-400 decode steps of
    one token each; freed after its last. Returns the prompts and, per step, (arriving,
    decoding, finishing) sequence ids."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(rng.choice([32, 64, 160]))] for _ in range(4)]
    prompts, ends = [], []
    for sid in range(num_requests):
        own = [rng.randrange(32000) for _ in range(rng.randint(1, 200))]
        prompts.append(rng.choice(systems) + own)
        ends.append(sid + rng.randint(1, 400))  # its last decode step
    plan, live = [], []
    for step in range(max(ends) + 1):
        arriving = [step] if step < num_requests else []
        decoding = live  # admitted in an earlier step
        finishing = [sid for sid in decoding if ends[sid] == step]
        plan.append((arriving, decoding, finishing))
        live = [sid for sid in decoding if ends[sid] != step] + arriving
    return prompts, plan


def race_ours(prompts, plan, num_blocks: int, used: list | None = None):
    """Set up the race for our manager; return it and the timed body. ``append`` checks that
    the token fits and raises, changing nothing, if it does not."""
    mgr = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    steps = [([(sid, prompts[sid]) for sid in a], d, f) for a, d, f in plan]

    def body():
        can_allocate, allocate, append, free = (mgr.can_allocate, mgr.allocate, mgr.append,
                                                 mgr.free)
        for step, (arriving, decoding, finishing) in enumerate(steps):
            for sid, prompt in arriving:
                if not can_allocate(len(prompt)):
                    raise RuntimeError(f"the race's pool is too small at step {step}")
                allocate(sid, prompt)
            token = [step]
            for sid in decoding:
                append(sid, token)
            for sid in finishing:
                free(sid)
            if used is not None:
                used.append(mgr.num_used_blocks)

    return mgr, body


def race_nano(prompts, plan, num_blocks: int, used: list | None = None, checked: bool = True):
    """Set up the same race for the nano-vllm-shaped manager; return it and the timed body.
    Each decode takes its token and, as nano-vllm's scheduler does, asks ``can_append``
    before ``may_append`` (``checked=False`` skips that check: a leaner, unsafe baseline)."""
    mgr = NanoBlockManager(num_blocks, BLOCK_SIZE)
    seqs = [_Seq(list(p), BLOCK_SIZE) for p in prompts]
    steps = [([seqs[i] for i in a], [seqs[i] for i in d], [seqs[i] for i in f]) for a, d, f in plan]

    def body():
        can_allocate, allocate, can_append, may_append, deallocate = (
            mgr.can_allocate, mgr.allocate, mgr.can_append, mgr.may_append, mgr.deallocate)
        for step, (arriving, decoding, finishing) in enumerate(steps):
            for seq in arriving:
                if not can_allocate(seq):
                    raise RuntimeError(f"the race's pool is too small at step {step}")
                allocate(seq)
            for seq in decoding:
                seq.append_token(step)
                if checked and not can_append(seq):
                    raise RuntimeError(f"the race's pool is too small at step {step}")
                may_append(seq)
            for seq in finishing:
                deallocate(seq)
            if used is not None:
                used.append(len(mgr.used_ids))

    return mgr, body


RACERS = {  # name: (setup, what it is)
    "ours": (race_ours, "KVCacheManager.append (checks that the token fits)"),
    "nano": (race_nano, "nano-vllm's decode protocol: can_append, then may_append"),
    "nano-unchecked": (partial(race_nano, checked=False), "may_append alone (no capacity check)"),
}


def race(num_requests: int, repeats: int = 7, num_blocks: int = 8192) -> dict:
    """Ours against the nano-vllm-shaped manager on :func:`race_plan`'s trace: first one
    untimed run of each that checks they agree (blocks used after every step, prompt tokens
    hit), then ``repeats`` rounds timing each once (CPU time), in an order that rotates;
    best of each, and the ratio of each baseline's best time to ours (> 1: ours is faster)."""
    prompts, plan = race_plan(num_requests)
    used_ours, used_nano = [], []
    ours, body = race_ours(prompts, plan, num_blocks, used_ours)
    body()
    nano, body = race_nano(prompts, plan, num_blocks, used_nano)
    body()
    hits = ours.prefix_stats.hits
    if used_ours != used_nano or hits != nano.cached_tokens:
        step = next((i for i, (a, b) in enumerate(zip(used_ours, used_nano)) if a != b), None)
        raise RuntimeError(f"the managers disagree: prompt tokens hit {hits} and "
                           f"{nano.cached_tokens}, blocks used first differ at step {step}")
    names = list(RACERS)
    best = dict.fromkeys(names, float("inf"))
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            _, body = RACERS[name][0](prompts, plan, num_blocks)
            start = time.process_time()  # CPU time: less disturbed by a shared machine
            body()
            best[name] = min(best[name], time.process_time() - start)
    return {"requests": num_requests, "decode_appends": sum(len(d) for _, d, _ in plan),
            "steps": len(plan), "prompt_tokens": sum(map(len, prompts)),
            "prompt_tokens_hit": hits, "peak_blocks_used": max(used_ours),
            "num_blocks": num_blocks, "repeats": repeats, "best_seconds": best,
            "ratio": {name: best[name] / best["ours"] for name in names[1:]}}


def main(scale: float, out: Path) -> None:
    def n(count: int) -> int:
        return max(1, int(count * scale))

    rows = [
        ("append 1 token", best_rate(lambda: appends(n(1_000_000), False)), "1,000,000"),
        ("append 1 token, prefix caching on", best_rate(lambda: appends(n(1_000_000), True)), ""),
        ("allocate + free (1-128 tokens)", best_rate(lambda: allocate_free(n(300_000))), "300,000"),
        ("fork + free (512 tokens)", best_rate(lambda: fork_free(n(200_000))), ""),
        ("prefix hit, 2,048-token prompt (+ free)", best_rate(lambda: prefix_hit(n(5_000))), ""),
    ]
    rate, ops = serving_trace(n(20_000))
    rows.append((f"serving trace ({ops:,} mixed calls)", rate, ""))
    lines = ["| operation | ops/s | us/op | target ops/s |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {rate:,.0f} | {1e6 / rate:.2f} | {target} |"
              for name, rate, target in rows]
    r = race(n(5_000))
    lines += ["", "Serving race against a nano-vllm-shaped block manager: "
              f"{r['requests']:,} requests "
              f"(four shared system prompts), {r['decode_appends']:,} decode appends, "
              f"{r['prompt_tokens_hit']:,} of {r['prompt_tokens']:,} prompt tokens hit, peak "
              f"{r['peak_blocks_used']:,} of {r['num_blocks']:,} blocks; both managers agree on "
              f"blocks used after every step and on the hits. Best of {r['repeats']} interleaved "
              "runs each (CPU time):", "",
              "| manager | best CPU s | its time / ours |", "| --- | --- | --- |"]
    lines += [f"| {name}: {RACERS[name][1]} | {r['best_seconds'][name]:.3f} | "
              f"{r['ratio'].get(name, 1.0):.2f} |" for name in RACERS]
    meta = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "machine": platform.machine(), "scale": scale}
    results = {"meta": meta, "ops_per_second": {name: rate for name, rate, _ in rows},
               "race": r}
    save(out, results, f"# KV-cache manager benchmark, {meta['date']}\n\nPython "
         f"{meta['python']}, scale {scale}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="fraction of the default trace lengths (0.1 for a quick look)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "memory-cpu.json",
                        help="JSON path (a .md table is written beside it)")
    args = parser.parse_args()
    main(args.scale, args.out)
