"""The serving benchmark's arithmetic (vLLM's definitions) on timestamps worked out by hand,
and the arrival process it draws; no server involved."""

import math

import numpy as np
import pytest

from pagedlab.serving_metrics import (RequestRecord, arrival_offsets, distribution_ms,
                                      parse_goodput, summarize)


def records():
    """Three requests that completed and one that failed; times in seconds."""
    return [
        # TTFT 0.5, E2E 1.6 (to the last chunk with a choice: the usage chunk at 11.7 carries
        # no token), gaps 0.2 0.3 0.6, TPOT (1.6 - 0.5) / 3
        RequestRecord(8, 4, sent=10.0, chunk_times=[10.5, 10.7, 11.0, 11.6], done=11.7,
                      output_tokens=4),
        # TTFT 0.2, E2E 0.3, gap 0.1, TPOT 0.1
        RequestRecord(4, 2, sent=11.0, chunk_times=[11.2, 11.3], done=11.3, output_tokens=2),
        # one token: TTFT = E2E = 1.0, no gap, no TPOT
        RequestRecord(2, 1, sent=12.0, chunk_times=[13.0], done=13.0, output_tokens=1),
        RequestRecord(100, 9, sent=12.5, error="APIConnectionError: refused"),
    ]


def test_per_request_latencies():
    a, b, c, failed = records()
    assert (a.ttft, a.e2el, a.tpot) == pytest.approx((0.5, 1.6, 1.1 / 3))
    assert a.itl == pytest.approx([0.2, 0.3, 0.6])
    assert (b.ttft, b.e2el, b.tpot) == pytest.approx((0.2, 0.3, 0.1))
    assert c.tpot is None and c.itl == [] and c.ttft == pytest.approx(1.0)
    assert not failed.ok and a.ok


def test_summary_matches_hand_computed_throughput_and_percentiles():
    s = summarize(records(), duration=4.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (14, 7)  # failed: not counted
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(1.75)
    assert s["total_token_throughput"] == pytest.approx(21 / 4)
    assert s["request_goodput"] is None
    # TTFT 200, 500, 1000 ms: p90 lies 0.8 of the way from 500 to 1000, p99 0.98 of it
    assert s["ttft_ms"] == pytest.approx(
        {"mean": 1700 / 3, "median": 500, "p90": 900, "p99": 990})
    # TPOT over the two requests of 2+ tokens: 100, 366.7 ms
    t = 1100 / 3
    assert s["tpot_ms"] == pytest.approx({"mean": (100 + t) / 2, "median": (100 + t) / 2,
                                          "p90": 100 + 0.9 * (t - 100),
                                          "p99": 100 + 0.99 * (t - 100)})
    # ITL pooled over requests: 100, 200, 300, 600 ms; p90 at rank 2.7, p99 at rank 2.97
    assert s["itl_ms"] == pytest.approx({"mean": 300, "median": 250, "p90": 510, "p99": 591})
    # E2E 300, 1000, 1600 ms
    assert s["e2el_ms"] == pytest.approx(
        {"mean": 2900 / 3, "median": 1000, "p90": 1480, "p99": 1588})


@pytest.mark.parametrize("slo, good", [
    (["ttft:600", "tpot:300"], 1),   # a: TPOT 367 too slow; c: TTFT 1000 too slow
    (["ttft:1000"], 3),              # the bound is inclusive
    (["tpot:50"], 1),                # only c, whose one token counts as TPOT 0
    (["e2el:1000", "ttft:999"], 1),  # only b
])
def test_goodput_counts_requests_that_meet_every_slo(slo, good):
    s = summarize(records(), duration=4.0, slo=parse_goodput(slo))
    assert s["request_goodput"] == pytest.approx(good / 4.0)


@pytest.mark.parametrize("item", ["ttft", "latency:100", "ttft:-5", "tpot:abc", "e2el:inf"])
def test_bad_goodput_is_refused_by_name(item):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([item])


def test_empty_distributions_and_bad_duration():
    assert all(math.isnan(v) for v in distribution_ms([]).values())
    with pytest.raises(ValueError, match="duration"):
        summarize(records(), duration=0.0)


def test_arrivals_have_the_rate_and_the_burstiness_asked_for(seed_offset):
    assert arrival_offsets(5, math.inf).tolist() == [0.0] * 5
    n = 40_000
    for shape in (0.25, 1.0, 4.0):  # gamma gaps: mean 1/rate, variation coefficient 1/√shape
        offsets = arrival_offsets(n, 2.0, shape, np.random.default_rng(1 + seed_offset))
        gaps = np.diff(offsets)
        assert offsets[0] == 0.0 and (gaps >= 0).all() and len(offsets) == n
        assert gaps.mean() == pytest.approx(0.5, rel=0.03)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(shape), rel=0.05)
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, burstiness=0)


