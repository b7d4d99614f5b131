"""The engine-level API (vLLM's LLMEngine shape): requests added between steps, aborted mid-run,
outputs reported step by step, per-request timings; against generate's own results."""

import pytest
from _tiny import random_prompts, tiny_hf

from pagedlab import LLM, SamplingParams
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


def test_a_growing_cache_keeps_its_blocks_and_cached_prefixes(model):
    """On a CPU the cache grows to each call's needs; growing keeps every cached prefix."""
    shared = random_prompts([8], model.args.vocab_size, seed=5)[0]  # two full blocks of 4
    prompts = [shared + tail for tail in random_prompts([3, 4, 5, 6], model.args.vocab_size)]
    expected = [o.outputs[0].token_ids for o in LLM(model, block_size=4, num_gpu_blocks=64)
                .generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(model, block_size=4, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    small = llm.manager.num_gpu_blocks
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert llm.manager.num_gpu_blocks > small
    assert llm.stats.prefix_hits == 3 * 8  # each later prompt found the first one's blocks
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    llm.manager.check_invariants()
