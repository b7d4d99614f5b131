"""The simulator's sweep, knee and rate helpers against their definitions (mutation testing
found them unchecked: tests/MUTATION.md)."""

import math
import re

import numpy as np
import pytest
from scheduling import make

from pagedlab.engine import BeamSearchParams, SamplingParams, Scheduler, SchedulerConfig
from pagedlab.engine.step import run_step
from pagedlab.memory.contiguous import CATEGORIES
from pagedlab.sim import simulator, synthetic_requests
from pagedlab.sim.calibration import FittedCostModel
from pagedlab.sim.cost_model import CostModel
from pagedlab.sim.memory_sim import SYSTEMS
from pagedlab.sim.simulator import (
    TOKEN,
    PagedConfig,
    Point,
    SimExecutor,
    _drafter,
    knee_rate,
    knee_rates,
    simulate_paged,
    simulate_system,
    sweep,
    with_rate,
)
from pagedlab.sim.traces import Request

COST = CostModel("OPT-13B", "A100-40GB")
# every step takes half a second; a block of 4 tokens (2**18 bytes) crosses PCIe in 0.25 s
HALF_SECOND = FittedCostModel(0.5, {}, kv_bytes_per_token=2**16, swap_bandwidth=2**20)


def by_hand(system, dataset, rate, num_requests, seed=0):
    res = simulate_system(system, synthetic_requests(dataset, num_requests, rate=rate, seed=seed),
                          COST)
    return res.normalized_latency, res.throughput


def test_a_sweep_is_one_run_per_system_and_rate_with_its_documented_defaults(capsys):
    points = sweep(["paged"], "alpaca", [0.1, 1.0], COST)
    # duration 600 s, at least 100 requests, seed 0: 100 requests at 0.1/s, 600 at 1/s
    expected = {("paged", r): by_hand("paged", "alpaca", r, n) for r, n in ((0.1, 100), (1.0, 600))}
    assert {(p.system, p.rate): (p.normalized_latency, p.throughput) for p in points} == expected
    assert capsys.readouterr().err == ""  # no progress bar unless asked


def test_a_sweep_scales_its_trace_with_duration_and_min_requests():
    points = sweep(["paged", "orca-max"], "alpaca", [2.0], COST, duration=30.0, min_requests=10,
                   seed=3)
    assert [(p.normalized_latency, p.throughput) for p in points] == [
        by_hand(s, "alpaca", 2.0, 60, 3) for s in ("paged", "orca-max")]
    with pytest.raises(ValueError, match="duration=0"):
        sweep(["paged"], "alpaca", [1.0], COST, duration=0)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sweep_shows_its_progress_when_asked(capsys, workers):
    args = (["paged"], "alpaca", [0.5, 1.0], COST)
    points = sweep(*args, duration=20.0, min_requests=5, progress=True, workers=workers)
    err = capsys.readouterr().err
    assert re.search(r"(^|\r)simulated runs: .*2/2", err), err
    assert re.search(r"\b(run/s|s/run)\]", err), err
    assert points == sweep(*args, duration=20.0, min_requests=5)  # in processes or not


def test_the_knee_is_where_latency_first_passes_the_threshold():
    assert knee_rate([1, 3], [0.2, 2.2]) == pytest.approx(1.8)  # linear between the rates
    assert knee_rate([1, 2], [0.5, 1.0]) == math.inf  # reaching it is not passing it
    assert knee_rate([1, 2, 4], [0.5, 1.0, 3.0]) == pytest.approx(2.0)


def test_knee_rates_are_one_knee_per_system_in_rate_order():
    def point(system, rate, latency):
        return Point(system, rate, {}, latency, 0.0, 0.0, 0)

    points = [point("b", 3, 2.2), point("a", 2, 0.5), point("b", 1, 0.2), point("a", 1, 0.1)]
    assert knee_rates(points) == {"b": pytest.approx(1.8), "a": math.inf}
    # b: 1 + (0.3 - 0.2) * (3 - 1) / (2.2 - 0.2); a: 1 + (0.3 - 0.1) * (2 - 1) / (0.5 - 0.1)
    assert knee_rates(points, threshold=0.3) == {"b": pytest.approx(1.1), "a": pytest.approx(1.5)}


