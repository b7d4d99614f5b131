"""The scheduler on random workloads under random configurations: every request ends, no step
breaks the rules, nothing leaks (a seeded search of the configuration space; it found a chunk
of negative length after a recomputed prompt bigger than the budget)."""

import random

import pytest

from pagedlab.engine import (
    CacheTooSmall,
    FCFS,
    GroupOutput,
    Priority,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SequenceOutput,
    TooManySequences,
)
from pagedlab.memory import KVCacheManager


def random_run(seed: int) -> None:
    rng = random.Random(seed)
    block_size, num_blocks = rng.choice([1, 2, 4, 8]), rng.randint(2, 24)
    seats = rng.choice([1, 2, 4, 8])
    config = SchedulerConfig(
        max_num_seqs=seats,
        max_num_batched_tokens=rng.choice([None, seats, seats + rng.randint(0, 20)]),
        watermark=rng.choice([0.0, 0.1, 0.3]),
        preemption_mode=rng.choice(["recompute", "swap"]),
        policy=rng.choice([FCFS(), Priority()]),
        chunked_prefill=rng.random() < 0.8,
    )
    manager = KVCacheManager(num_blocks, block_size, rng.choice([0, 4, 16]),
                             enable_prefix_caching=rng.random() < 0.5)
    sched = Scheduler(manager, config)
    shared = [rng.randint(1, 50) for _ in range(12)]  # a common prefix, for prefix hits
    arrivals = {}
    for i in range(rng.randint(1, 10)):
        length = rng.randint(1, num_blocks * block_size)
        prompt = (shared[: rng.randint(0, 12)] + [rng.randint(1, 50) for _ in range(length)])
        params = SamplingParams(n=rng.choice([1, 1, 2, 3]), max_tokens=rng.randint(1, 12), seed=0)
        arrivals.setdefault(rng.randint(0, 20), []).append((f"r{i}", prompt[:length], params))
    groups, step_no = [], 0
    while arrivals or sched.has_unfinished:
        for rid, prompt, params in arrivals.pop(step_no, ()):
            try:
                groups.append(sched.add_request(rid, prompt, params, priority=rng.randint(0, 3)))
            except (CacheTooSmall, TooManySequences):
                pass  # refused before any work: nothing to check
        step_no += 1
        if not sched.has_unfinished:
            continue
        step = sched.schedule()
        if step.stats.batched_tokens > config.token_budget:  # only a prefill that runs alone
            assert len(step.groups) == 1 and not step.decodes, (seed, step.stats)
        assert all(c.num_tokens > 0 for c in step.chunks), (seed, step.stats)
        short = [c for c in step.prefills if not c.is_sampled]
        assert len(short) <= 1, (seed, step.stats)  # at most one prompt part-way
        outputs = []
        for group in step.sampled_groups:
            live = group.live if group.has_output else [group.seqs[0]] * group.params.n
            outputs.append(GroupOutput(group, [SequenceOutput(s, rng.randint(1, 50), 0.0)
                                               for s in live]))
        sched.update(outputs)
        manager.check_invariants()
        for group in sched.running:  # each sequence's progress is what the cache holds
            for seq in group.live:
                assert seq.num_computed_tokens == manager.num_tokens(seq.seq_id), seed
        assert step_no < 20_000, f"seed {seed}: no end after {step_no} steps"
    for group in groups:
        assert group.is_finished, (seed, group.request_id)
        if group.error is None:  # else it failed alone: its cache was too small
            assert all(len(s.output_token_ids) == group.params.max_tokens for s in group.seqs)
    assert manager.num_used_blocks == 0 and manager.cpu.num_used == 0, seed


@pytest.mark.parametrize("chunk", range(4))
def test_random_workloads_end_by_the_rules(chunk, seed_offset):
    first = 2000 * seed_offset + 500 * chunk  # each offset its own 2,000 seeds
    for seed in range(first, first + 500):
        random_run(seed)
