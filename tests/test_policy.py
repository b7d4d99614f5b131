"""Scheduling policies: FCFS as before, another order of admission and of preemption where a
policy asks for it, nothing lost or duplicated, errors that name the request."""

import pickle
from dataclasses import dataclass

import numpy as np
import pytest
from _tiny import random_prompts, tiny_hf
from scheduling import make, run_step

from pagedlab import LLM, SamplingParams
from pagedlab.engine import (
    FCFS,
    Policy,
    Priority,
    Scheduler,
    SchedulerConfig,
)
from pagedlab.model import from_hf
from pagedlab.sim import synthetic_requests
from pagedlab.sim.cost_model import CostModel
from pagedlab.sim.simulator import PagedConfig, simulate_paged, sweep

COST = CostModel("OPT-13B", "A100-40GB")


@dataclass(frozen=True)
class ShortestPromptFirst(Policy):
    def key(self, group):
        return len(group.prompt_token_ids), group.arrival


def scheduler(requests, num_blocks=64, num_cpu_blocks=0, block_size=4, **config):
    """A model-free scheduler with ``requests`` (id, prompt length, max tokens, priority)."""
    sched = make(num_blocks, block_size, num_cpu_blocks, **config)
    for rid, prompt_len, max_tokens, priority in requests:
        add(sched, rid, prompt_len, max_tokens, priority)
    return sched


def add(sched, rid, prompt_len, max_tokens, priority=0):
    sched.add_request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens),
                      priority=priority)


def step(sched):
    """One step, every sequence sampling token 1; the step and the groups it finished."""
    return run_step(sched, token=1)


def admitted(s):
    """The requests admitted in step ``s``, in order: their first chunk starts at 0 (no
    prefix caching here); later chunks of a prompt continue a running request."""
    prefilled = {c.seq.seq_id for c in s.prefills if c.start == 0}
    return [g.request_id for g in s.groups if any(q.seq_id in prefilled for q in g.seqs)]


def test_fcfs_is_the_default_and_admits_by_arrival():
    assert SchedulerConfig().policy == FCFS()
    requests = [("a", 4, 2, 2), ("b", 4, 2, 0), ("c", 4, 2, 1), ("d", 4, 2, 0)]
    default = scheduler(requests, max_num_seqs=2)
    explicit = scheduler(requests, max_num_seqs=2, policy=FCFS())
    order = []
    while default.has_unfinished:
        (s, _), (t, _) = step(default), step(explicit)
        assert s.stats == t.stats
        order.append(admitted(s))
    assert order == [["a", "b"], [], ["c", "d"], []]  # priorities ignored


def test_priority_admits_the_most_urgent_first_even_when_it_arrives_later():
    requests = [("a", 4, 2, 2), ("b", 4, 2, 0), ("c", 4, 2, 1), ("d", 4, 2, 0)]
    sched = scheduler(requests, max_num_seqs=2, policy=Priority())
    order = []
    while sched.has_unfinished:
        order.append(admitted(step(sched)[0]))
        if len(order) == 1:
            add(sched, "e", 4, 2, priority=-1)  # arrives last, most urgent
    # by hand: two seats; (priority, arrival) orders b, d, e, c, a; each runs two steps
    assert order == [["b", "d"], [], ["e", "c"], [], ["a"], []]


