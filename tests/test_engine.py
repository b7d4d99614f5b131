"""The engine end to end, against transformers: greedy and beam search token for token, under
preemption (recompute and swap) and prefix caching; seeded and parallel sampling; the
scheduler driven without a model; errors that name the request and leak nothing."""

import collections
import dataclasses

import pytest
from _tiny import hf_generate, hf_greedy, kernel_runs, random_prompts, tiny_hf

from pagedlab import LLM, BeamSearchParams, SamplingParams
from pagedlab.device import HAS_CUDA, has_triton
from pagedlab.engine import CacheTooSmall, InvalidPrompt, Scheduler, SchedulerConfig
from pagedlab.engine.step import Placeholders, drive
from pagedlab.memory import InvariantError, KVCacheManager
from pagedlab.model import from_hf

LENGTHS = (3, 17, 9, 30, 6, 12)  # prompts of different lengths, some past a block of 16
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module", params=["llama-gqa-d64", "qwen2-mqa-d32-tied"])
def case(request):
    """A transformers model, ours, prompts, a stop token, and transformers' greedy outputs."""
    hf = tiny_hf(request.param)
    prompts = random_prompts(LENGTHS, hf.config.vocab_size)
    plain = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    stop = plain[1][6]  # a token some completions produce: they will stop there
    refs = [hf_greedy(hf, p, MAX_TOKENS, eos=stop) for p in prompts]
    return dict(hf=hf, model=from_hf(hf), prompts=prompts, plain=plain, stop=stop, refs=refs)


@pytest.fixture(scope="module")
def qwen():
    hf = tiny_hf("qwen2-mqa-d32-tied")
    return hf, from_hf(hf)


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def test_greedy_outputs_vary(case):
    """The reference must be able to fail: completions differ, and are not one token repeated."""
    plain = case["plain"]
    assert len({tuple(t) for t in plain}) == len(plain)
    assert all(len(set(t)) >= 4 for t in plain)


def test_greedy_matches_transformers(case):
    llm = LLM(case["model"], block_size=16, num_gpu_blocks=32, max_num_seqs=3)
    params = dataclasses.replace(GREEDY, stop_token_ids=(case["stop"],))
    outs = llm.generate(case["prompts"], params, use_tqdm=False)
    assert token_ids(outs) == case["refs"]
    reasons = {o.outputs[0].finish_reason for o in outs}
    assert reasons == {"stop", "length"}
    assert [o.request_id for o in outs] == [str(i) for i in range(len(LENGTHS))]
    assert all(o.finished and o.prompt_token_ids == p for o, p in zip(outs, case["prompts"]))
    # max_num_seqs=3: later prompts join while earlier ones decode, in the same forward pass
    stats = llm.stats
    assert any(s.prefill_seqs and s.decode_seqs for s in stats.steps)
    assert stats.generated_tokens == sum(map(len, case["refs"]))
    assert stats.prompt_tokens == sum(LENGTHS) and stats.tokens_per_second > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(case, mode):
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=12, preemption_mode=mode,
              num_cpu_blocks=64)
    outs = llm.generate(case["prompts"], GREEDY, use_tqdm=False)
    assert token_ids(outs) == case["plain"]
    stats = llm.stats
    assert stats.preemptions > 0
    if mode == "swap":
        assert stats.swap_outs == stats.swap_ins > 0 and stats.blocks_swapped > 0
    else:
        assert stats.recomputations == stats.preemptions
    assert stats.peak_blocks_used == 12


@pytest.mark.parametrize("num_gpu_blocks", [64, 10])  # 10: with recompute preemption too
def test_prefix_caching_keeps_outputs(qwen, num_gpu_blocks):
    hf, model = qwen
    shared = random_prompts([13], hf.config.vocab_size, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts([2, 5, 1, 7], hf.config.vocab_size)]
    refs = [hf_greedy(hf, p, 10) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=10)
    for caching in (False, True):
        llm = LLM(model, block_size=4, num_gpu_blocks=num_gpu_blocks,
                  enable_prefix_caching=caching, max_num_seqs=2)
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == refs
        assert (llm.stats.prefix_hits > 0) == caching
        assert (llm.stats.preemptions > 0) == (num_gpu_blocks == 10)


def test_seeded_sampling_is_reproducible(qwen):
    _, model = qwen
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    prompt, *others = random_prompts([9, 4, 13], model.args.vocab_size)

    def sample(seed, batch=(), **kw):
        params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=seed, max_tokens=12)
        params = dataclasses.replace(params, **kw)
        return llm.generate([prompt, *batch], params, use_tqdm=False)[0].outputs[0].token_ids

    first = sample(3)
    assert sample(3) == first and sample(3, batch=others) == first
    assert sample(4) != first
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert sample(3, top_k=1) == greedy  # one token left to sample from
    assert sample(3, top_p=1e-6) == greedy


