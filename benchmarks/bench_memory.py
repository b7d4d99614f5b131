"""How fast the paged KV-cache manager runs in CPython: ops per second over long random traces.

    python benchmarks/bench_memory.py [--scale 0.1]

Targets: at least 1,000,000 one-token appends and 300,000 allocate+free pairs per second.
Nothing is asserted (speed is never a test); the table is for the book and for regressions.
"""

from __future__ import annotations

import argparse
import random
import time

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


def main(scale: float) -> None:
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
    print(f"{'operation':42} {'ops/s':>12} {'us/op':>8} {'target ops/s':>13}")
    for name, rate, target in rows:
        print(f"{name:42} {rate:12,.0f} {1e6 / rate:8.2f} {target:>13}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="fraction of the default trace lengths (0.1 for a quick look)")
    main(parser.parse_args().scale)
