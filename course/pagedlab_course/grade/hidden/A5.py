"""Hidden checks of A5: other seeded workloads and configurations, step for step beside
pagedlab's Scheduler, which the grader runs in its own process (``task(reference=...)``): a
submission cannot change the reference it is compared with."""

import itertools
import random
from collections import deque

from hypothesis import example, given
from hypothesis import strategies as st

from pagedlab_course.grade import task
from pagedlab import SamplingParams
from pagedlab.engine import GroupOutput, Scheduler, SchedulerConfig, SequenceOutput
from pagedlab_course.grade.checks import GRADING, a5_next_token, expect, outcome, plain
from pagedlab.memory import KVCacheManager


@task("A5.1")
@GRADING
@example([12, 12, 12], 10, 5, 64, 0.1)  # the third fits exactly beside the watermark's block
@example([12], 4, 1, 8, 0.25)  # exactly, one block kept, the budget exceeded by a first request
@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(4, 40), st.integers(1, 5),
       st.integers(8, 64), st.sampled_from([0.0, 0.1, 0.25]))
def check_admission_rules(nb, prompts, num_blocks, seats, budget, watermark):
    """One admission from a random queue: first come, first served, stopping at the first
    request that lacks blocks (beyond the watermark), a seat or budget (unless the batch is empty);
    a request whose blocks fit exactly is admitted."""
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


@task("A5.2")
def check_recompute_keeps_arrival_order(nb):
    """Running requests preempted by recomputation in every order (swap mode falls back to it
    for an earlier arrival after a later one was swapped out): each victim's blocks are freed,
    it is recorded, and the waiting queue stays in order of arrival."""
    for order in itertools.permutations(range(3)):
        sched = nb.MiniScheduler(KVCacheManager(16, 4), 8, 64)
        manager = sched.manager  # the scheduler's copy of the manager, in the submission's process
        requests = [sched.add(f"r{i}", [i] * 5, 4) for i in range(4)]  # r3 is still waiting
        for req in requests[:3]:
            manager.allocate(req.rid, req.tokens)
            req.status = "running"
        sched.waiting, sched.running = deque(requests[3:]), list(requests[:3])
        step = nb.Step(1)
        for i in order:
            sched.running.remove(requests[i])
            sched.recompute(requests[i], step)
        where = f"r0, r1, r2 running, r3 waiting; recompute {', '.join(f'r{i}' for i in order)}"
        expect(0, where, "waiting queue", ["r0", "r1", "r2", "r3"], plain([r.rid for r in sched.waiting]))
        expect(0, where, "step.preempted", [(f"r{i}", "recompute") for i in order], plain(step.preempted))
        expect(0, where, "blocks in use", 0, manager.num_used_blocks)


