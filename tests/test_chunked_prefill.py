"""Chunked prefill end to end: greedy outputs token-identical to transformers for every chunk
size from one token to unchunked, with prefix caching on and off and under forced preemption
in both modes; the step's chunks as the executor reads them; no block leaked."""

import pytest
from _tiny import hf_greedy, random_prompts, tiny_hf

from pagedlab import LLM, SamplingParams
from pagedlab.engine import GroupOutput, Scheduler, SchedulerConfig, SequenceOutput
from pagedlab.memory import KVCacheManager
from pagedlab.model import from_hf

LENGTHS = (3, 17, 9, 30, 6, 12)
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
SYSTEM = [5, 9, 2, 7, 1, 4, 8, 3, 6, 11, 12, 13]  # a shared 12-token prefix (3 blocks of 4)
BUDGETS = [1, 2, 3, 5, 8, 16, 31]  # step budgets: chunk sizes from one token to whole prompts


@pytest.fixture(scope="module", params=["llama-gqa-d64", "qwen2-mqa-d32-tied"])
def case(request):
    hf = tiny_hf(request.param)
    prompts = random_prompts(LENGTHS, hf.config.vocab_size)
    prompts[2] = SYSTEM + prompts[2]  # two prompts share a prefix: prefix-cache hits
    prompts[4] = SYSTEM + prompts[4]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert len({tuple(r) for r in refs}) == len(refs)  # the reference can fail
    return dict(model=from_hf(hf), prompts=prompts, refs=refs)


def generate(case, **engine):
    llm = LLM(case["model"], block_size=4, **engine)
    outs = llm.generate(case["prompts"], GREEDY, use_tqdm=False)
    assert llm.manager.num_used_blocks == 0 and not llm.scheduler.has_unfinished
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("prefix", [False, True])
def test_every_chunk_size_matches_transformers(case, budget, prefix):
    llm, tokens = generate(case, num_gpu_blocks=64, max_num_batched_tokens=budget,
                           max_num_seqs=min(budget, 4), enable_prefix_caching=prefix)
    assert tokens == case["refs"]
    steps = llm.stats.steps
    assert all(s.batched_tokens <= budget for s in steps)
    longest = max(map(len, case["prompts"]))
    if budget < longest:  # some prompt was cut: a step computed part of it and sampled nothing
        assert any(s.prefill_tokens and s.prefill_tokens < longest for s in steps)
    if prefix:
        assert llm.stats.prefix_hits >= len(SYSTEM)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("budget", [3, 8])
def test_chunks_survive_preemption(case, mode, budget):
    llm, tokens = generate(case, num_gpu_blocks=10, max_num_batched_tokens=budget,
                           max_num_seqs=3, preemption_mode=mode, num_cpu_blocks=64)
    assert tokens == case["refs"]
    assert llm.stats.preemptions > 0
    if mode == "swap":  # groups past their prefill swap; one still prefilling recomputes
        assert any(m == "swap" for s in llm.stats.steps for _, m in s.preempted)


def test_unchunked_is_the_papers_rule(case):
    llm, tokens = generate(case, num_gpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
                           enable_chunked_prefill=False)
    assert tokens == case["refs"]
    # the 30-token prompt, bigger than the budget, ran alone and whole
    assert any(s.prefill_tokens == 30 and not s.decode_seqs for s in llm.stats.steps)


def test_the_default_budget_follows_vllm():
    assert SchedulerConfig().token_budget == 2048
    assert SchedulerConfig(max_model_len=4096).token_budget == 2048  # chunks cover the rest
    unchunked = SchedulerConfig(chunked_prefill=False, max_model_len=4096)
    assert unchunked.token_budget == 4096  # never below the context without chunking
    assert SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8).token_budget == 64
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 must be at least"):
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8)


def test_a_step_carries_what_the_executor_needs():
    """Each chunk's slots and table are the manager's, its tokens the sequence's, and a
    prompt's blocks are taken only as its chunks arrive."""
    manager = KVCacheManager(32, 4, enable_prefix_caching=True)
    sched = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=2))
    prompt = list(range(100, 114))  # 14 tokens: chunks of 6, 6, 2
    group = sched.add_request("a", prompt, SamplingParams(max_tokens=2))
    seen, used = [], []
    while sched.has_unfinished:
        step = sched.schedule()
        for c in step.chunks:
            assert c.token_ids == c.seq.token_ids[c.start : c.context_len]
            assert c.block_table == manager.block_table(c.seq.seq_id)
            assert c.slots == manager.slot_mapping(c.seq.seq_id, c.start, c.context_len)
            seen.append((c.start, c.num_tokens, c.is_sampled, c in step.decodes))
        sched.update([GroupOutput(g, [SequenceOutput(g.seqs[0], 7, 0.0)])
                      for g in step.sampled_groups])
        used.append(manager.num_used_blocks)
    assert seen == [(0, 6, False, False), (6, 6, False, False), (12, 2, True, False),
                    (14, 1, True, True)]
    assert used == [2, 3, 4, 0]  # ceil(6/4), ceil(12/4), ceil(14/4); freed at the end
    assert group.is_finished
    # the same prompt again: its full blocks are cached; only the rest is computed
    sched.add_request("b", prompt, SamplingParams(max_tokens=1))
    first = sched.schedule().prefills[0]
    assert (first.start, first.num_tokens) == (12, 2)