def test_with_rate_names_a_bad_scale():
    with pytest.raises(ValueError, match="scale=0"):
        with_rate([], 0)


def test_each_point_is_the_run_of_its_config():
    configs = ({}, {"scheduler": SchedulerConfig(max_num_seqs=2)})
    points = sweep(["paged"], "alpaca", [20.0], COST, duration=2.0, min_requests=20,
                   configs=configs)
    for point, paged in zip(points, configs):
        res = simulate_paged(synthetic_requests("alpaca", 40, rate=20.0), COST,
                             PagedConfig(**paged))
        assert point == Point("paged", 20.0, paged, res.normalized_latency, res.throughput,
                              res.mean_batch, res.preemptions)
    assert points[0].mean_batch > 2 >= points[1].mean_batch  # the config changed the run


def test_requests_are_clipped_to_the_models_context_or_2048():
    """Outputs keep at most the context less one token: Llama-2-7B's context is 4096; a
    fitted cost model knows none, and the simulator then assumes 2048."""
    long = Request(0, 0.0, 100, 3000)
    llama = CostModel("Llama-2-7B", "A100-80GB")
    for cost, kept in ((llama, 3000), (HALF_SECOND, 2047)):
        res = simulate_system("paged", [long], cost, num_gpu_blocks=512)
        assert list(res.output_len) == [kept]


def test_an_unknown_system_is_named():
    with pytest.raises(ValueError, match=r"^system='nope' must be one of \("):
        simulate_system("nope", [Request(0, 0.0, 1, 1)], COST)


# --- the executor: a step's time and placeholder tokens -----------------------------------


def sim_scheduler(num_blocks=8, num_cpu_blocks=0, **config):
    return make(num_blocks, 4, num_cpu_blocks, watermark=0.0, **config)


def test_the_executor_prices_a_chunk_after_its_cached_tokens():
    sched = sim_scheduler(max_num_batched_tokens=4, max_num_seqs=4)
    sched.add_request("a", list(range(1, 11)), SamplingParams(max_tokens=1))
    executor = SimExecutor(COST, 4)
    sched.update(executor.execute(sched.schedule()).outputs)  # tokens 0-3
    step = sched.schedule()  # tokens 4-7, after 4 cached
    run = executor.execute(step)
    assert run.seconds == COST.step_time([4], [], 4, prefill_starts=[4])
    assert run.seconds > COST.step_time([4], [], 4)  # re-reading the cached 4 costs time
    assert run.swap_seconds == 0.0 and run.outputs == []


def test_the_executor_prices_swaps_and_samples_placeholders_for_each_sample():
    sched = sim_scheduler(num_blocks=4, num_cpu_blocks=4, preemption_mode="swap")
    a = sched.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=6))
    b = sched.add_request("b", [5, 6, 7], SamplingParams(n=2, max_tokens=3))
    executor = SimExecutor(COST, 4)
    first = executor.execute(sched.schedule())
    # the prompts' step: a placeholder, certain (log 1 = 0), for a; b's one sequence is the
    # parent of both its samples
    assert [(c.parent.seq_id, c.token, c.logprob) for out in first.outputs
            for c in out.children] == [(0, TOKEN, 0.0), (1, TOKEN, 0.0), (1, TOKEN, 0.0)]
    sched.update(first.outputs)
    swaps = []
    while sched.has_unfinished:
        step = sched.schedule()
        run = executor.execute(step)
        moved = len(step.swap_out) + len(step.swap_in)
        assert run.swap_seconds == (COST.swap_time(moved, 4) if moved else 0.0)
        swaps += [moved] if moved else []
        for out in run.outputs:  # then each live sample gets a placeholder of its own
            assert [(c.parent, c.token, c.logprob) for c in out.children] == [
                (s, TOKEN, 0.0) for s in out.group.live]
        sched.update(run.outputs)
    # b's two samples each need a block in the third step: b goes to the CPU, and comes back
    # when a has finished
    assert swaps == [2, 2]
    assert [len(s.output_token_ids) for s in a.seqs + b.seqs] == [6, 3, 3]