def _workload(rng, n):
    return [(f"q{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 14))], rng.randint(1, 20))
            for i in range(n)]


def _library_run(workload, blocks, block_size, cpu, config, limit=500):
    """The workload served by pagedlab's Scheduler with whole prompts: each step's [prefills,
    decodes, preempted, swapped in, blocks copied], and serve's counts. Computed by the grader
    (``task(reference=...)``), where no student code runs."""
    kv = KVCacheManager(blocks, block_size, cpu)
    lib = Scheduler(kv,
                    SchedulerConfig(chunked_prefill=False, max_num_seqs=config["max_num_seqs"],
                                    max_num_batched_tokens=config["max_num_batched_tokens"],
                                    watermark=config["watermark"], preemption_mode=config["mode"]))
    for rid, prompt, max_tokens in workload:
        lib.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
    steps, finish, preemptions = [], {}, {rid: 0 for rid, _, _ in workload}
    recomputed, copied, peak, peak_cpu = -sum(len(p) for _, p, _ in workload), 0, 0, 0
    while lib.has_unfinished and len(steps) < limit:
        step = lib.schedule()
        peak, peak_cpu = max(peak, kv.num_used_blocks), max(peak_cpu, kv.cpu.num_used)
        rid = {seq.seq_id: g.request_id for g in step.groups for seq in g.seqs}
        s = step.stats
        steps.append([[rid[c.seq.seq_id] for c in step.prefills], [rid[c.seq.seq_id] for c in step.decodes],
                      [list(p) for p in s.preempted], list(s.swapped_in), s.blocks_swapped_out + s.blocks_swapped_in])
        recomputed += s.prefill_tokens
        copied += s.blocks_swapped_out + s.blocks_swapped_in
        for preempted, _ in s.preempted:
            preemptions[preempted] += 1
        for group in lib.update([GroupOutput(g, [SequenceOutput(q, a5_next_token(q.token_ids), 0.0) for q in g.live])
                                 for g in step.groups]):
            finish[group.request_id] = len(steps) - 1
    return {"steps": steps, "finish_steps": finish, "preemptions": preemptions, "recomputed": recomputed,
            "blocks_copied": copied, "peak_blocks": peak, "peak_cpu_blocks": peak_cpu}


def _other_workloads(seed):
    """Ten workloads and configurations for serve (A5.4), drawn from the grading seed (a table of
    precomputed answers earns nothing), and one of a single request."""
    cases = []
    for number in range(10):
        rng = random.Random(f"A5.4 {seed} {number}")
        workload = _workload(rng, rng.randint(3, 10))
        bs = rng.choice([2, 4])
        longest = max(len(p) + m for _, p, m in workload)
        blocks = -(-longest // bs) + rng.randint(1, 6)
        config = dict(block_size=bs, max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=rng.choice([16, 32, 64]),
                      watermark=rng.choice([0.0, 0.1]), mode=rng.choice(["recompute", "swap"]))
        cpu = rng.choice([0, 4, 64]) if config["mode"] == "swap" else 0
        cases.append((number, workload, blocks, cpu, config))
    # The smallest run whose peak comes in the step where a request finishes (and frees it).
    cases.append((10, [("q0", [1, 2, 3, 4], 1)], 2, 0, dict(block_size=4, max_num_seqs=1, max_num_batched_tokens=16,
                                                             watermark=0.0, mode="recompute")))
    return cases


def _served_by_the_library(seed):
    """Each case drawn from ``seed``, with the library's counts for it."""
    served = []
    for case in _other_workloads(seed):
        number, workload, blocks, cpu, config = case
        run = _library_run(workload, blocks, config["block_size"], cpu, config, limit=10**6)
        served.append({"case": case, "expected": {**{k: v for k, v in run.items() if k != "steps"},
                                                  "steps": len(run["steps"])}})
    return served


@task("A5.4", reference=_served_by_the_library)
def check_other_workloads_beside_the_library(nb, library):
    """Ten workloads and configurations drawn at grading time (block sizes, seat caps, budgets,
    watermarks, both preemption modes) and a single request: the same finish steps, preemptions,
    recomputed tokens, copies and peak GPU and CPU blocks, compared as plain data."""
    for item in library:
        number, workload, blocks, cpu, config = item["case"]
        ours = plain(nb.serve([(rid, list(p), m) for rid, p, m in workload], blocks, num_cpu_blocks=cpu, **dict(config)))
        for key, theirs in item["expected"].items():
            expect(number, f"serve(workload {number}: {[(rid, len(p), m) for rid, p, m in workload]} (request, "
                           f"prompt length, max tokens), {blocks} GPU / {cpu} CPU blocks, {config})",
                   key, theirs, ours.get(key))
        expect(number, "the same run", "leaked (GPU, CPU) blocks", (0, 0), ours.get("leaked"))


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


def _library_search():
    return [_library_run(workload, blocks, bs, cpu, config)["steps"]
            for _, _, workload, blocks, bs, cpu, config in _small_workloads(2000)]


@task("A5.3", reference=_library_search)
def check_steps_beside_the_library(nb, library):
    """A differential search: 2,000 seeded small workloads (swap and recompute, tight GPU and
    CPU pools, seat caps, budgets, watermarks), each served step by step by your MiniScheduler
    and by pagedlab's Scheduler; the smallest workload where they part is shown."""
    for (_, seed, workload, blocks, bs, cpu, config), expected in zip(_small_workloads(2000), library):
        sched = nb.MiniScheduler(KVCacheManager(blocks, bs, num_cpu_blocks=cpu), config["max_num_seqs"],
                                 config["max_num_batched_tokens"], watermark=config["watermark"], mode=config["mode"])
        for rid, prompt, max_tokens in workload:
            sched.add(rid, list(prompt), max_tokens)
        where = (f"workload {seed}: {[(rid, len(p), m) for rid, p, m in workload]} (request, prompt length, "
                 f"max tokens), {blocks} GPU / {cpu} CPU blocks of {bs}, {config}")
        for index, theirs in enumerate(expected):
            def step():
                s = sched.schedule()
                summary = [[r.rid for r in s.prefills], [r.rid for r in s.decodes], [list(p) for p in s.preempted],
                           list(s.swapped_in), s.blocks_copied]
                sched.update(s)
                return summary
            ours = outcome(step)
            expect(index, where, "step [prefills, decodes, preempted, swapped in, blocks copied]",
                   ("ok", theirs), ours if ours[0] == "error" else ("ok", plain(ours[1])))
