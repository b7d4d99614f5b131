"""The step-driven KV memory simulation: each request served once, every slot accounted for."""

import numpy as np
import pytest

from pagedlab.footprint import kv_capacity
from pagedlab.memory.contiguous import CATEGORIES, orca
from pagedlab.sim import SYSTEMS, PagedKV, Request, make_memory, simulate, synthetic_requests


class Spy:
    """Wraps a memory system; checks the simulation's calls and records each request's history."""

    def __init__(self, memory):
        self.memory, self.name, self.capacity = memory, memory.name, memory.capacity
        self.stored: dict[int, int] = {}  # admitted request id -> tokens stored
        self.requests: dict[int, Request] = {}
        self.completed: list[int] = []  # ids freed at their final length
        self.preempted: list[int] = []  # ids freed before it

    def can_admit(self, request, num_tokens):
        return self.memory.can_admit(request, num_tokens)

    def admit(self, request, num_tokens):
        assert request.id not in self.stored and request.id not in self.completed
        self.memory.admit(request, num_tokens)
        self.stored[request.id], self.requests[request.id] = num_tokens, request

    def can_append(self, request_id):
        return self.memory.can_append(request_id)

    def append(self, request_id):
        self.memory.append(request_id)
        self.stored[request_id] += 1

    def free(self, request_id):
        self.memory.free(request_id)
        done = self.stored.pop(request_id) == self.requests[request_id].total_len
        (self.completed if done else self.preempted).append(request_id)

    def breakdown(self, waiting=None):
        return self.memory.breakdown(waiting)


def check_run(requests, memory, step_seconds=0.05):
    spy = Spy(memory)
    result = simulate(requests, spy, step_seconds=step_seconds)
    assert sorted(spy.completed) == sorted(r.id for r in requests)  # each served exactly once
    assert not spy.stored  # nothing left holding memory
    assert result.finished == len(requests)
    assert result.preemptions == len(spy.preempted)
    slots = np.stack([result.slots[c] for c in CATEGORIES])  # [categories, steps]
    assert (slots >= 0).all()
    assert (slots.sum(axis=0) == memory.capacity).all()  # the pool is fully accounted for
    return result, spy


@pytest.mark.parametrize("name", SYSTEMS)
@pytest.mark.parametrize("dataset, rate", [("sharegpt", 5.0), ("alpaca", 50.0)])
def test_every_request_finishes_once_and_categories_sum_to_capacity(name, dataset, rate):
    requests = synthetic_requests(dataset, 120, rate=rate, seed=1, max_context=512)
    result, _ = check_run(requests, make_memory(name, capacity=4096, max_seq_len=512))
    used = result.capacity - result.slots["free"] - result.slots["external"]
    assert used.max() <= result.capacity and result.running.min() >= 1


def test_a_small_oracle_run_by_hand():
    # Oracle regions: A reserves 3 + 2 = 5 (an 8 block), B 4 + 3 = 7 (an 8 block).
    requests = [Request(0, 0.0, 3, 2), Request(1, 0.0, 4, 3)]
    result, _ = check_run(requests, orca(32, "oracle", max_seq_len=16))
    assert result.slots["tokens"].tolist() == [4 + 5, 5 + 6, 7]
    assert result.slots["reservation"].tolist() == [1 + 2, 0 + 1, 0]
    assert result.slots["rounding"].tolist() == [3 + 1, 3 + 1, 1]
    assert result.slots["free"].tolist() == [16, 16, 24]
    assert result.time.tolist() == [0.0, 0.05, 0.1]
    assert result.running.tolist() == [2, 2, 1] and result.mean_batch == pytest.approx(5 / 3)


def test_max_reservation_admits_one_at_a_time_and_the_queue_is_external_fragmentation():
    # Pool of 24 = 16 + 8; each request reserves 16: the 8 root is too small for the next one.
    requests = [Request(i, 0.0, 2, 2) for i in range(3)]
    result, _ = check_run(requests, orca(24, "max", max_seq_len=16))
    assert result.running.tolist() == [1] * 6
    assert result.waiting.tolist() == [2, 2, 1, 1, 0, 0]
    assert result.slots["external"].tolist() == [8, 8, 8, 8, 0, 0]
    assert result.slots["free"].tolist() == [0, 0, 0, 0, 8, 8]
    shares = result.mean_shares()  # the four steps with a request waiting
    assert shares["external"] == pytest.approx(8 / 24)
    assert sum(shares[c] for c in CATEGORIES) == pytest.approx(1)
    assert shares["internal"] == pytest.approx(shares["overreservation"] + shares["rounding"])


def test_paging_preempts_the_latest_request_and_resumes_it():
    # 4 blocks of 4 slots; A and B each grow to 12 tokens (3 blocks): both cannot fit.
    requests = [Request(0, 0.0, 4, 8), Request(1, 0.0, 4, 8)]
    result, spy = check_run(requests, PagedKV(16, block_size=4))
    assert spy.preempted == [1] and result.preemptions == 1
    assert spy.completed == [0, 1]
    assert result.slots["reservation"].sum() == result.slots["external"].sum() == 0
    assert (result.slots["rounding"] < 4 * result.running).all()  # < a block per sequence


def test_idle_gaps_are_skipped():
    requests = [Request(0, 0.0, 5, 3), Request(1, 100.0, 5, 2)]
    result, _ = check_run(requests, make_memory("paged", 64, 16))
    assert result.time.tolist() == [0.0, 0.05, 0.1, 100.0, 100.05]
    with pytest.raises(ValueError, match="no step had a waiting request"):
        result.mean_shares()
    assert result.mean_shares(saturated=False)["tokens"] == pytest.approx(
        np.mean(result.slots["tokens"]) / 64)


def test_a_request_that_can_never_fit_is_named():
    with pytest.raises(RuntimeError, match="request 1 .*does not fit in Paging"):
        simulate([Request(0, 0.0, 4, 4), Request(1, 0.0, 40, 40)], PagedKV(64, 16),
                 step_seconds=1.0)
    with pytest.raises(ValueError, match="request 1: prompt_len \\+ output_len = 80"):
        simulate([Request(1, 0.0, 40, 40)], orca(64, "oracle", 64), step_seconds=1.0)
    with pytest.raises(ValueError, match="request id 3 appears more than once"):
        simulate([Request(3, 0.0, 1, 1)] * 2, PagedKV(64, 16), step_seconds=1.0)
    with pytest.raises(ValueError, match="capacity=100 must be a multiple of block_size=16"):
        PagedKV(100, 16)
    with pytest.raises(ValueError, match="memory system name='lru'"):
        make_memory("lru", 64, 16)


def test_a_sharegpt_like_load_reproduces_the_shape_of_fig_2():
    """Orca keeps 15-45% of KV memory in token states, paging above 90% (paper: 20.4% to
    38.2%, and 96.3%), on OPT-13B's A100-40GB pool."""
    requests = synthetic_requests("sharegpt", 300, rate=10.0, seed=0)
    capacity = kv_capacity("OPT-13B", "A100-40GB").token_slots // 16 * 16  # whole blocks
    tokens = {}
    for name in ("orca-max", "orca-pow2", "orca-oracle", "paged"):
        result = simulate(requests, make_memory(name, capacity, 2048), step_seconds=0.04)
        tokens[name] = result.mean_shares()["tokens"]
    assert all(0.15 < tokens[n] < 0.45 for n in ("orca-max", "orca-pow2", "orca-oracle"))
    assert tokens["orca-max"] < tokens["orca-pow2"] < tokens["orca-oracle"] < tokens["paged"]
    assert tokens["paged"] > 0.9