def test_the_simulator_cannot_rank_beams():
    sched = sim_scheduler()
    sched.add_request("beams", [1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match=r"^request 'beams': placeholder tokens cannot rank "
                                         r"beams$"):
        SimExecutor(COST, 4).execute(sched.schedule())


@pytest.mark.parametrize("block_size, message", [
    (0, r"^block_size=0 must be > 0"), (2.5, r"^block_size=2.5 must be an integer")])
def test_a_bad_block_size_is_named_before_the_cache_is_sized(block_size, message):
    with pytest.raises(ValueError, match=message):
        simulate_paged([Request(0, 0.0, 1, 1)], COST, PagedConfig(block_size=block_size))


def test_the_unchunked_budget_is_the_models_context_unless_the_caller_sets_one():
    """Without chunking a step's budget is at least the longest sequence (vLLM V0's rule):
    Llama-2-7B's 4096 tokens hold two 2,000-token prompts, a caller's 6,144 three, and a
    fitted cost model, which knows no context, keeps the default 2048: one."""
    prompts = [Request(i, 0.0, 2000, 1) for i in range(3)]
    llama = CostModel("Llama-2-7B", "A100-80GB")
    for cost, max_model_len, first_batch in ((llama, None, 2), (llama, 6144, 3),
                                             (HALF_SECOND, None, 1)):
        config = PagedConfig(num_gpu_blocks=1024, scheduler=SchedulerConfig(
            chunked_prefill=False, max_model_len=max_model_len))
        assert simulate_paged(prompts, cost, config).running[0] == first_batch


# --- a whole run, worked out by hand ------------------------------------------------------------


def simulate(requests, **config):
    return simulate_paged(requests, HALF_SECOND, PagedConfig(block_size=4, **config))


def test_a_run_records_every_step_and_request():
    """A (prompt 4, 3 tokens, at 1.0 s) and B (prompt 2, 1 token, at 1.2 s) in 8 blocks of 4:
    A prefills alone; at 1.5 s A decodes its 5th token as B prefills; at 2.0 s A decodes alone."""
    res = simulate([Request(0, 1.0, 4, 3), Request(1, 1.2, 2, 1)], num_gpu_blocks=8)
    assert res.system == "Paging (block 4)" and res.capacity == 32
    assert res.time.tolist() == [1.0, 1.5, 2.0] and res.duration.tolist() == [0.5] * 3
    assert res.running.tolist() == [1, 2, 1] and res.waiting.tolist() == [0, 0, 0]
    assert res.slots["tokens"].tolist() == [4, 5 + 2, 6]  # in the cache once each step is run
    assert res.slots["rounding"].tolist() == [0, 12 - 7, 8 - 6]  # A's blocks, then B's
    assert res.slots["free"].tolist() == [32 - 4, 32 - 12, 32 - 8]
    assert (res.finished, res.preemptions, res.blocks_swapped, res.swap_seconds) == (2, 0, 0, 0.0)
    assert res.arrival.tolist() == [1.0, 1.2] and res.output_len.tolist() == [3, 1]
    assert res.first_token.tolist() == [1.5, 2.0] and res.finish.tolist() == [2.5, 2.0]


def test_samples_of_one_prompt_count_their_shared_block_once():
    """Two samples of a 4-token prompt: the prompt's block is shared, so after the first decode
    the cache holds 4 + 1 + 1 tokens in 3 blocks, not the 5 + 5 the two contexts read."""
    res = simulate([Request(0, 0.0, 4, 2)], num_gpu_blocks=8, n=2)
    assert res.slots["tokens"].tolist() == [4, 6] and res.slots["rounding"].tolist() == [0, 6]
    assert res.output_len.tolist() == [4] and res.finish.tolist() == [1.0]


def test_a_swapped_request_waits_and_its_copies_take_time():
    """A and B (prompts of 4) in 3 blocks of 4, swap preemption: at 0.5 s A's 5th token takes
    the last block and B, needing one too, goes to the CPU (0.25 s for its block). It waits,
    with too little room to come back and decode, until A finishes its 6 tokens at 3.25 s; then
    it comes back (0.25 s) for its second token."""
    res = simulate([Request(0, 0.0, 4, 6), Request(1, 0.0, 4, 2)], num_gpu_blocks=3,
                   scheduler=SchedulerConfig(preemption_mode="swap"))
    assert res.time.tolist() == [0.0, 0.5, 1.25, 1.75, 2.25, 2.75, 3.25]
    assert res.duration.tolist() == [0.5, 0.75, 0.5, 0.5, 0.5, 0.5, 0.75]
    assert res.running.tolist() == [2, 1, 1, 1, 1, 1, 1]
    assert res.waiting.tolist() == [0, 1, 1, 1, 1, 1, 0]
    assert (res.preemptions, res.blocks_swapped, res.swap_seconds) == (1, 2, 0.5)
    assert res.first_token.tolist() == [0.5, 0.5] and res.finish.tolist() == [3.25, 4.0]


def test_a_prompt_given_no_chunk_in_a_step_still_holds_its_tokens():
    """4 blocks of 4, a budget of 4: A (prompt 4, 5 tokens) prefills, then decodes beside B's
    12-token prompt in chunks of 3, 3 and 2 (the last two cut by the free room). In step 4 the
    cache is full and B gets no chunk, yet its 8 tokens are still stored; B finishes its
    prompt once A has left."""
    res = simulate([Request(0, 0.0, 4, 5), Request(1, 0.0, 12, 1)], num_gpu_blocks=4,
                   scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4))
    assert res.running.tolist() == [1, 2, 2, 2, 1, 1]
    assert res.slots["tokens"].tolist() == [4, 5 + 3, 6 + 6, 7 + 8, 8 + 8, 12]
    assert res.slots["rounding"].tolist() == [0, 12 - 8, 16 - 12, 16 - 15, 0, 0]
    assert res.finish.tolist() == [2.5, 3.0]


