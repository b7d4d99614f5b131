"""Hidden checks of A6: the policy's order on random queues, the audit's flags on runs that do
and do not preempt, and latency_by_prompt on random results. The schedulers and workloads are
the grader's own (not the notebook's helpers, which a submission could rebind)."""

import types

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pagedlab.engine import FCFS, SamplingParams, Scheduler, SchedulerConfig
from pagedlab_course.grade import task
from pagedlab_course.grade.checks import GRADING
from pagedlab.memory import KVCacheManager
from pagedlab.sim import CostModel, PagedConfig, clip_to_context, synthetic_requests


@task("A6.1")
@GRADING
@given(st.lists(st.integers(1, 6), min_size=1, max_size=12))
def check_admission_order(nb, lengths):
    """Under shortest prompt first the waiting queue is ordered by prompt length, ties by arrival."""
    prompts = [(f"r{i}", 4 * n) for i, n in enumerate(lengths)]
    sched = Scheduler(KVCacheManager(64, block_size=4),
                      SchedulerConfig(policy=nb.ShortestPromptFirst(), watermark=0.0, chunked_prefill=False))
    for request_id, prompt_len in prompts:
        sched.add_request(request_id, [0] * prompt_len, SamplingParams(max_tokens=8, ignore_eos=True))
    expected = [rid for rid, _ in sorted(prompts, key=lambda p: (p[1], int(p[0][1:])))]
    got = [g.request_id for g in sched.waiting]
    assert got == expected, f"prompts {prompts}\n    expected order: {expected}\n    actual:         {got}"


@task("A6.3")
def check_audit_flags(nb):
    """audit reports no preemption in a roomy pool, and preemption in a tight one; every other
    property holds in both."""
    cost = CostModel("OPT-13B", "A100-40GB")  # the notebook's simulated GPU
    for blocks, preempted in ((5000, False), (120, True)):
        requests = clip_to_context(synthetic_requests("sharegpt", 30, rate=10.0, seed=11), cost.model.max_context)
        config = PagedConfig(num_gpu_blocks=blocks, scheduler=SchedulerConfig(policy=FCFS()))
        flags = nb.audit(requests, config)
        expected = {"all finished once": True, "full outputs": True, "no block leaked": True, "preempted": preempted}
        assert flags == expected, f"{len(requests)} requests into {blocks} blocks\n    expected: {expected}\n    actual:   {flags}"


@task("A6.4")
@GRADING
@given(st.integers(1, 5), st.integers(0, 999))
def check_latency_by_prompt(nb, tens, seed):
    """The mean latency of the longest-prompt tenth and of the rest, on random results."""
    rng = np.random.default_rng(seed)
    n = 10 * tens
    lens = rng.permutation(np.arange(1, n + 1) * 7)  # distinct: the tenth is unambiguous
    arrival = np.sort(rng.uniform(0, 100, n))
    finish = arrival + rng.uniform(1, 50, n)
    result = types.SimpleNamespace(arrival=arrival, finish=finish)
    requests = [types.SimpleNamespace(prompt_len=int(p)) for p in lens]
    long = lens > np.sort(lens)[-tens - 1]
    expected = ((finish - arrival)[long].mean(), (finish - arrival)[~long].mean())
    got = nb.latency_by_prompt(result, requests)
    assert np.allclose(got, expected), f"{n} requests\n    expected: {expected}\n    actual:   {got}"
