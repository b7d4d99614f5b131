"""The engine-level API (vLLM's LLMEngine shape): requests added between steps, aborted mid-run,
outputs reported step by step, per-request timings; against generate's own results."""

import pytest
from _tiny import random_prompts, tiny_hf

from pagedlab import LLM, SamplingParams
from pagedlab.engine import PromptTooLong
from pagedlab.engine.runner import block_bytes
from pagedlab.model import from_hf

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def model():
    return from_hf(tiny_hf("qwen2-gqa-d64"))


def test_requests_added_between_steps_get_generate_s_tokens(model):
    prompts = random_prompts([5, 9, 3, 12], model.args.vocab_size)
    expected = [o.outputs[0].token_ids for o in LLM(model, block_size=4, num_gpu_blocks=64)
                .generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    finished, progress = {}, {}
    for i, prompt in enumerate(prompts):  # one new request every other step
        llm.add_request(f"r{i}", prompt, GREEDY)
        for _ in range(2):
            for out in llm.step():
                progress.setdefault(out.request_id, []).append(len(out.outputs[0].token_ids))
                if out.finished:
                    finished[out.request_id] = out
    while llm.has_unfinished_requests():
        for out in llm.step():
            progress.setdefault(out.request_id, []).append(len(out.outputs[0].token_ids))
            if out.finished:
                finished[out.request_id] = out
    assert [finished[f"r{i}"].outputs[0].token_ids for i in range(4)] == expected
    for counts in progress.values():  # one more token at every step that served the request
        assert counts == list(range(1, len(counts) + 1))
    for out in finished.values():
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_to_first_token > 0
        assert m.time_per_output_token(len(out.outputs[0].token_ids)) > 0
    llm.manager.check_invariants()
    assert llm.manager.num_used_blocks == 0


@pytest.mark.parametrize("caching", [False, True])
def test_abort_mid_run_frees_everything_and_spares_the_rest(model, caching):
    prompts = random_prompts([7, 7, 7], model.args.vocab_size, seed=4)
    llm = LLM(model, block_size=4, num_gpu_blocks=64, enable_prefix_caching=caching)
    alone = llm.generate(prompts[1:2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}", prompt, SamplingParams(n=2, temperature=1.0, seed=i,
                                                        max_tokens=10) if i != 1 else GREEDY)
    llm.step(), llm.step()
    llm.abort_request("r0")
    llm.abort_request("r2")
    with pytest.raises(KeyError, match="'r0' is not running"):
        llm.abort_request("r0")
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in outs] == ["r1"] and outs[0].outputs[0].token_ids == alone
    llm.manager.check_invariants()
    assert llm.manager.num_used_blocks == 0 and llm.manager.cpu.num_used == 0


def test_request_ids_must_be_unique_while_running(model):
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    prompt = random_prompts([4], model.args.vocab_size)[0]
    llm.add_request("x", prompt, GREEDY)
    with pytest.raises(ValueError, match="'x' is already running"):
        llm.add_request("x", prompt, GREEDY)
    while llm.has_unfinished_requests():
        llm.step()
    llm.add_request("x", prompt, GREEDY)  # finished: the id is free again
    llm.abort_request("x")
    assert llm.manager.num_used_blocks == 0


def test_the_engine_api_batches_every_request_it_was_given(model):
    """The cache is sized once, at construction: 32 requests added one by one all decode
    together in every decode step (a cache grown to one request's needs ran them 1-3 at a
    time)."""
    llm = LLM(model, block_size=4)
    prompts = random_prompts([5 + i % 7 for i in range(32)], model.args.vocab_size, seed=3)
    for i, prompt in enumerate(prompts):
        llm.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True))
    decode_steps = 0
    while llm.has_unfinished_requests():
        unfinished = len(llm.scheduler.unfinished)
        llm.step()
        step = llm.last_step
        if step.decodes:
            decode_steps += 1
            assert len(step.decodes) + len(step.prefills) == unfinished
    assert decode_steps == 5  # 6 tokens: the first from the prefill, 5 decode steps
    assert llm.manager.num_used_blocks == 0


def test_the_cache_budget_comes_from_the_argument_or_the_environment(model, monkeypatch):
    per_block = block_bytes(model, 4)
    assert LLM(model, block_size=4, kv_cache_memory_bytes=10 * per_block + 1
               ).manager.num_gpu_blocks == 10
    monkeypatch.setenv("PAGEDLAB_CPU_KVCACHE_SPACE", "0.001")
    assert LLM(model, block_size=4).manager.num_gpu_blocks == int(0.001 * 2**30) // per_block
    monkeypatch.setenv("PAGEDLAB_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="PAGEDLAB_CPU_KVCACHE_SPACE='lots' must be a positive"):
        LLM(model, block_size=4)
    monkeypatch.delenv("PAGEDLAB_CPU_KVCACHE_SPACE")
    with pytest.raises(ValueError, match="no room for one KV block of"):
        LLM(model, block_size=4, kv_cache_memory_bytes=per_block - 1)
    full = LLM(model, block_size=4, max_num_seqs=3)  # 3 sequences of 512 tokens at most
    assert full.manager.num_gpu_blocks == 3 * 512 // 4


def test_a_fresh_cache_may_hold_anything(model):
    """The cache is torch.empty: what it held before a block is written must never reach an
    output, NaN included (the padding of a batch reads slots no sequence owns)."""
    prompts = random_prompts([3, 9, 14], model.args.vocab_size, seed=4)
    clean = LLM(model, block_size=4, num_gpu_blocks=32)
    for caches in clean.runner.kv_caches:
        for cache in caches:
            cache.zero_()
    dirty = LLM(model, block_size=4, num_gpu_blocks=32)
    for caches in dirty.runner.kv_caches:
        for cache in caches:
            cache.fill_(float("nan"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in clean.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in dirty.generate(prompts, params, use_tqdm=False)
            ] == expected


def test_a_prompt_must_leave_room_for_one_token_within_max_model_len(model):
    """A prompt of max_model_len tokens could generate nothing: it fails alone; one token
    shorter generates exactly one token."""
    llm = LLM(model, block_size=4, num_gpu_blocks=64, max_model_len=12)
    full, room = random_prompts([12, 11], model.args.vocab_size, seed=6)
    with pytest.raises(PromptTooLong, match=r"prompt of 12 tokens .* max_model_len=12"):
        llm.add_request("full", full, GREEDY)
    (out,) = llm.generate([room], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