def test_swap_space_smaller_than_a_block_is_none():
    """Half a block of swap space (2**17 bytes) holds no block: B, preempted as in the swap
    run above, is recomputed instead."""
    res = simulate([Request(0, 0.0, 4, 6), Request(1, 0.0, 4, 2)], num_gpu_blocks=3,
                   swap_space_gib=2**17 / 2**30, scheduler=SchedulerConfig(preemption_mode="swap"))
    assert (res.preemptions, res.blocks_swapped, res.swap_seconds) == (1, 0, 0.0)


def test_token_times_are_recorded_only_when_asked_at_each_steps_end():
    """Half-second steps: a 5-token prompt's first token comes at 0.5 s, the next two at 1.0
    and 1.5 s, when the request finishes."""
    run = simulate_paged([Request(0, 0.0, 5, 3)], HALF_SECOND,
                         PagedConfig(block_size=4, num_gpu_blocks=8, record_token_times=True))
    assert run.token_times == [[0.5, 1.0, 1.5]]
    assert (run.first_token[0], run.finish[0]) == (0.5, 1.5)
    quiet = simulate_paged([Request(0, 0.0, 5, 3)], HALF_SECOND,
                           PagedConfig(block_size=4, num_gpu_blocks=8))
    assert quiet.token_times is None


def test_the_simulators_drafter_is_the_configs_ngram_lookup_and_refuses_a_draft_model():
    from pagedlab.sim.simulator import _drafter

    drafter = _drafter(SchedulerConfig(speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
        "prompt_lookup_max": 3}))
    assert (drafter.proposer.min_n, drafter.proposer.max_n, drafter.k) == (2, 3, 2)
    with pytest.raises(ValueError, match=r"^the simulator proposes by n-gram lookup, not "
                                         r"'draft_model': price a draft model with "
                                         r"PagedConfig.draft_cost$"):
        _drafter(SchedulerConfig(speculative_config={"method": "draft_model",
                                                     "draft_layers": 1}))