def test_parallel_sampling_forks_with_copy_on_write(qwen):
    _, model = qwen
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    prompt = random_prompts([9], model.args.vocab_size)[0]  # a partly filled third block
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    samples = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2] and len({tuple(s) for s in samples}) == 3
    assert llm.stats.blocks_copied == 2  # the shared partial block, for two of the three
    unshared = 3 * -(-(9 + 12) // 4)
    assert llm.stats.peak_blocks_used < unshared
    for i, sample in enumerate(samples):  # sample i is the request run alone with seed 5 + i
        alone = dataclasses.replace(params, n=1, seed=5 + i)
        assert llm.generate([prompt], alone, use_tqdm=False)[0].outputs[0].token_ids == sample


BEAM_CASES = [  # (beam_width, length_penalty, early_stopping)
    (2, 1.0, False),
    (3, 0.0, False),
    (3, 1.0, True),
    (4, 1.5, "never"),
    (3, -1.0, False),
]


def test_beam_search_matches_transformers(qwen):
    hf, model = qwen
    prompts, max_tokens = random_prompts([5, 9], hf.config.vocab_size), 10
    reasons, steps = collections.Counter(), []
    for k, penalty, early in BEAM_CASES:
        for prompt in prompts:
            # An EOS the beams actually meet: the commonest token of the beams without one.
            beams = dict(max_new_tokens=max_tokens, num_beams=k, num_return_sequences=k)
            plain = hf_generate(hf, prompt, **beams)[:, len(prompt) + 1:]
            eos = collections.Counter(plain.flatten().tolist()).most_common()[0][0]
            ref = hf_generate(hf, prompt, **beams, length_penalty=penalty, early_stopping=early,
                              eos_token_id=eos, output_scores=True, return_dict_in_generate=True)
            model.args = dataclasses.replace(model.args, eos_token_ids=(eos,))
            llm = LLM(model, block_size=4, num_gpu_blocks=64)
            params = BeamSearchParams(k, max_tokens, length_penalty=penalty, early_stopping=early)
            (out,) = llm.beam_search([prompt], params)
            assert len(out.sequences) == k
            for seq, row, score in zip(out.sequences, ref.sequences.tolist(), ref.sequences_scores):
                n = len(seq.tokens)
                assert seq.tokens == row[:n] and set(row[n:]) <= {eos}
                assert seq.score == pytest.approx(float(score), rel=1e-5, abs=1e-5)
                reasons[seq.finish_reason] += 1
            steps.append(llm.stats.num_steps)
    model.args = dataclasses.replace(model.args, eos_token_ids=())
    assert reasons["stop"] and reasons["length"]  # beams ended at EOS, and at max_tokens
    assert min(steps) < max_tokens  # some searches stopped early


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_groups_survive_preemption(qwen, mode):
    """Beams and parallel samples are preempted group by group (recomputation re-prefills each
    sequence of the group) and come back to the same result."""
    _, model = qwen
    prompts = random_prompts([9, 6, 11], model.args.vocab_size)
    beams = BeamSearchParams(beam_width=3, max_tokens=10)
    samples = SamplingParams(n=3, seed=1, max_tokens=10)
    roomy = LLM(model, block_size=4, num_gpu_blocks=64)
    tight = LLM(model, block_size=4, num_gpu_blocks=20, preemption_mode=mode, num_cpu_blocks=64)
    for ours, ref in zip(tight.beam_search(prompts, beams), roomy.beam_search(prompts, beams)):
        assert [s.tokens for s in ours.sequences] == [s.tokens for s in ref.sequences]
        assert [s.score for s in ours.sequences] == pytest.approx(
            [s.score for s in ref.sequences], abs=1e-5)
    assert tight.stats.preemptions > 0
    ours, ref = (llm.generate(prompts, samples, use_tqdm=False) for llm in (tight, roomy))
    assert [[c.token_ids for c in o.outputs] for o in ours] == [
        [c.token_ids for c in o.outputs] for o in ref]
    assert tight.stats.preemptions > 0


def test_inputs_in_vllm_forms(qwen):
    _, model = qwen
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    a, b = random_prompts([5, 8], model.args.vocab_size)
    one = token_ids(llm.generate(a, GREEDY, use_tqdm=True))  # a single prompt
    two = token_ids(llm.generate([{"prompt_token_ids": a}, b],
                                 [GREEDY, dataclasses.replace(GREEDY, max_tokens=3)],
                                 use_tqdm=False))
    assert two[0] == one[0] and len(two[1]) == 3
    (text,) = llm.generate("hello", use_tqdm=False)  # no tokenizer: this request fails alone
    assert isinstance(text.error, InvalidPrompt) and "tokenizer" in str(text.error)


def step_stats(scheduler: Scheduler) -> list:
    """Each step's stats, the scheduler run to the end without a model (token 1, always)."""
    return [step.stats for step in drive(scheduler, Placeholders(1))]


def test_llm_loads_a_checkpoint_and_sizes_its_cache(qwen, tmp_path):
    hf, model = qwen
    hf.save_pretrained(tmp_path)
    per_block = 2 * 2 * 1 * 32 * 4 * 16  # K and V, 2 layers, 1 KV head, dim 32, fp32, 16 tokens
    if HAS_CUDA:  # the free memory decides, which other processes change
        llm = LLM(str(tmp_path), gpu_memory_utilization=0.9)
        assert llm.model.device.type == "cuda" and llm.manager.num_gpu_blocks > 0
        with pytest.raises(ValueError, match="gpu_memory_utilization=1e-09: .* no room"):
            LLM(str(tmp_path), gpu_memory_utilization=1e-9)
    else:  # a CPU's cache: 1 GiB of KV space, capped by what 256 seqs of 512 tokens can fill
        llm = LLM(str(tmp_path))
        assert llm.manager.num_gpu_blocks == min(2**30 // per_block, 256 * 512 // 16) == 8192
        assert LLM(str(tmp_path), max_model_len=64).manager.num_gpu_blocks == 256 * 4
    prompt = random_prompts([7], model.args.vocab_size)[0]
    assert token_ids(llm.generate([prompt], GREEDY, use_tqdm=False)) == [hf_greedy(hf, prompt, 16)]


def test_scheduler_runs_without_a_model():
    """The simulator's view: the same scheduler, fed made-up tokens instead of a model's."""
    for mode in ("recompute", "swap"):
        manager = KVCacheManager(6, 4, num_cpu_blocks=16)
        scheduler = Scheduler(manager, SchedulerConfig(preemption_mode=mode))
        for i in range(3):
            scheduler.add_request(f"r{i}", list(range(8)), SamplingParams(max_tokens=6))
        history = step_stats(scheduler)
        assert history[0].prefill_seqs == 3  # 6 blocks hold the three prompts
        assert history[1].preempted == (("r2", mode),)  # decoding needs blocks: last in, out
        for s in history:  # nothing new is admitted in a step that preempted, or while swapped
            assert not (s.prefill_seqs and (s.preempted or s.swapped))
        manager.check_invariants()
        assert manager.num_used_blocks == 0 and manager.cpu.num_used == 0


@pytest.mark.parametrize("chunked", [True, False])
def test_token_budget_and_seats_bound_every_step(chunked):
    manager = KVCacheManager(64, 4)
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, chunked_prefill=chunked)
    scheduler = Scheduler(manager, config)
    for i, length in enumerate([10, 10, 40, 3, 5, 4]):  # 40: more than the whole budget
        scheduler.add_request(f"r{i}", list(range(length)), SamplingParams(max_tokens=4))
    history = step_stats(scheduler)
    for s in history:
        assert s.prefill_seqs + s.decode_seqs <= 3
        if chunked:  # the 40-token prompt is cut to fit: every step keeps the budget
            assert s.batched_tokens <= 16
        else:  # a prompt bigger than the budget runs alone
            assert s.batched_tokens <= 16 or (s.prefill_seqs, s.decode_seqs) == (1, 0)
    assert any(s.prefill_tokens == 40 for s in history) is not chunked
    # every prompt token once, and every output but the last of each request (never fed back)
    assert sum(s.batched_tokens for s in history) == 10 + 10 + 40 + 3 + 5 + 4 + 6 * 3
    assert manager.num_used_blocks == 0


def test_errors_name_the_request_and_leak_nothing(qwen):
    """Requests that can never run fail alone (tests/test_engine_reliability.py has more);
    settings that cannot work fail at construction; a leak is caught after the call."""
    _, model = qwen
    llm = LLM(model, block_size=4, num_gpu_blocks=4)
    short, long = random_prompts([3, 17], model.args.vocab_size)
    outs = llm.generate([short, long], GREEDY, use_tqdm=False)
    assert isinstance(outs[1].error, CacheTooSmall) and "request '1'" in str(outs[1].error)
    (bad,) = llm.generate([short + [999]], GREEDY, use_tqdm=False)
    assert isinstance(bad.error, InvalidPrompt)
    assert "request '2': prompt token ids [999]" in str(bad.error)
    (wide,) = LLM(model, num_gpu_blocks=4, max_num_seqs=2).generate(
        [short], SamplingParams(n=3), use_tqdm=False)
    assert "max_num_seqs=2" in str(wide.error)
    assert llm.manager.num_used_blocks == 0 and not llm.scheduler.has_unfinished
    assert len(token_ids(llm.generate([short], dataclasses.replace(GREEDY, max_tokens=8),
                                      use_tqdm=False))[0]) == 8
    llm.manager.allocate("stray", short)  # a block the engine does not know about
    with pytest.raises(InvariantError, match="leaked"):
        llm.generate([short], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="swap_space"):
        LLM(model, num_gpu_blocks=4, preemption_mode="swap")
    with pytest.raises(ValueError, match="max_num_batched_tokens=8"):
        LLM(model, num_gpu_blocks=4, max_num_seqs=16, max_num_batched_tokens=8)


@pytest.mark.skipif(not has_triton(), reason="launches the Triton kernels (none here: macOS, "
                    "Windows, or PAGEDLAB_BLOCK_TRITON=1)")
def test_triton_kernels_serve_the_model():
    """Through the interpreter on a CPU, compiled on a GPU: reshape_and_cache, paged_attention,
    copy_blocks (two samples per prompt) and swap_blocks (a preemption), from pagedlab.kernels."""
    runs = kernel_runs()
    assert runs["triton"] == runs["reference"]
