"""A request's sequences and timings, alone (pagedlab/engine/sequence.py): what forking copies,
and the per-request latencies vLLM reports, from their definitions."""

import pytest

from pagedlab.engine.sequence import RequestMetrics, Sequence


def test_a_fork_has_its_parents_tokens_score_and_logprobs_but_its_own_lists():
    parent = Sequence(0, [1, 2])
    parent.append(5, -0.5, {5: -0.5, 6: -1.5})
    child = parent.fork(9, index=1)
    assert (child.seq_id, child.index, child.token_ids) == (9, 1, [1, 2, 5])
    assert child.cumulative_logprob == -0.5 and child.logprobs == [{5: -0.5, 6: -1.5}]
    child.append(7, -1.0, {7: -1.0})
    assert parent.token_ids == [1, 2, 5] and parent.logprobs == [{5: -0.5, 6: -1.5}]
    assert Sequence(0, [1]).fork(1, 1).logprobs is None  # none asked for, none made


@pytest.mark.parametrize("tokens", [2, 3, 10])
def test_time_per_output_token_spreads_the_time_after_the_first_over_the_rest(tokens):
    m = RequestMetrics(arrival_time=100.0, first_token_time=100.25, finished_time=102.25)
    assert m.time_to_first_token == 0.25
    assert m.time_per_output_token(tokens) == pytest.approx(2.0 / (tokens - 1))


def test_latencies_are_unknown_until_their_events_happen():
    m = RequestMetrics(arrival_time=100.0)
    assert m.time_to_first_token is None and m.time_per_output_token(5) is None
    m.first_token_time = 101.0
    assert m.time_per_output_token(5) is None  # not finished
    m.finished_time = 103.0
    assert m.time_per_output_token(1) is None  # one token has no gap after it
    assert m.time_per_output_token(5) == 0.5
    m.first_token_time = None  # finished without a token (aborted in its prefill)
    assert m.time_per_output_token(5) is None
