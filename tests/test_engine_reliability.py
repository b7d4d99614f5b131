"""What goes wrong stays small: a step that fails leaves the engine as a fresh one (nothing cached
that was never written, no block leaked); a request that can never run fails alone; groups that
forked survive recompute preemption; bad input gets an error that names it."""

import dataclasses

import numpy as np
import pytest
import torch
from _tiny import random_prompts, tiny_hf

from pagedlab import LLM, BeamSearchParams, SamplingParams
from pagedlab.engine import CacheTooSmall, InvalidPrompt, ModelRunner, Sampler, Scheduler
from pagedlab.memory import KVCacheManager
from pagedlab.model import PagedLlama, from_hf

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def model():
    return from_hf(tiny_hf("llama-gqa-d64"))


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


# --- a step is a transaction ----------------------------------------------------------------

# Where a step can fail: the method, and on which of its calls (the first step prefills).
STAGES = {
    "schedule": (KVCacheManager, "allocate", 2),  # half-way through admitting the batch
    "copies": (ModelRunner, "_move_blocks", 1),
    "forward": (PagedLlama, "forward", 1),
    "sample": (Sampler, "__call__", 1),
    "update": (Scheduler, "update", 1),
}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_step_leaves_the_engine_as_new(model, monkeypatch, stage, caching, error):
    shared = random_prompts([12], model.args.vocab_size, seed=3)[0]  # three full blocks of 4
    prompts = [shared + tail for tail in random_prompts([3, 5, 2], model.args.vocab_size)]

    def engine():
        return LLM(model, block_size=4, num_gpu_blocks=40, enable_prefix_caching=caching)

    fresh = token_ids(engine().generate(prompts, GREEDY, use_tqdm=False))
    llm = engine()
    cls, name, nth = STAGES[stage]
    original, calls = getattr(cls, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            raise error(f"injected into {stage}")
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, failing)
    with pytest.raises(error, match=f"injected into {stage}"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.setattr(cls, name, original)
    llm.manager.check_invariants()
    assert llm.manager.num_used_blocks == 0 and not llm.has_unfinished_requests()
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == fresh
    if caching:  # the second call hit what the first one cached, or what it computed itself
        assert llm.stats.prefix_hits > 0


def test_blocks_cached_by_a_failed_step_are_forgotten():
    """The manager's side: a rollback forgets exactly what was cached since the last commit."""
    manager = KVCacheManager(8, 2, enable_prefix_caching=True)
    manager.allocate("a", [1, 2, 3, 4, 5])
    manager.commit()  # "a"'s keys and values were written
    manager.allocate("b", [1, 2, 3, 4, 9, 9, 7])  # hits a's two blocks, caches (9, 9)
    manager.free("a")
    manager.free("b")
    manager.rollback()
    manager.check_invariants()
    assert manager.num_cached_blocks == 2 and manager.num_free_blocks == 8
    assert manager.allocate("c", [1, 2, 3, 4, 9, 9, 7]) == 4  # (9, 9) is no longer a hit


# --- one request fails alone ----------------------------------------------------------------


def test_a_request_that_can_never_fit_fails_alone(model):
    llm = LLM(model, block_size=4, num_gpu_blocks=4)
    short, long = random_prompts([3, 17], model.args.vocab_size)
    alone = token_ids(LLM(model, block_size=4, num_gpu_blocks=64).generate(
        [short], GREEDY, use_tqdm=False))[0]
    outs = llm.generate([short, long, short], GREEDY, use_tqdm=False)
    assert isinstance(outs[1].error, CacheTooSmall) and outs[1].outputs == []
    assert "request '1'" in str(outs[1].error) and "17 tokens" in str(outs[1].error)
    assert token_ids(outs[::2]) == [alone, alone]
    # one that only outgrows the cache while it decodes fails then, keeping what it made
    grow = SamplingParams(temperature=0, max_tokens=20)
    outs = llm.generate([short[:2], short], [grow, GREEDY], use_tqdm=False)
    assert isinstance(outs[0].error, CacheTooSmall) and "needs 5 blocks" in str(outs[0].error)
    assert outs[0].outputs[0].finish_reason == "error" and len(outs[0].outputs[0].token_ids) > 8
    assert token_ids(outs[1:]) == [alone]
    assert llm.manager.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forked_groups_survive_preemption(model, mode):
    """Parallel samples preempted by recomputation re-prefill their shared prompt once and fork
    again, so a cache that holds the group, but not one prompt per sample, still serves it;
    swapping keeps the group shared on the CPU. Both give the roomy engine's samples."""
    prompts = random_prompts([20, 18], model.args.vocab_size)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=14)
    roomy = token_ids(LLM(model, block_size=4, num_gpu_blocks=80).generate(
        prompts, params, use_tqdm=False))
    tight = LLM(model, block_size=4, num_gpu_blocks=20, preemption_mode=mode, num_cpu_blocks=64)
    # at the end the group fits if its prompt is shared, not with a prompt per sample
    assert 20 // 4 + 3 * -(-14 // 4) <= 20 < 3 * -(-(20 + 14) // 4)
    assert token_ids(tight.generate(prompts, params, use_tqdm=False)) == roomy
    stats = tight.stats
    assert (stats.recomputations if mode == "recompute" else stats.swap_outs) > 0
    if mode == "recompute":  # a re-prefill computed the prompt once, not three times
        resumed = [s for s in stats.steps[1:] if s.prefill_seqs == 3]
        assert resumed and all(s.prefill_tokens < 3 * 18 for s in resumed)