def test_a_sim_executor_accepts_nothing_costs_no_draft_and_draws_from_seed_0_by_default():
    default, seeded = SimExecutor(COST, 16), SimExecutor(COST, 16, seed=0)
    assert (default.acceptance_rate, default.draft_cost) == (0.0, 0.0)
    assert default.rng.random(4).tolist() == seeded.rng.random(4).tolist()


# --- speculative decoding: what a draft costs and which proposals are kept ----------------------

SPEC = SchedulerConfig(speculative_config={"num_speculative_tokens": 2})


class Recording(Scheduler):
    """The engine's scheduler, keeping each request's group and, after each step, how many
    tokens each request has (the simulator takes any Scheduler subclass)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups, self.tokens = {}, []

    def add_request(self, request_id, *args, **kwargs):
        self.groups[request_id] = super().add_request(request_id, *args, **kwargs)
        return self.groups[request_id]

    def update(self, outputs):
        finished = super().update(outputs)
        self.tokens.append({rid: len(g.seqs[0].output_token_ids)
                            for rid, g in self.groups.items()})
        return finished


def run_recorded(requests, cost, config):
    """simulate_paged with a Recording scheduler: the run, and the scheduler it ran."""
    made = []

    def build(*args, **kwargs):
        made.append(Recording(*args, **kwargs))
        return made[0]

    return simulate_paged(requests, cost, config, scheduler_class=build), made[0]


def test_a_draft_pass_costs_draft_cost_of_the_targets_decode_step_over_the_same_sequence():
    """A (prompt 4, 7 tokens), 2 proposals a step, all accepted: its verification steps begin
    with 5 and 8 tokens in its context, so a draft of cost c adds c times 2 decode steps of the
    target over those contexts, the price of the plain run's 2nd and 5th steps. Checked with a
    cost model that prices each key read (a fit: one token off changes the price) and one that
    reads whole blocks (the datasheet's: a pass priced without the block size reads fewer)."""
    per_key = FittedCostModel(0.5, {"decode_seqs": 0.01, "kv_tokens_read": 0.001},
                              kv_bytes_per_token=2**16, swap_bandwidth=2**20)
    c = 0.25
    for cost in (per_key, COST):
        def durations(scheduler=SchedulerConfig(), **config):
            return simulate_paged([Request(0, 0.0, 4, 7)], cost, PagedConfig(
                block_size=4, num_gpu_blocks=16, scheduler=scheduler, **config)).duration

        plain, free = durations(), durations(SPEC, acceptance_rate=1.0)
        drafted = durations(SPEC, acceptance_rate=1.0, draft_cost=c)
        assert len(plain) == 7 and len(free) == len(drafted) == 3  # 1 + 3 + 3 tokens
        assert drafted[0] == free[0]  # the prompt's step drafts nothing
        assert drafted[1:] - free[1:] == pytest.approx(c * 2 * plain[[1, 4]], rel=1e-9)


def test_only_the_sequences_that_proposed_take_accepted_tokens():
    """Every proposal accepted: A (prompt 4, 7 tokens) takes 1, then 3, then 3 tokens a step.
    B (prompt 4, 2 tokens) arrives during A's first step; it prefills beside A's verification
    and then, one token left, proposes nothing: it takes one token a step, as without
    speculation, though the steps it runs in verify A's proposals."""
    run, sched = run_recorded([Request(0, 0.0, 4, 7), Request(1, 0.25, 4, 2)], HALF_SECOND,
                              PagedConfig(block_size=4, num_gpu_blocks=16, scheduler=SPEC,
                                          acceptance_rate=1.0))
    assert sched.tokens == [{0: 1}, {0: 4, 1: 1}, {0: 7, 1: 2}]
    assert run.finish.tolist() == [1.5, 1.5]


def test_accepted_placeholders_are_as_certain_as_sampled_ones():
    """A placeholder has log-probability 0 (probability 1), whether sampled or an accepted
    proposal: after a run in which A accepts 4 proposals, every sequence's cumulative
    log-probability is still 0, as after a run without speculation."""
    _, sched = run_recorded([Request(0, 0.0, 4, 7), Request(1, 0.25, 4, 2)], HALF_SECOND,
                            PagedConfig(block_size=4, num_gpu_blocks=16, scheduler=SPEC,
                                        acceptance_rate=1.0))
    assert sched.spec_stats.num_accepted_tokens == 4
    assert [g.seqs[0].cumulative_logprob for g in sched.groups.values()] == [0.0, 0.0]


class Draws:
    """A generator whose every draw is ``u`` (numpy's draws are uniform on [0, 1), so 0 is
    one of them)."""

    def __init__(self, u):
        self.u = u

    def random(self, k):
        return np.full(k, self.u)


@pytest.mark.parametrize("rate, u, accepted", [
    (0.0, 0.0, 0), (0.5, 0.5, 0), (0.5, np.nextafter(0.5, 0), 2), (1.0, np.nextafter(1, 0), 2)])
def test_a_proposal_is_accepted_when_its_draw_is_below_the_acceptance_rate(rate, u, accepted):
    """A proposal is accepted when its draw u, uniform on [0, 1), is below acceptance_rate: that
    has probability exactly acceptance_rate. So a rate of 0 accepts nothing, even at the draw
    0; a draw equal to the rate is not accepted, the one just below it is; a rate of 1 accepts
    every draw. A prompt of 4 placeholders, 2 proposals verified in its second step."""
    sched = sim_scheduler(num_blocks=16, speculative_config={"num_speculative_tokens": 2})
    group = sched.add_request("a", [TOKEN] * 4, SamplingParams(max_tokens=7))
    executor = SimExecutor(COST, 4, acceptance_rate=rate)
    executor.rng = Draws(u)
    drafter = _drafter(sched.config)
    run_step(sched, executor, drafter=drafter)  # the prompt's token, then 2 proposals
    step, _, _ = run_step(sched, executor, drafter=drafter)
    assert step.num_draft_tokens == 2
    assert len(group.seqs[0].output_token_ids) == 1 + accepted + 1  # and the verifier's own


def test_every_slot_category_counts_whole_slots_in_every_system():
    """Slots are counted, never split: every category of a paged run, the ones paging never
    fills included, is an integer array, as each baseline's is (a table of them prints 0,
    not 0.0)."""
    requests = [Request(0, 0.0, 4, 3), Request(1, 0.5, 6, 2)]
    for system in SYSTEMS:
        res = simulate_system(system, requests, COST)
        assert {c: res.slots[c].dtype.kind for c in CATEGORIES} == dict.fromkeys(CATEGORIES, "i")


class FakePool:
    """Stands for ProcessPoolExecutor: records the workers asked for, maps in this process."""

    made = []

    def __init__(self, max_workers):
        self.made.append(max_workers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, jobs):
        return map(fn, jobs)


def test_a_sweep_runs_here_unless_given_more_than_one_worker_and_then_in_that_many(monkeypatch):
    """By default (workers=1) the points are computed in this process; workers=n > 1 asks for a
    pool of exactly n processes (a fake pool records it: the same points)."""
    monkeypatch.setattr(simulator, "ProcessPoolExecutor", FakePool)
    monkeypatch.setattr(FakePool, "made", [])
    args = (["paged"], "alpaca", [0.5], COST)
    runs = [sweep(*args, duration=20.0, min_requests=5, **workers)
            for workers in ({}, {"workers": 1}, {"workers": 2}, {"workers": 3})]
    assert FakePool.made == [2, 3]
    assert runs[1:] == [runs[0]] * 3
