"""The batched sampler against the math: each row's token distribution after temperature,
top-k and top-p, computed independently in plain Python; seeded rows ignore their batch."""

import math

import torch

import pytest

from pagedlab.engine.sampling import SamplingParams, adjusted_logits, sample_tokens

LOGITS = [2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0]
DRAWS = 40_000  # per setting: a frequency's standard error is at most 0.0025


def expected(logits, temperature, top_k, top_p):
    """Token -> probability: the top_k largest logits (all if <= 0), then the smallest prefix of
    them, by probability, whose mass reaches top_p, renormalized."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(logits)), key=lambda i: -scaled[i])
    keep = order[:top_k] if top_k > 0 else order
    weights = [math.exp(scaled[i]) for i in keep]
    probs = [w / sum(weights) for w in weights]
    kept, before = [], 0.0
    for token, prob in zip(keep, probs):
        if before > top_p:
            break
        kept.append((token, prob))
        before += prob
    mass = sum(prob for _, prob in kept)
    return {token: prob / mass for token, prob in kept}


SETTINGS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.9, 4, 0.7), (2.0, -1, 0.95)]


def test_each_row_draws_from_its_own_filtered_distribution(seed_offset):
    """All settings in one batch: rows with different parameters share one call."""
    rows = [s for s in SETTINGS for _ in range(DRAWS)]
    temperature, top_k, top_p = (torch.tensor(col) for col in zip(*rows))
    torch.manual_seed(seed_offset)
    tokens = sample_tokens(torch.tensor([LOGITS] * len(rows)), temperature.float(), top_k,
                           top_p.float(), [None] * len(rows))
    for i, setting in enumerate(SETTINGS):
        want = expected(LOGITS, *setting)
        got = torch.bincount(tokens[i * DRAWS:(i + 1) * DRAWS], minlength=len(LOGITS)) / DRAWS
        assert {t for t in range(len(LOGITS)) if got[t] > 0} == set(want), setting
        distance = sum(abs(float(got[t]) - want.get(t, 0.0)) for t in range(len(LOGITS))) / 2
        assert distance < 0.01, (setting, distance)


def test_a_seeded_row_draws_the_same_tokens_in_any_batch(seed_offset):
    """A seeded row's noise comes from its own generator only: its tokens do not depend on
    where it sits or on what the other rows are."""
    g = torch.Generator().manual_seed(1 + seed_offset)
    row, others = torch.randn(1, 50, generator=g), torch.randn(4, 50, generator=g)

    def tokens(logits, seeded):
        gens = [None] * len(logits)
        gens[seeded] = torch.Generator().manual_seed(7 + seed_offset)
        ones = torch.ones(len(logits))
        top_k = torch.full((len(logits),), 20)
        return [int(sample_tokens(logits, ones, top_k, ones * 0.9, gens)[seeded])
                for _ in range(20)]  # one generator's stream over 20 draws

    first = tokens(torch.cat([row, others[:2]]), seeded=0)
    assert tokens(torch.cat([others, row]), seeded=4) == first
    assert len(set(first)) > 1  # the draws vary: the test can tell streams apart


def penalized(logits, prompt, output, presence, frequency, repetition, bias):
    """vLLM's definitions token by token in plain Python: the bias added; every token of the
    prompt or the output divided (a positive logit) or multiplied (otherwise) by the repetition
    penalty; the output's count times the frequency penalty and its presence times the presence
    penalty subtracted."""
    out = []
    for token, x in enumerate(logits):
        x += bias.get(token, 0.0)
        if token in prompt or token in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(token)
        out.append(x - frequency * count - presence * (count > 0))
    return out


@pytest.mark.parametrize("presence, frequency, repetition, bias", [
    (0.5, 0.0, 1.0, {}), (0.0, 0.7, 1.0, {}), (0.0, 0.0, 1.8, {}), (0.0, 0.0, 0.6, {}),
    (-1.0, 0.3, 1.3, {2: 5.0, 6: -100.0}),
])
def test_logit_bias_and_penalties_follow_vllm_s_definitions(presence, frequency, repetition, bias):
    prompt, output = [0, 3, 3], [1, 4, 4, 4, 5]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition, logit_bias=bias)
    got = adjusted_logits(torch.tensor(LOGITS), params, prompt, output)
    want = penalized(LOGITS, prompt, output, presence, frequency, repetition, bias)
    assert got.tolist() == pytest.approx(want, abs=1e-5)


def test_a_request_whose_sampling_raises_fails_alone(monkeypatch):
    """The batch's other requests are sampled as if the failing one were not there: greedy
    ones get their tokens, the failing one its error."""
    from _tiny import random_prompts, tiny_hf

    from pagedlab import LLM
    from pagedlab.engine import sampling
    from pagedlab.model import from_hf

    model = from_hf(tiny_hf("llama-gqa-d64"))
    prompts = random_prompts([5, 7, 6], model.args.vocab_size, seed=3)
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=1.5)
    alone = LLM(model, block_size=4, num_gpu_blocks=64).generate(
        [prompts[0], prompts[2]], good, use_tqdm=False)
    real = sampling.adjusted_logits

    def broken(logits, params, prompt, output):
        if params.presence_penalty == 1.5 and len(output) == 2:
            raise RuntimeError("overflow in this request's sampling")
        return real(logits, params, prompt, output)

    monkeypatch.setattr(sampling, "adjusted_logits", broken)
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    outs = llm.generate(prompts, [good, bad, good], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [
        o.outputs[0].token_ids for o in alone]
    assert outs[1].outputs[0].finish_reason == "error"
    assert "overflow" in str(outs[1].error) and len(outs[1].outputs[0].token_ids) == 2
    assert llm.manager.num_used_blocks == 0


def test_the_engine_penalizes_each_sequence_by_its_own_history():
    """Greedy with a bias that makes a token win until presence and frequency penalties (which
    shift no logit's sign) take it back: each token is the argmax of the raw log-probabilities
    the engine reports, adjusted by the tokens generated before it."""
    from _tiny import random_prompts, tiny_hf

    from pagedlab import LLM
    from pagedlab.model import from_hf

    model = from_hf(tiny_hf("llama-gqa-d64"))
    vocab = model.args.vocab_size
    prompt = random_prompts([6], vocab, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=vocab,
                            presence_penalty=4.0, frequency_penalty=3.0, logit_bias={7: 12.0})
    llm = LLM(model, block_size=4, num_gpu_blocks=64)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    (plain,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True), use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert tokens != plain.outputs[0].token_ids and 1 < tokens.count(7) < 12
    for i, (token, raw) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        scores = penalized([raw[t] for t in range(vocab)], prompt, tokens[:i], 4.0, 3.0, 1.0,
                           {7: 12.0})
        assert token == max(range(vocab), key=scores.__getitem__)