def test_a_simulated_run_prints_in_the_benchmarks_terms():
    """The simulator's prediction as a client would have measured it: TTFT from arrival to the
    first token, TPOT over the tokens after it, a chunk per step (several tokens per chunk
    under speculation, the TPOT still per token)."""
    from pagedlab.engine import SchedulerConfig
    from pagedlab.serving_metrics import simulated_records, summarize
    from pagedlab.sim import CostModel, PagedConfig, Request, simulate_paged

    requests = [Request(i, 0.05 * i, 100 + 10 * i, 20 + i) for i in range(6)]
    cost = CostModel("Llama-3-8B", "A100-80GB")
    plain = simulate_paged(requests, cost, PagedConfig(record_token_times=True))
    records = simulated_records(requests, plain)
    assert [len(r.chunk_times) for r in records] == [r.output_len for r in requests]
    assert [r.ttft for r in records] == pytest.approx(plain.first_token - plain.arrival)
    assert [r.tpot for r in records] == pytest.approx(
        (plain.finish - plain.first_token) / (plain.output_len - 1))
    table = summarize(records, float(plain.finish.max() - plain.arrival.min()))
    assert table["completed"] == 6 and table["total_output_tokens"] == sum(
        r.output_len for r in requests)
    spec = SchedulerConfig(speculative_config={"num_speculative_tokens": 3})
    fast = simulate_paged(requests, cost, PagedConfig(scheduler=spec, acceptance_rate=1.0,
                                                      record_token_times=True))
    chunks = [len(r.chunk_times) for r in simulated_records(requests, fast)]
    assert all(c < r.output_len for c, r in zip(chunks, requests))  # 4 tokens a chunk
    with pytest.raises(ValueError, match="record_token_times"):
        simulated_records(requests, simulate_paged(requests, cost))


def test_the_simulators_table_of_a_workload_is_the_one_worked_out_by_hand():
    """Two requests far apart, each served alone, priced at 0.1 s a step plus 1 ms per
    prefilled token: the first token comes one prefill step after arrival, then one decode
    step per token, so every number of the table follows by hand."""
    from pagedlab.serving_metrics import predict
    from pagedlab.sim import PagedConfig
    from pagedlab.sim.calibration import FittedCostModel

    cost = FittedCostModel(0.1, {"prefill_tokens": 0.001}, kv_bytes_per_token=1,
                           swap_bandwidth=1.0)
    lengths, offsets = [(100, 5), (200, 3)], [0.0, 10.0]
    records, duration = predict(lengths, offsets, cost, PagedConfig(num_gpu_blocks=64, swap_space_gib=0))
    assert [r.output_tokens for r in records] == [5, 3]
    assert [r.ttft for r in records] == pytest.approx([0.2, 0.3])  # 0.1 + P ms
    assert [r.tpot for r in records] == pytest.approx([0.1, 0.1])
    assert [r.e2el for r in records] == pytest.approx([0.2 + 4 * 0.1, 0.3 + 2 * 0.1])
    assert duration == pytest.approx(10.5)
    s = summarize(records, duration)
    assert s["total_output_tokens"] == 8 and s["total_input_tokens"] == 300
    assert s["itl_ms"]["median"] == pytest.approx(100.0) and s["itl_ms"]["p99"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="2 requests but 1 arrival offsets"):
        predict(lengths, [0.0], cost, PagedConfig(num_gpu_blocks=64, swap_space_gib=0))


def test_a_prefill_in_the_step_shows_as_a_long_inter_token_gap():
    """The ITL tail the chapter explains: a request decoding alone sees a 0.1 s step, until a
    200-token prompt arrives and its prefill shares a step (0.1 + 0.2 s); a token budget of
    50 splits that prefill into four steps of 0.15 s, and the longest gap shrinks to match."""
    from pagedlab.engine import SchedulerConfig
    from pagedlab.serving_metrics import predict
    from pagedlab.sim import PagedConfig
    from pagedlab.sim.calibration import FittedCostModel

    cost = FittedCostModel(0.1, {"prefill_tokens": 0.001}, kv_bytes_per_token=1,
                           swap_bandwidth=1.0)
    lengths, offsets = [(10, 20), (200, 2)], [0.0, 0.5]
    whole, _ = predict(lengths, offsets, cost, PagedConfig(num_gpu_blocks=64, swap_space_gib=0))
    assert max(whole[0].itl) == pytest.approx(0.3)
    small = PagedConfig(num_gpu_blocks=64, swap_space_gib=0, scheduler=SchedulerConfig(
        max_num_batched_tokens=50, max_num_seqs=2))
    chunked, _ = predict(lengths, offsets, cost, small)
    assert max(chunked[0].itl) == pytest.approx(0.1 + 0.049)  # 49 prompt tokens beside 1 decode
