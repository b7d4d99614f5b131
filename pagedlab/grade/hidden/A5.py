"""Hidden checks of A5: other seeded workloads and configurations, step for step beside
pagedlab's Scheduler (through the notebook's serve_library), and the outputs' invariance."""

import random

from hypothesis import given
from hypothesis import strategies as st

from pagedlab.grade import task
from pagedlab import SamplingParams
from pagedlab.engine import GroupOutput, Scheduler, SchedulerConfig, SequenceOutput
from pagedlab.grade.checks import GRADING, expect, outcome, plain
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


def _next_token(tokens):
    """The notebook's made-up model (its setup cell's next_token), the grader's own copy."""
    return (31 * sum(tokens[-4:]) + 7 * len(tokens)) % 1000


def _library_steps(workload, blocks, block_size, cpu, config, limit=500):
    """Each step's (prefills, decodes, preempted, swapped in, blocks copied) under pagedlab's
    Scheduler with whole prompts: the reference, computed here, never by the notebook."""
    lib = Scheduler(KVCacheManager(blocks, block_size, cpu),
                    SchedulerConfig(chunked_prefill=False, max_num_seqs=config["max_num_seqs"],
                                    max_num_batched_tokens=config["max_num_batched_tokens"],
                                    watermark=config["watermark"], preemption_mode=config["mode"]))
    for rid, prompt, max_tokens in workload:
        lib.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
    steps = []
    while lib.has_unfinished and len(steps) < limit:
        step = lib.schedule()
        rid = {seq.seq_id: g.request_id for g in step.groups for seq in g.seqs}
        s = step.stats
        steps.append(([rid[c.seq.seq_id] for c in step.prefills], [rid[c.seq.seq_id] for c in step.decodes],
                      [tuple(p) for p in s.preempted], list(s.swapped_in), s.blocks_swapped_out + s.blocks_swapped_in))
        lib.update([GroupOutput(g, [SequenceOutput(q, _next_token(q.token_ids), 0.0) for q in g.live])
                    for g in step.groups])
    return steps


def _small_workloads(count):
    """``count`` seeded small workloads and configurations (tight pools, both preemption modes,
    CPU pools from none to roomy), smallest first: the first that diverges is the one to show."""
    cases = []
    for seed in range(count):
        rng = random.Random(seed)
        bs = rng.choice([2, 4])
        workload = [(f"q{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 12))], rng.randint(1, 12))
                    for i in range(rng.randint(2, 5))]
        blocks = max(-(-(len(p) + m) // bs) for _, p, m in workload) + rng.randint(0, 4)
        mode = rng.choice(["recompute", "swap"])
        config = dict(max_num_seqs=rng.randint(1, 4), max_num_batched_tokens=rng.choice([16, 32, 64]),
                      watermark=rng.choice([0.0, 0.1]), mode=mode)
        cpu = rng.choice([0, 2, 4, 16]) if mode == "swap" else 0
        size = (len(workload), sum(len(p) + m for _, p, m in workload))
        cases.append((size, seed, workload, blocks, bs, cpu, config))
    return sorted(cases, key=lambda c: c[:2])


@task("A5.3")
def check_steps_beside_the_library(nb):
    """A differential search: 2,000 seeded small workloads (swap and recompute, tight GPU and
    CPU pools, seat caps, budgets, watermarks), each served step by step by your MiniScheduler
    and by pagedlab's Scheduler; the smallest workload where they part is shown."""
    for _, seed, workload, blocks, bs, cpu, config in _small_workloads(2000):
        expected = _library_steps(workload, blocks, bs, cpu, config)
        sched = nb.MiniScheduler(KVCacheManager(blocks, bs, num_cpu_blocks=cpu), config["max_num_seqs"],
                                 config["max_num_batched_tokens"], watermark=config["watermark"], mode=config["mode"])
        for rid, prompt, max_tokens in workload:
            sched.add(rid, prompt, max_tokens)
        where = (f"workload {seed}: {[(rid, len(p), m) for rid, p, m in workload]} (request, prompt length, "
                 f"max tokens), {blocks} GPU / {cpu} CPU blocks of {bs}, {config}")
        for index, theirs in enumerate(expected):
            def step():
                s = sched.schedule()
                summary = ([r.rid for r in s.prefills], [r.rid for r in s.decodes], [tuple(p) for p in s.preempted],
                           list(s.swapped_in), s.blocks_copied)
                sched.update(s)
                return summary
            ours = outcome(step)
            expect(index, where, "step (prefills, decodes, preempted, swapped in, blocks copied)",
                   ("ok", theirs), ours if ours[0] == "error" else ("ok", plain(ours[1])))
