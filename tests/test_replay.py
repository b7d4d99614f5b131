"""Timed replay, calibration and validation: metrics worked out by hand on a tiny trace under an
injected clock, the fit against known constants, the simulator against an exact replay."""

import dataclasses
import math

import numpy as np
import pytest

from _tiny import tiny_hf
from pagedlab import LLM, SamplingParams
from pagedlab.model import from_hf
from pagedlab.sim.calibration import (
    FittedCostModel,
    StepShape,
    StepTiming,
    features,
    fit_cost_model,
    profile,
    relative_errors,
)
from pagedlab.sim.replay import capacity, errors, percentiles, predict, replay
from pagedlab.sim.simulator import PagedConfig, simulate_paged
from pagedlab.sim.traces import Request

STEP = 1.0  # fake seconds per step
PER_PREFILL_TOKEN = 0.25


class FakeClock:
    """A clock that moves only when the replay sleeps or the model runs a step."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


@pytest.fixture
def timed_llm(monkeypatch):
    """A factory of tiny models' engines whose steps take STEP + PER_PREFILL_TOKEN * prefilled
    tokens on a fake clock. The engine's own metrics keep the real clock: the replay times
    requests by the clock it is given, as a client would."""
    clock = FakeClock()

    def make(**kwargs):
        llm = LLM(from_hf(tiny_hf("llama-mha-d32")), block_size=4, num_gpu_blocks=16, **kwargs)
        execute = llm.runner.execute

        def slow_execute(step, *args):
            clock.now += STEP + PER_PREFILL_TOKEN * sum(c.num_tokens for c in step.prefills)
            return execute(step, *args)

        monkeypatch.setattr(llm.runner, "execute", slow_execute)
        return llm, clock

    return make


# Request 0 at 0 s: 4 prompt tokens, 3 outputs; request 1 at 0.5 s: 2 and 2; request 2 at
# 10 s, after the engine has gone idle: 3 and 1. By hand, with steps of 1 s + 0.25 s per
# prefilled token:
#   step 1 [0, 2):      prefill r0 (4 tokens)                -> r0's first token at 2
#   step 2 [2, 3.5):    decode r0 (context 5), prefill r1    -> r1's first token at 3.5
#   step 3 [3.5, 4.5):  decode r0 (context 6), r1 (context 3) -> both finish at 4.5
#   idle until 10; step 4 [10, 11.75): prefill r2 (3 tokens) -> r2 first and last at 11.75
TRACE = [Request(0, 0.0, 4, 3), Request(1, 0.5, 2, 2), Request(2, 10.0, 3, 1)]
EXPECTED = {  # id: (ttft, tpot, latency)
    0: (2.0, (4.5 - 2.0) / 2, 4.5),
    1: (3.5 - 0.5, 4.5 - 3.5, 4.5 - 0.5),
    2: (1.75, math.nan, 1.75),
}


def test_replay_metrics_match_the_hand_computed_run(timed_llm):
    llm, clock = timed_llm()
    run = replay(llm, TRACE, clock=clock.monotonic, sleep=clock.sleep)
    for r in run.requests:
        assert (r.ttft, r.tpot, r.latency) == pytest.approx(EXPECTED[r.id], nan_ok=True)
    assert [(s.start, s.duration) for s in run.steps] == [(0, 2), (2, 1.5), (3.5, 1), (10, 1.75)]
    assert [s.batch for s in run.steps] == [1, 2, 2, 1]
    assert [s.feature("prefill_tokens") for s in run.steps] == [4, 2, 0, 3]
    assert [s.feature("decode_seqs") for s in run.steps] == [0, 1, 2, 0]
    assert [s.feature("kv_tokens_read") for s in run.steps] == [0, 5, 6 + 3, 0]
    assert (run.settings.num_gpu_blocks, run.settings.block_size) == (16, 4)
    assert not llm.has_unfinished_requests()


def test_simulator_predicts_an_exactly_priced_replay_exactly(timed_llm):
    llm, clock = timed_llm()
    measured = replay(llm, TRACE, clock=clock.monotonic, sleep=clock.sleep)
    exact = FittedCostModel(STEP, {"prefill_tokens": PER_PREFILL_TOKEN}, kv_bytes_per_token=1,
                            swap_bandwidth=1.0)
    predicted = predict(measured, exact)
    for m, p in zip(measured.requests, predicted.requests):
        assert (p.ttft, p.tpot, p.latency) == pytest.approx((m.ttft, m.tpot, m.latency),
                                                            nan_ok=True)
    assert all(e == pytest.approx(0) for metric in errors(measured, predicted).values()
               for e in metric.values())
    # flat out, all three at once: one step prefills 9 tokens (3.25 s, r2 done), then two
    # decode steps of 1 s (r1 done, then r0): 3 requests in 5.25 s
    assert capacity(TRACE, exact, measured.settings) == pytest.approx(3 / 5.25)
    slower = FittedCostModel(2 * STEP, {"prefill_tokens": 2 * PER_PREFILL_TOKEN}, 1, 1.0)
    # twice the step times: r0 and r2 (alone on an idle engine) finish in twice the time; r1
    # arrives 0.5 s into the first step, which now ends at 4, and its own steps end at 9
    latencies = predict(measured, slower).metric("latency")
    assert latencies == pytest.approx([9.0, 9.0 - 0.5, 3.5])
    assert percentiles(predict(measured, slower), "latency") == pytest.approx(
        {"median": 8.5, "p90": 8.5 + 0.8 * (9.0 - 8.5)})


def test_a_prompt_in_chunks_is_timed_and_predicted_chunk_by_chunk(timed_llm):
    llm, clock = timed_llm(max_num_seqs=2, max_num_batched_tokens=3)
    # 8 prompt tokens in chunks of 3, 3 and 2 (1.75, 1.75 and 1.5 s), then one decode (1 s)
    run = replay(llm, [Request(0, 0.0, 8, 2)], clock=clock.monotonic, sleep=clock.sleep)
    assert [(s.shape.prefill_lens, s.shape.prefill_starts, s.shape.decode_lens)
            for s in run.steps] == [((3,), (0,), ()), ((3,), (3,), ()), ((2,), (6,), ()),
                                    ((), (), (9,))]
    assert [s.feature("kv_tokens_read") for s in run.steps] == [0, 3, 6, 9]
    (r,) = run.requests
    assert (r.ttft, r.tpot, r.latency) == pytest.approx((5.0, 1.0, 6.0))
    exact = FittedCostModel(STEP, {"prefill_tokens": PER_PREFILL_TOKEN}, 1, 1.0)
    (p,) = predict(run, exact).requests
    assert (p.ttft, p.tpot, p.latency) == pytest.approx((5.0, 1.0, 6.0))


def synthetic_steps(rng, n=200):
    """Steps of random shapes: some prefill-only, some decode-only, some mixed."""
    steps = []
    for i in range(n):
        decodes = tuple(rng.integers(2, 300, rng.integers(0, 24) if i % 3 else 0).tolist())
        prefills = tuple(rng.integers(1, 200, rng.integers(0 if decodes else 1, 4)).tolist())
        starts = tuple(rng.integers(0, 64, len(prefills)).tolist())
        steps.append(StepShape(prefills, starts, decodes))
    return steps


def test_fit_recovers_known_constants(seed_offset):
    rng = np.random.default_rng(seed_offset)
    truth = {"decode_seqs": 2e-3, "prefill_tokens": 1.5e-3, "kv_tokens_read": 4e-6,
             "attention_pairs": 3e-8}
    shapes = synthetic_steps(rng)
    exact = [0.03 + sum(c * features(s.prefill_lens, s.decode_lens, s.prefill_starts)[n]
                        for n, c in truth.items()) for s in shapes]
    fit = fit_cost_model([StepTiming(0, t, s) for t, s in zip(exact, shapes)], tuple(truth),
                         kv_bytes_per_token=1, swap_bandwidth=1.0)
    assert fit.constant == pytest.approx(0.03, rel=1e-6)
    assert fit.coefficients == pytest.approx(truth, rel=1e-6)
    assert np.abs(fit.residuals).max() < 1e-9
    # with 5% noise the fit still lands near the truth, and its residuals are the noise's size
    noisy = [t * (1 + 0.05 * rng.standard_normal()) for t in exact]
    fit = fit_cost_model([StepTiming(0, t, s) for t, s in zip(noisy, shapes)], tuple(truth),
                         kv_bytes_per_token=1, swap_bandwidth=1.0)
    predicted = np.array([fit.step_time(s.prefill_lens, s.decode_lens, 16, s.prefill_starts)
                          for s in shapes])
    # measured against the draw's own noise, not the nominal 5% (a bound of 3.5% held at seed 0
    # and failed at 7 seeds of 300; these hold at 1,000 of 1,000)
    noise = np.sqrt(np.mean((np.array(noisy) / exact - 1) ** 2))
    error = np.sqrt(np.mean((predicted / exact - 1) ** 2))
    assert error < noise  # nearer the truth than the data
    assert fit.coefficients["prefill_tokens"] == pytest.approx(1.5e-3, rel=0.1)
    assert 0.9 * noise < fit.rms_relative_error < 1.1 * (noise + error)  # the noise, and the error
    assert fit.residuals == pytest.approx(np.array(noisy) - predicted)
    assert predicted.sum() == pytest.approx(sum(noisy))  # the fitted times add up


def test_a_feature_the_noise_would_price_below_zero_is_priced_zero():
    """Steps whose time does not depend on the cached tokens read, timed with noise: a plain
    fit gives that feature a small negative price (chapter 10 once printed "-3 µs per cached
    token read"); the fit keeps it at zero and the other terms still add up."""
    rng = np.random.default_rng(1)
    shapes = synthetic_steps(rng, 40)
    exact = [0.03 + 2e-3 * len(s.decode_lens) + 1.5e-3 * sum(s.prefill_lens) for s in shapes]
    names = ("decode_seqs", "prefill_tokens", "kv_tokens_read")
    for seed in range(20):  # noise draws until one pushes the plain fit below zero
        noisy = np.array(exact) * (1 + 0.1 * np.random.default_rng(seed).standard_normal(40))
        x = np.array([[1.0] + [features(s.prefill_lens, s.decode_lens, s.prefill_starts)[n]
                               for n in names] for s in shapes])
        if np.linalg.lstsq(x, noisy, rcond=None)[0][3] < 0:
            break
    else:
        pytest.fail("no noise draw gave a negative plain-fit price")
    fit = fit_cost_model([StepTiming(0, t, s) for t, s in zip(noisy, shapes)], names,
                         kv_bytes_per_token=1, swap_bandwidth=1.0)
    assert fit.coefficients["kv_tokens_read"] == 0
    assert min(fit.coefficients.values()) >= 0
    assert fit.coefficients["prefill_tokens"] == pytest.approx(1.5e-3, rel=0.1)
    assert fit.residuals.sum() == pytest.approx(0, abs=1e-9)  # the fitted times add up
    # nothing non-negative fits better: nudging the zero price up only raises the error
    worse = fit.residuals - 1e-7 * x[:, 3]
    assert np.sum(worse ** 2) > np.sum(fit.residuals ** 2)


def test_fitted_model_prices_steps_and_swaps_as_a_cost_model_does():
    fit = FittedCostModel(0.01, {"decode_seqs": 0.002, "prefill_tokens": 0.001}, 1000, 1e6)
    assert fit.step_time() == 0.0
    # 3 tokens after 2 cached: queries at positions 2, 3, 4 see 3 + 4 + 5 keys; then a fresh 4
    assert features([3, 4], [5, 7], [2, 0]) == {
        "decode_seqs": 2, "prefill_tokens": 7, "kv_tokens_read": 2 + 5 + 7,
        "attention_pairs": (3 + 4 + 5) + (1 + 2 + 3 + 4), "prefill_seqs": 2}
    assert fit.step_time([10, 5], [40, 50, 60]) == pytest.approx(0.01 + 0.006 + 0.015)
    assert fit.swap_time(3, 16) == pytest.approx(3 * 16 * 1000 / 1e6)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        fit.kv_capacity_tokens()
    # the simulator takes it with its default scheduler (no model context: the default budget)
    run = simulate_paged([Request(0, 0.0, 5, 3)], fit, PagedConfig(num_gpu_blocks=8))
    assert run.finish[0] == pytest.approx(fit.step_time([5]) + 2 * fit.step_time((), [6]))
    with pytest.raises(ValueError, match="unknown feature.*'bogus'"):
        fit_cost_model([], ("bogus",), kv_bytes_per_token=1, swap_bandwidth=1.0)
    with pytest.raises(ValueError, match="2 steps cannot fit 4 constants"):
        fit_cost_model([StepTiming(0, 1, StepShape((1,), (0,), ()))] * 2,
                       kv_bytes_per_token=1, swap_bandwidth=1.0)


@pytest.mark.parametrize("call, message", [
    (lambda fit: fit.swap_time(-1, 16), r"^num_blocks=-1 must be >= 0$"),
    (lambda fit: fit.swap_time(1.5, 16), r"^num_blocks=1.5 must be an integer$"),
    (lambda fit: fit.swap_time(1, 0), r"^block_size=0 must be > 0$"),
    (lambda fit: fit.swap_time(1, 2.0), r"^block_size=2.0 must be an integer$"),
    (lambda fit: fit.kv_capacity_tokens(), r"^a FittedCostModel knows no GPU memory: give the "
                                           r"simulator the measured engine's num_gpu_blocks$"),
])
def test_a_fitted_model_names_what_it_cannot_price(call, message):
    with pytest.raises(ValueError, match=message):
        call(FittedCostModel(0.01, {}, 1000, 1e6))
    assert FittedCostModel(0.01, {}, 1000, 1e6).swap_time(0, 16) == 0  # nothing to copy


def test_the_fit_needs_one_step_more_than_its_features_and_keeps_its_byte_prices():
    """A constant and one feature need two steps; the fitted model prices a swap by the
    bytes per token and the bandwidth it was given. A prefill with no cached tokens given
    starts from 0: 3 tokens attend to 1 + 2 + 3 keys."""
    one = [StepTiming(0, 0.01, StepShape((1,), (0,), ()))]
    with pytest.raises(ValueError, match=r"^1 steps cannot fit 2 constants$"):
        fit_cost_model(one, ("prefill_tokens",), kv_bytes_per_token=1, swap_bandwidth=1.0)
    two = one + [StepTiming(0, 0.03, StepShape((3,), (0,), ()))]
    fit = fit_cost_model(two, ("prefill_tokens",), kv_bytes_per_token=100, swap_bandwidth=1e4)
    assert (fit.constant, fit.coefficients["prefill_tokens"]) == pytest.approx((0.0, 0.01))
    assert fit.swap_time(2, 8) == pytest.approx(2 * 8 * 100 / 1e4)
    assert features([3], [])["attention_pairs"] == 1 + 2 + 3


def test_a_price_below_zero_for_the_first_feature_is_zero_too():
    """Non-negativity holds for every feature, the first after the constant included: steps
    whose time falls as decodes rise are fitted with a zero price for decodes."""
    shapes = [StepShape((p,), (0,), (8,) * d) for p in (2, 4, 6) for d in (1, 2, 3)]
    times = [0.05 + 0.001 * sum(s.prefill_lens) - 0.002 * len(s.decode_lens) for s in shapes]
    fit = fit_cost_model([StepTiming(0, t, s) for t, s in zip(times, shapes)],
                         ("decode_seqs", "prefill_tokens"), kv_bytes_per_token=1,
                         swap_bandwidth=1.0)
    assert fit.coefficients["decode_seqs"] == 0
    assert fit.coefficients["prefill_tokens"] == pytest.approx(0.001)


def test_relative_errors_are_the_models_time_over_the_measured_one_minus_one():
    half = FittedCostModel(0.25, {"prefill_tokens": 0.05}, 1, 1.0)  # 0.25 s + 0.05 s a token
    steps = [StepTiming(0, 0.25, StepShape((5,), (0,), ())),  # priced 0.5 s: twice the time
             StepTiming(0, 1.0, StepShape((5,), (0,), ()))]  # half the time
    assert relative_errors(half, steps) == pytest.approx([1.0, -0.5])



def test_relative_errors_price_a_chunk_after_its_cached_tokens():
    """A prompt chunk of 4 tokens after 6 cached ones reads those 6: at 0.01 s a key read and
    0.25 s a step the model prices it 0.31 s, twice the 0.155 s measured."""
    per_key = FittedCostModel(0.25, {"kv_tokens_read": 0.01}, 1, 1.0)
    steps = [StepTiming(0, 0.155, StepShape((4,), (6,), ()))]
    assert relative_errors(per_key, steps) == pytest.approx([1.0])

def test_profile_covers_prefills_decodes_and_mixed_steps():
    llm = LLM(from_hf(tiny_hf("llama-mha-d32")), block_size=4, num_gpu_blocks=64)
    steps = profile(llm, batch_sizes=(1, 4), prompt_lens=(3, 9), output_len=3)
    kinds = {(s.feature("prefill_tokens") > 0, s.feature("decode_seqs") > 0) for s in steps}
    assert kinds == {(True, False), (True, True), (False, True)}
    assert {s.feature("prefill_tokens") for s in steps} >= {3, 9, 2 * 3, 2 * 9}
    assert max(s.batch for s in steps) == 4
    assert all(s.duration > 0 for s in steps)
    assert not llm.has_unfinished_requests()


def test_profile_times_on_its_clock_runs_every_request_to_its_length_and_skips_the_warmup():
    llm = LLM(from_hf(tiny_hf("llama-mha-d32")), block_size=4, num_gpu_blocks=64)
    vocab = llm.model.args.vocab_size
    llm.model.args = dataclasses.replace(llm.model.args, eos_token_ids=tuple(range(vocab)))
    ticks = iter(range(10**6))
    steps = profile(llm, batch_sizes=(2,), prompt_lens=(5,), output_len=4,
                    clock=lambda: next(ticks))
    assert {s.duration for s in steps} == {1}  # one tick between each step's two readings
    assert 8 not in {s.feature("prefill_tokens") for s in steps}  # the warmup's 8 tokens
    sampled = sum(s.feature("decode_seqs") + s.feature("prefill_seqs") for s in steps)
    assert sampled == 2 * 4  # each request's 4 tokens, though every token is an end token
    with pytest.raises(ValueError, match=r"^output_len=0 must be > 0$"):
        profile(llm, output_len=0)
    with pytest.raises(ValueError, match=r"^output_len=2.5 must be an integer$"):
        profile(llm, output_len=2.5)



def test_profile_asks_for_seeded_prompts_decoded_greedily_as_a_replay_does(monkeypatch):
    """profile's requests as the engine sees them: an untimed 'profile-warmup' of 8 tokens,
    then 'profile-{batch}-{length}-{i}'. Their prompts are numpy's default_rng(seed) draws over
    the whole vocabulary, in that order (seed 0 unless given), so a profile can be rebuilt from
    its seed; each decodes greedily to output_len tokens (16 unless given) as replay's requests
    do, so the fit times the work a replay runs: its tokens are those greedy generation gives."""
    llm = LLM(from_hf(tiny_hf("llama-mha-d32")), block_size=4, num_gpu_blocks=64)
    asked, add = [], llm.add_request

    def spy(request_id, prompt, params, *args, **kwargs):
        group = add(request_id, prompt, params, *args, **kwargs)
        asked.append((request_id, prompt, group))
        return group

    monkeypatch.setattr(llm, "add_request", spy)
    profile(llm, batch_sizes=(1,), prompt_lens=(5,))
    profiled = list(asked)
    vocab, rng = llm.model.args.vocab_size, np.random.default_rng(0)
    assert [(rid, prompt) for rid, prompt, _ in profiled] == [
        ("profile-warmup", rng.integers(0, vocab, 8).tolist()),
        ("profile-1-5-0", rng.integers(0, vocab, 5).tolist())]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for _, prompt, group in profiled:
        (out,) = llm.generate([prompt], greedy, use_tqdm=False)
        assert group.seqs[0].output_token_ids == list(out.outputs[0].token_ids)

def test_a_cpu_clock_counts_work_and_skipped_sleep_but_not_waiting():
    """A CPUClock advances by this process's CPU time: spinning counts, a real sleep (time the
    machine gives to others) does not, and its own sleep jumps ahead at once."""
    import time

    from pagedlab.timing import CPUClock

    clock = CPUClock()
    start = clock()
    time.sleep(0.2)  # the wall clock moves; this process computes nothing
    waited = clock() - start
    spin_until = time.process_time() + 0.05
    while time.process_time() < spin_until:
        pass
    worked = clock() - start - waited
    clock.sleep(3.0)
    clock.sleep(-1.0)  # a late arrival: no time to skip
    assert waited < 0.05 <= worked
    assert clock() - start == pytest.approx(waited + worked + 3.0, abs=0.02)


def test_a_replay_on_a_cpu_clock_skips_idle_time():
    """Requests 30 s apart, served on a CPUClock: the gap is skipped, not slept, and each
    request's latency is what its steps cost."""
    from pagedlab.timing import CPUClock

    llm = LLM(from_hf(tiny_hf("llama-mha-d32")), block_size=4, num_gpu_blocks=16)
    clock = CPUClock()
    run = replay(llm, [Request(0, 0.0, 4, 3), Request(1, 30.0, 4, 3)], clock=clock,
                 sleep=clock.sleep)
    assert clock.skipped > 25  # the idle gap, less request 0's three steps
    assert run.steps[3].start >= 30.0  # request 1's prefill began at its arrival
    for r in run.requests:
        assert r.latency == pytest.approx(r.ttft + 2 * r.tpot)
        assert 0 < r.ttft <= r.latency < 30
