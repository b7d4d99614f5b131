"""Hidden checks of A5: other seeded workloads and configurations, step for step beside
pagedlab's Scheduler (through the notebook's serve_library), and the outputs' invariance."""

import random

from hypothesis import given
from hypothesis import strategies as st

from pagedlab.grade import task
from pagedlab.grade.checks import GRADING, expect
from pagedlab.memory import KVCacheManager


@task("A5.1")
@GRADING
@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(4, 40), st.integers(1, 5),
       st.integers(8, 64), st.sampled_from([0.0, 0.1, 0.25]))
def check_admission_rules(nb, prompts, num_blocks, seats, budget, watermark):
    """One admission from a random queue: first come, first served, stopping at the first
    request that lacks blocks (beyond the watermark), a seat or budget (unless the batch is empty)."""
    sched = nb.MiniScheduler(KVCacheManager(num_blocks, 4), seats, budget, watermark=watermark)
    for i, n in enumerate(prompts):
        sched.add(f"r{i}", [i] * n, 4)
    step = nb.Step(0)
    sched.admit(step)
    expected, free, left = [], num_blocks - int(watermark * num_blocks), budget
    for i, n in enumerate(prompts):
        if -(-n // 4) > free or len(expected) + 1 > seats or (n > left and expected):
            break
        expected.append(f"r{i}")
        free, left = free - -(-n // 4), left - n
    got = [r.rid for r in step.prefills]
    assert got == expected, (f"prompts {prompts}, {num_blocks} blocks of 4, {seats} seats, budget {budget}, "
                             f"watermark {watermark}\n    expected admitted: {expected}\n    actual:            {got}")


def _workload(rng, n):
    return [(f"q{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 14))], rng.randint(1, 20))
            for i in range(n)]


@task("A5.4")
def check_other_workloads_beside_the_library(nb):
    """Ten seeded workloads and configurations (block sizes, seat caps, budgets, watermarks,
    both preemption modes): the same finish steps, preemptions, recomputed tokens and copies."""
    for seed in range(10):
        rng = random.Random(seed)
        workload = _workload(rng, rng.randint(3, 10))
        bs = rng.choice([2, 4])
        longest = max(len(p) + m for _, p, m in workload)
        blocks = -(-longest // bs) + rng.randint(1, 6)
        config = dict(block_size=bs, max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=rng.choice([16, 32, 64]),
                      watermark=rng.choice([0.0, 0.1]), mode=rng.choice(["recompute", "swap"]))
        cpu = rng.choice([0, 4, 64]) if config["mode"] == "swap" else 0
        ours = nb.serve(workload, blocks, num_cpu_blocks=cpu, **config)
        theirs = nb.serve_library(workload, blocks, num_cpu_blocks=cpu, **config)
        for key in theirs:
            expect(seed, f"serve(seeded workload {seed}, {blocks} GPU / {cpu} CPU blocks, {config})",
                   key, theirs[key], ours[key])
        expect(seed, "the same run", "leaked (GPU, CPU) blocks", (0, 0), ours["leaked"])


@task("A5.3")
def check_steps_beside_the_library(nb):
    """Twelve seeded workloads, step by step beside pagedlab's Scheduler (the notebook's
    library_step), with watermarks, seat caps and CPU pools that the visible check does not use."""
    for seed in range(12):
        rng = random.Random(50 + seed)
        workload = _workload(rng, rng.randint(3, 8))
        longest = max(-(-(len(p) + m) // 4) for _, p, m in workload)
        blocks, cpu = longest + rng.randint(0, 5), rng.choice([2, 16])
        config = dict(max_num_seqs=rng.randint(2, 4), max_num_batched_tokens=rng.choice([16, 32]),
                      watermark=rng.choice([0.0, 0.15, 0.3]), mode=rng.choice(["recompute", "swap"]))
        sched = nb.MiniScheduler(nb.KVCacheManager(blocks, 4, num_cpu_blocks=cpu), **config)
        for rid, prompt, max_tokens in workload:
            sched.add(rid, prompt, max_tokens)
        lib = nb.library(workload, blocks, num_cpu_blocks=cpu, **config)
        while sched.has_unfinished or lib.has_unfinished:
            index = sched.num_steps
            (ours, _), (theirs, _) = nb.mine(sched), nb.library_step(lib)
            expect(index, f"seed {seed}, {blocks} GPU / {cpu} CPU blocks, {config}",
                   "(prefills, decodes, preempted, swapped in, blocks copied)", theirs, ours)