def test_shortest_prompt_first_passes_a_long_head_of_the_queue():
    requests = [("a50", 50, 4, 0), ("b10", 10, 4, 0), ("c30", 30, 4, 0)]
    config = dict(max_num_seqs=4, max_num_batched_tokens=64, chunked_prefill=False)
    fcfs = scheduler(requests, **config)
    spf = scheduler(requests, **config, policy=ShortestPromptFirst())
    # whole prompts, a budget of 64: FCFS takes 50 + 10 and stops at 30; shortest first 10 + 30
    assert admitted(fcfs.schedule()) == ["a50", "b10"]
    assert admitted(spf.schedule()) == ["b10", "c30"]
    assert [g.request_id for g in spf.waiting] == ["a50"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize(
    "policy, victims", [(FCFS(), ("r3", "r2")), (Priority(), ("r0", "r3"))]
)
def test_the_victims_are_the_policys_last(mode, policy, victims):
    # Four 4-token prompts fill 4 of 5 blocks; each next token needs a fresh block. The
    # first group in the policy's order takes the free block; the second must take one from
    # the policy's last group (while two are still queued behind it), and the third, left
    # last, gives its own. Priorities r0: 3, r1: 0, r2: 1, r3: 2 rank r1, r2, r3, r0.
    requests = [("r0", 4, 8, 3), ("r1", 4, 8, 0), ("r2", 4, 8, 1), ("r3", 4, 8, 2)]
    sched = scheduler(requests, num_blocks=5, num_cpu_blocks=8, watermark=0.0,
                      preemption_mode=mode, policy=policy)
    first, _ = step(sched)
    assert first.stats.prefill_seqs == 4
    second, _ = step(sched)
    assert second.stats.preempted == tuple((v, mode) for v in victims)
    assert second.stats.decode_seqs == 2
    while sched.has_unfinished:
        step(sched)
    assert sched.manager.num_used_blocks == 0 and sched.manager.cpu.num_used == 0


def workload(seed, num=40):
    rng = np.random.default_rng(seed)
    return [(f"r{i}", int(p), int(o), int(q)) for i, (p, o, q) in enumerate(zip(
        rng.integers(4, 40, num), rng.integers(4, 60, num), rng.integers(0, 3, num)))]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", [FCFS(), Priority(), ShortestPromptFirst()])
def test_policy_order_holds_every_step_and_nothing_is_lost(mode, policy, seed_offset):
    """Each step: admissions are a prefix of the waiting queue in the policy's order, victims
    the running groups' tail in reverse; every request is in exactly one place."""
    requests = workload(seed=1 + seed_offset)
    sched = scheduler(requests, num_blocks=40, num_cpu_blocks=12, max_num_seqs=8,
                      max_num_batched_tokens=128, watermark=0.0, preemption_mode=mode,
                      policy=policy)
    finished, preempted = [], 0
    while sched.has_unfinished:
        waiting = sorted(sched.waiting, key=policy.key)
        running = sorted(sched.running, key=policy.key)
        assert list(sched.waiting) == waiting  # kept in order as groups join it
        s, done = step(sched)
        news = admitted(s)
        assert news == [g.request_id for g in waiting[:len(news)]]
        victims = [g.request_id for g, _ in s.preempted]
        preempted += len(victims)
        assert victims == [g.request_id for g in running[::-1][:len(victims)]]
        finished += [g.request_id for g in done]
        places = finished + [g.request_id for q in (sched.waiting, sched.running, sched.swapped)
                             for g in q]
        assert sorted(places) == sorted(r[0] for r in requests)  # each once
    assert preempted > 0
    assert sched.manager.num_used_blocks == 0 and sched.manager.cpu.num_used == 0


def test_fcfs_queues_stay_in_arrival_order_when_swapping_falls_back_to_recompute(seed_offset):
    requests = [(rid, p, o, 0) for rid, p, o, _ in workload(seed=2 + seed_offset)]
    sched = scheduler(requests, num_blocks=40, num_cpu_blocks=6, max_num_seqs=8,
                      max_num_batched_tokens=128, watermark=0.0, preemption_mode="swap")
    modes, first_admitted = set(), []
    while sched.has_unfinished:
        s, _ = step(sched)
        modes |= {mode for _, mode in s.preempted}
        first_admitted += [r for r in admitted(s) if r not in first_admitted]
        for queue in (sched.waiting, sched.swapped):
            arrivals = [g.arrival for g in queue]
            assert arrivals == sorted(arrivals)
    assert modes == {"swap", "recompute"}  # the CPU pool filled up
    assert first_admitted == [r[0] for r in requests]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_simulator_serves_every_request_once_under_another_policy(mode):
    requests = synthetic_requests("sharegpt", 120, rate=20.0, seed=3)
    finished = []

    class Recording(Scheduler):
        def update(self, outputs):
            done = super().update(outputs)
            finished.extend(done)
            return done

    schedulers = []

    def factory(manager, config):
        schedulers.append(Recording(manager, config))
        return schedulers[-1]

    def config(policy):
        return PagedConfig(num_gpu_blocks=200,
                           scheduler=SchedulerConfig(preemption_mode=mode, policy=policy))

    result = simulate_paged(requests, COST, config(ShortestPromptFirst()), scheduler_class=factory)
    assert result.preemptions > 0
    assert sorted(g.request_id for g in finished) == [r.id for r in requests]
    lengths = {g.request_id: len(g.seqs[0].output_token_ids) for g in finished}
    assert all(lengths[r.id] == r.output_len for r in requests)
    (sched,) = schedulers
    sched.manager.check_invariants()
    assert sched.manager.num_used_blocks == 0 and sched.manager.cpu.num_used == 0
    fcfs = simulate_paged(requests, COST, config(FCFS()))
    assert not np.array_equal(result.finish, fcfs.finish)  # the policy changed something


def test_configs_with_a_policy_hash_pickle_and_sweep_in_processes():
    config = SchedulerConfig(policy=Priority())
    assert hash(config) == hash(SchedulerConfig(policy=Priority()))
    assert pickle.loads(pickle.dumps(config)) == config
    points = sweep(["paged"], "alpaca", [4.0], COST, duration=5.0, min_requests=20, workers=2,
                   configs=[{"scheduler": config}, {"scheduler": SchedulerConfig()}])
    assert len(points) == 2 and all(p.normalized_latency > 0 for p in points)


def test_policy_errors_are_clear():
    with pytest.raises(TypeError, match="an instance, not the class"):
        SchedulerConfig(policy=FCFS)

    class NoKey(Policy):
        pass

    with pytest.raises(NotImplementedError, match="NoKey must define key"):
        scheduler([("a", 4, 2, 0)], policy=NoKey())

    @dataclass(frozen=True)
    class Broken(Policy):
        def key(self, group):
            return None if group.request_id == "b" else group.arrival

    sched = scheduler([("a", 4, 2, 0)], policy=Broken())
    with pytest.raises(TypeError, match=r"Broken\(\)\.key gives ranks that do not compare.*"
                                        r"'a': 0, 'b': None"):
        add(sched, "b", 4, 2)


def test_engine_serves_by_priority_with_the_same_outputs():
    hf = tiny_hf("qwen2-mqa-d32-tied")
    model = from_hf(hf)
    prompts = random_prompts([5, 7, 4, 6], hf.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=4)
    outputs = {}
    for policy in ("fcfs", "priority"):
        llm = LLM(model, block_size=4, num_gpu_blocks=32, max_num_seqs=2, record_events=True,
                  scheduling_policy=policy)
        outs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1, 0])
        outputs[policy] = [o.outputs[0].token_ids for o in outs]
        admitted_seqs = [e.seq_id for e in llm.manager.events if e.kind == "allocate"]
        assert admitted_seqs == ([0, 1, 2, 3] if policy == "fcfs" else [1, 3, 2, 0])
    assert outputs["fcfs"] == outputs["priority"]  # the order of service changes no token
    with pytest.raises(ValueError, match="known policies: fcfs, priority"):
        LLM(model, num_gpu_blocks=8, scheduling_policy="sjf")
    with pytest.raises(ValueError, match="2 priorities for 4 prompts"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