# --- bad input gets a named error -----------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size=0"),
    (dict(block_size=-16), "block_size=-16"),
    (dict(gpu_memory_utilization=5.0), "gpu_memory_utilization=5.0"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0"),
    (dict(swap_space=float("nan")), "swap_space=nan"),
    (dict(swap_space=float("inf")), "swap_space=inf"),
    (dict(num_gpu_blocks=2.5), "num_gpu_blocks=2.5"),
    (dict(max_model_len=0), "max_model_len=0"),
    (dict(preemption_mode="drop"), "preemption_mode='drop'"),
    (dict(kv_cache_dtype="fp8", kv_scale=0.0), "kv_scale=0.0"),
    (dict(kv_cache_dtype="fp8", kv_scale=-0.0), "kv_scale=-0.0"),
    (dict(kv_cache_dtype="fp8", kv_scale=float("nan")), "kv_scale=nan"),
    (dict(kv_cache_dtype="fp8", kv_scale=float("inf")), "kv_scale=inf"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching='yes'"),
])
def test_engine_settings_are_checked(model, kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        LLM(model, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seed=2**70), "seed="),
    (dict(seed=True), "seed=True"),
    (dict(logprobs=-1), "logprobs=-1"),
    (dict(stop=[""]), "stop="),
    (dict(stop_token_ids=[1.5]), "stop_token_ids="),
    (dict(max_tokens=0), "max_tokens=0"),
])
def test_sampling_params_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_beam_params_are_checked():
    with pytest.raises(ValueError, match="length_penalty=nan"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))


def test_prompts_are_integers_or_fail_alone(model):
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    ids = random_prompts([6], model.args.vocab_size)[0]
    outs = llm.generate(
        [ids, np.array(ids), torch.tensor(ids), [1.7, 2.2], ["a", 2], [True, 3],
         torch.tensor([1.0, 2.0]), {"prompt_token_ids": ids, "extra": 1}, "text", [10**6]],
        GREEDY, use_tqdm=False,
    )
    assert all(o.error is None for o in outs[:3]) and token_ids(outs[1:3]) == token_ids(outs[:1]) * 2
    for i, out in enumerate(outs[3:], start=3):
        assert isinstance(out.error, InvalidPrompt), i
        assert f"request '{i}'" in str(out.error)
    assert "vocabulary" in str(outs[-1].error) and "tokenizer" in str(outs[-2].error)
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams"):
        llm.generate([ids, ids], [GREEDY, BeamSearchParams(2, 4)], use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate(42, GREEDY, use_tqdm=False)
    assert llm.manager.num_used_blocks == 0


def test_config_errors_leave_nothing_half_done(model):
    """A call refused as a whole (mismatched lists) queues nothing."""
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    ids = random_prompts([4], model.args.vocab_size)[0]
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate([ids], GREEDY, priority=[0, 1], use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert len(llm.generate([ids], dataclasses.replace(GREEDY, max_tokens=3),
                            use_tqdm=False)[0].outputs[0].token_ids) == 3
