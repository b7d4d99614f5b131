"""Speculative decoding: proposals, verification, and the paged cache's rollback.

Greedy output with speculation must be token-identical to transformers' (and so to the engine
without it) whatever was proposed and however much of it was accepted: n-gram lookup, and an
oracle that proposes the right continuation with random corruptions, so that every accept
length from 0 to k occurs. Sampled output must follow the target distribution: the rejection
rule on synthetic distributions, and the engine's tokens on a tiny model against the exact
distribution computed from transformers' logits, both by a chi-square test at fixed seeds.
"""

import math
import random
from collections import Counter

import pytest
import torch
from _tiny import hf_greedy, random_prompts, tiny_hf

from pagedlab import LLM, SamplingParams
from pagedlab.engine.params import BeamSearchParams
from pagedlab.engine.sampling import verify_greedy, verify_sampled
from pagedlab.engine.speculative import NgramProposer, Proposer, SpecDecodingStats, SpeculativeConfig
from pagedlab.engine.step import run_step
from pagedlab.model import from_hf

CHI2_999 = {7: 24.32, 24: 51.18}  # chi-square critical values at 0.999, by degrees of freedom


# --- proposers -------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 9, 8, 1, 2, 3], 2, [9, 8]),  # the 3-gram [1, 2, 3] recurs: what followed it
    ([1, 2, 3, 9, 8, 1, 2, 3], 9, [9, 8, 1, 2, 3, 9, 8, 1, 2]),  # on into its own guesses
    ([5, 1, 1, 1], 3, [1, 1, 1]),  # a run continues
    ([5, 1, 2, 7, 4, 1, 2, 6, 3, 1, 2], 1, [6]),  # the latest of two occurrences
    ([4, 2, 7, 5, 2], 3, [7, 5, 2]),  # only a 1-gram recurs
    ([1, 2, 3, 4], 3, []),  # nothing recurs
    ([7], 3, []),
])
def test_ngram_proposes_what_followed_the_latest_match(tokens, k, expected):
    assert NgramProposer(1, 3).propose(tokens, k) == expected


def test_ngram_prefers_the_longest_match():
    tokens = [1, 2, 9, 0, 2, 8, 5, 1, 2]  # [1, 2] recurs (then 9); [2] recurs later (then 8)
    assert NgramProposer(1, 2).propose(tokens, 1) == [9]
    assert NgramProposer(1, 1).propose(tokens, 1) == [8]
    assert NgramProposer(3, 3).propose(tokens, 1) == []  # no 3-gram recurs


def test_ngram_defaults_look_from_4_grams_down_to_1_grams():
    """vLLM's prompt_lookup_min/max defaults as the proposer's (1 and 4); and the match that
    ends right before the last token counts (a 1-gram in a context of two tokens)."""
    five_then_four = [1, 2, 3, 4, 5, 10, 9, 2, 3, 4, 5, 20, 1, 2, 3, 4, 5]
    assert NgramProposer().propose(five_then_four, 1) == [20]  # the 4-gram, not the 5-gram
    assert NgramProposer(1, 5).propose(five_then_four, 1) == [10]
    assert NgramProposer().propose([6, 8, 6], 2) == [8, 6]  # a 1-gram is enough
    assert NgramProposer().propose([3, 3], 3) == [3, 3, 3]


@pytest.mark.parametrize("fields, error, message", [
    (dict(num_speculative_tokens=2.5), ValueError, r"num_speculative_tokens=2.5 must be an int"),
    (dict(prompt_lookup_max=3.0), ValueError, r"prompt_lookup_max=3.0 must be an int"),
    (dict(prompt_lookup_min=3, prompt_lookup_max=2), ValueError,
     r"^prompt_lookup_min=3 must be at most prompt_lookup_max=2$"),
    (dict(method="draft_model"), ValueError, r"^speculative method 'draft_model' needs draft_lay"),
    (dict(method="draft_model", draft_layers=1.5), ValueError, r"draft_layers=1.5 must be an int"),
])
def test_a_bad_speculative_config_is_named(fields, error, message):
    with pytest.raises(error, match=message):
        SpeculativeConfig(**fields)


def test_a_draft_model_config_without_draft_layers_says_what_they_are():
    """The refusal explains the field it asks for (pagedlab's own, which vLLM's users do not
    know): the whole message, not only its start."""
    with pytest.raises(ValueError, match=r"^speculative method 'draft_model' needs draft_layers, "
                                         r"the number of the target's layers the draft keeps$"):
        SpeculativeConfig(method="draft_model")


def test_speculative_config_edges_are_allowed_and_a_wrong_type_is_named():
    assert SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=3).prompt_lookup_min == 3
    with pytest.raises(TypeError, match=r"^speculative_config=5 must be a dict or Speculat"):
        SpeculativeConfig.of(5)


def test_speculative_config_takes_vllms_dict_and_names_bad_fields():
    config = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_max": 5})
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (3, 5)
    with pytest.raises(ValueError, match="eagle"):
        SpeculativeConfig.of({"method": "eagle"})
    with pytest.raises(ValueError, match="draft_model_path"):
        SpeculativeConfig.of({"method": "ngram", "draft_model_path": "x"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.of({"num_speculative_tokens": 0})


# --- verification ----------------------------------------------------------------------------

def test_greedy_verification_keeps_the_matching_prefix_and_the_targets_token():
    target = torch.tensor([4, 7, 1])
    assert verify_greedy(target, [4, 7]) == [4, 7, 1]  # all accepted, plus the bonus
    assert verify_greedy(target, [4, 5]) == [4, 7]  # the first mismatch is replaced
    assert verify_greedy(target, [3, 7]) == [4]  # nothing accepted: a plain decode's token


def _emitted(p, q, k, trials, seed, rule=verify_sampled):
    """First two tokens emitted by speculative steps over position-indexed target rows ``p``
    [positions, vocab], proposals drawn from ``q`` (None: a fixed guess, token 0)."""
    g = torch.Generator().manual_seed(seed)
    pairs = Counter()
    for _ in range(trials):
        out = []
        while len(out) < 2:
            pos = len(out)
            if q is None:
                draft, draft_probs = [0] * k, None
            else:
                draft_probs = q[pos:pos + k]
                draft = [int(torch.multinomial(row, 1, generator=g)) for row in draft_probs]
            out += rule(p[pos:pos + k + 1], draft, draft_probs, g)
        pairs[tuple(out[:2])] += 1
    return pairs


def _chi_square(counts, p0, p1):
    """Pearson's statistic of observed first-two-token pairs against p0 x p1."""
    n, vocab = sum(counts.values()), len(p0)
    return sum((counts[(a, b)] - n * p0[a] * p1[b]) ** 2 / (n * p0[a] * p1[b])
               for a in range(vocab) for b in range(vocab))


@pytest.mark.parametrize("proposal", ["fixed guess", "draft distribution"])
def test_rejection_sampling_emits_the_target_distribution(proposal):
    """Leviathan et al.'s rule: every emitted token follows the target, whatever q was."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(8, 5, generator=g) ** 3
    p /= p.sum(-1, keepdim=True)  # [positions, vocab], peaked so that rejections are common
    q = None
    if proposal == "draft distribution":
        q = torch.rand(8, 5, generator=g) ** 3
        q /= q.sum(-1, keepdim=True)
    counts = _emitted(p, q, k=3, trials=4000, seed=1)
    assert _chi_square(counts, p[0].tolist(), p[1].tolist()) < CHI2_999[24]

    def from_p_after_rejection(probs, draft, draft_probs, g):  # a plausible wrong rule
        tokens = verify_sampled(probs, draft, draft_probs, g)
        i = len(tokens) - 1
        if i < len(draft):  # rejected at i: draw from p, not from the residual
            tokens[i] = int(torch.multinomial(probs[i], 1, generator=g))
        return tokens

    wrong = _emitted(p, q, k=3, trials=4000, seed=1, rule=from_p_after_rejection)
    assert _chi_square(wrong, p[0].tolist(), p[1].tolist()) > CHI2_999[24]  # the test can fail


def test_spec_stats_count_acceptances_by_position():
    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_position == [1, 1, 0]
    assert stats.acceptance_rate == 2 / 5 and stats.mean_acceptance_length == 2.0


# --- the engine --------------------------------------------------------------------------------

LENGTHS = (9, 14, 5, 21)
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


class Oracle(Proposer):
    """Proposes the reference continuation, each guess corrupted with probability ``noise``:
    every accept length occurs. Knows the references by prompt."""

    def __init__(self, refs: dict, noise: float, seed: int = 0):
        self.refs, self.noise, self.rng = refs, noise, random.Random(seed)

    def propose(self, token_ids, k, seq_id=None):
        for prompt, ref in self.refs.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                guess = list(ref[done:done + k])
                return [t if self.rng.random() > self.noise else (t + 1) % 64 for t in guess]
        raise AssertionError("unknown prompt")


@pytest.fixture(scope="module")
def case():
    hf = tiny_hf("llama-gqa-d64")
    prompts = random_prompts(LENGTHS, hf.config.vocab_size)
    prompts = [p + p[: len(p) // 2] + p for p in prompts]  # repeats: n-gram lookup finds some
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return dict(hf=hf, model=from_hf(hf), prompts=prompts, refs=refs)


def serve(case, proposer=None, check=None, **engine):
    """Greedy outputs, the manager's invariants checked after every step (``check(step)`` sees
    each step once its forward pass ran), and the run's speculation counts."""
    llm = LLM(case["model"], block_size=4, **engine)
    if proposer is not None:
        llm.drafter.proposer = proposer
    for i, prompt in enumerate(case["prompts"]):
        llm.add_request(str(i), prompt, GREEDY)
    outputs, preempted = {}, 0
    while llm.scheduler.has_unfinished:
        step, ran, done = run_step(llm.scheduler, llm.runner, drafter=llm.drafter,
                                               observe=lambda s, _: check and check(llm, s))
        llm.manager.check_invariants()
        assert not step.failed
        preempted += len(step.preempted)
        for group in llm.scheduler.running:  # the cache holds all but each pending token:
            for seq in group.live:  # rejected proposals are gone (a partial prompt holds less)
                held = llm.manager.num_tokens(seq.seq_id)
                assert held == len(seq) - 1 if seq.output_token_ids else held < len(seq)
        for group in done:
            outputs[group.request_id] = group.seqs[0].output_token_ids
    assert llm.manager.num_used_blocks == 0
    tokens = [outputs[str(i)] for i in range(len(case["prompts"]))]
    return tokens, llm.scheduler.spec_stats, preempted


def no_proposal_cached(llm, step):
    """Before the step's outputs are applied: no block holding a proposal is in the index."""
    cache = llm.manager.prefix_cache
    for chunk in step.decodes:
        if chunk.draft and cache is not None:
            first_unverified = (chunk.start + 1) // llm.manager.block_size
            assert all(cache.tokens_of(b) is None for b in chunk.block_table[first_unverified:])


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("budget", [6, 64])
def test_greedy_ngram_speculation_matches_transformers(case, prefix, budget):
    tokens, stats, _ = serve(case, num_gpu_blocks=64, enable_prefix_caching=prefix,
                          max_num_batched_tokens=budget, max_num_seqs=4,
                          speculative_config=NGRAM, check=no_proposal_cached)
    assert tokens == case["refs"]
    assert stats.num_draft_tokens > 0


@pytest.mark.parametrize("noise", [0.0, 0.3, 0.7])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_accept_length_rolls_back_right_under_preemption(case, noise, mode):
    """Tight cache: preemptions between verification steps, shared prefixes cached."""
    refs = {tuple(p): r for p, r in zip(case["prompts"], case["refs"])}
    config = dict(NGRAM, num_speculative_tokens=4)
    tokens, stats, preempted = serve(case, Oracle(refs, noise), num_gpu_blocks=20,
                                     num_cpu_blocks=32,
                          preemption_mode=mode, enable_prefix_caching=True,
                          max_num_seqs=4, speculative_config=config, check=no_proposal_cached)
    assert tokens == case["refs"] and preempted > 0
    if noise == 0.0:
        assert stats.acceptance_rate == 1.0
    else:  # rejections at several positions, acceptances of several lengths
        assert 0 < stats.acceptance_rate < 1 and stats.accepted_per_position[1] > 0


def test_parallel_samples_copy_their_shared_block_before_speculating(case):
    """Two greedy samples per request share the prompt's last block after the fork; each
    copies it before its pending token and proposals are written (copy-on-write), and both
    still equal transformers' completion."""
    refs = {tuple(p): r for p, r in zip(case["prompts"], case["refs"])}
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=64, enable_prefix_caching=True,
              speculative_config=NGRAM, record_events=True)
    llm.drafter.proposer = Oracle(refs, 0.3)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(case["prompts"], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in case["refs"]]
    assert any(e.kind == "cow" for e in llm.manager.events)
    assert any(e.kind == "truncate" for e in llm.manager.events)
    llm.manager.check_invariants()
    assert llm.manager.num_used_blocks == 0


def test_a_stop_token_among_accepted_proposals_ends_the_output_there(case):
    """Tokens accepted after the request's stop token are dropped with their slots."""
    refs = {tuple(p): r for p, r in zip(case["prompts"], case["refs"])}
    stop = case["refs"][0][5]
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=64, speculative_config=NGRAM)
    llm.drafter.proposer = Oracle(refs, 0.0)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop])
    out = llm.generate([case["prompts"][0]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == case["refs"][0][: case["refs"][0].index(stop) + 1]
    assert out.finish_reason == "stop" and llm.manager.num_used_blocks == 0


def test_proposals_respect_max_tokens_and_max_model_len(case):
    refs = {tuple(p): r for p, r in zip(case["prompts"], case["refs"])}
    prompt = case["prompts"][1]
    for limit in dict(max_tokens=7), dict(max_model_len=len(prompt) + 4):
        llm = LLM(case["model"], block_size=4, num_gpu_blocks=64, speculative_config=NGRAM,
                  **({} if "max_tokens" in limit else limit))
        llm.drafter.proposer = Oracle(refs, 0.0)
        params = SamplingParams(temperature=0, max_tokens=limit.get("max_tokens", MAX_TOKENS))
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        n = limit.get("max_tokens", 4)
        assert out.token_ids == case["refs"][1][:n] and out.finish_reason == "length"
        decodes = sum(s.decode_seqs for s in llm.stats.steps)  # each yields 1 + its accepted
        assert llm.scheduler.spec_stats.num_draft_tokens == n - 1 - decodes  # none past the end
        k = NGRAM["num_speculative_tokens"]  # and none short of it: a perfect proposer's
        assert decodes == math.ceil((n - 1) / (k + 1))  # request takes the fewest steps it can


def test_a_step_with_proposals_stays_within_its_token_budget(case):
    """Proposals take what the decodes leave of the budget, and the prompts' chunks what the
    proposals leave: no step computes more than ``max_num_batched_tokens`` tokens. Each step
    counts its proposals, every request's counts add up to the run's, and the outputs stay
    transformers'."""
    refs = {tuple(p): r for p, r in zip(case["prompts"], case["refs"])}
    budget = 9
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=64, max_num_batched_tokens=budget,
              max_num_seqs=4, speculative_config=dict(NGRAM, num_speculative_tokens=4))
    llm.drafter.proposer = Oracle(refs, 0.3)
    for i, prompt in enumerate(case["prompts"]):
        llm.add_request(str(i), prompt, GREEDY)
    done, capped = [], 0
    while llm.scheduler.has_unfinished:
        step, _, finished = run_step(llm.scheduler, llm.runner, drafter=llm.drafter)
        tokens = sum(c.num_tokens for c in step.chunks)
        assert tokens <= budget
        assert step.num_draft_tokens == sum(len(c.draft) for c in step.decodes)
        assert all(c.num_tokens == 1 + len(c.draft) for c in step.decodes)
        capped += tokens == budget and 0 < step.num_draft_tokens < 4 * len(step.decodes)
        done += finished
    assert capped > 0  # the budget, not the proposer, cut some steps' proposals
    by_id = {g.request_id: g.seqs[0].output_token_ids for g in done}
    assert [by_id[str(i)] for i in range(len(case["prompts"]))] == case["refs"]
    spec = llm.scheduler.spec_stats
    assert sum(g.metrics.num_draft_tokens for g in done) == spec.num_draft_tokens > 0
    assert sum(g.metrics.num_accepted_tokens for g in done) == spec.num_accepted_tokens > 0


def test_a_beam_search_request_leaves_the_others_their_proposals(case):
    """Beams are not speculated; a request after them in the batch still is."""
    refs = {tuple(p): r for p, r in zip(case["prompts"], case["refs"])}
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=64, speculative_config=NGRAM)
    llm.drafter.proposer = Oracle(refs, 0.0)
    llm.add_request("beams", case["prompts"][0], BeamSearchParams(beam_width=2, max_tokens=8))
    llm.add_request("greedy", case["prompts"][1], GREEDY)
    done, after_beams = {}, 0
    while llm.scheduler.has_unfinished:
        step, _, finished = run_step(llm.scheduler, llm.runner, drafter=llm.drafter)
        ids = [g.request_id for g in step.groups] if step.decodes else []
        after_beams += ids == ["beams", "greedy"] and bool(step.decodes[-1].draft)
        done.update((g.request_id, g) for g in finished)
    assert after_beams > 0
    assert done["greedy"].seqs[0].output_token_ids == case["refs"][1]
    assert llm.manager.num_used_blocks == 0


def test_sampled_speculation_follows_the_models_distribution(case):
    """Three tokens at temperature 1 with top-k 2 (8 outcomes); the second is verified against
    a fixed guess, so it is accepted or resampled. The frequencies over 1,200 seeded requests
    against the exact probabilities from transformers' logits."""
    hf, prompt = case["hf"], case["prompts"][2][:6]

    def top2(context):  # transformers: the two likeliest next tokens and their probabilities
        with torch.no_grad():
            logits = hf(torch.tensor([context])).logits[0, -1]
        values, ids = logits.topk(2)
        return ids.tolist(), values.softmax(-1).tolist()

    exact = {}
    ids1, p1 = top2(prompt)
    for a, pa in zip(ids1, p1):
        ids2, p2 = top2(prompt + [a])
        for b, pb in zip(ids2, p2):
            ids3, p3 = top2(prompt + [a, b])
            for c, pc in zip(ids3, p3):
                exact[(a, b, c)] = pa * pb * pc
    guess = top2(prompt + [ids1[0]])[0][1]  # the less likely second token after the likelier first

    class Fixed(Proposer):
        def propose(self, token_ids, k, seq_id=None):
            return [guess][:k]

    n = 1200
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=1024, max_num_seqs=512,
              max_num_batched_tokens=4096, speculative_config=dict(NGRAM, num_speculative_tokens=1))
    llm.drafter.proposer = Fixed()
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=3, seed=s) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    assert set(counts) <= set(exact)
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in exact.items())
    assert chi2 < CHI2_999[7], (counts, exact)
    stats = llm.scheduler.spec_stats
    assert stats.num_drafts > n / 2 and 0 < stats.acceptance_rate < 1
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)


# --- the simulator -----------------------------------------------------------------------------

@pytest.mark.slow
def test_the_simulator_prices_verification_and_yields_accepted_tokens():
    """All proposals accepted: k + 1 tokens per sequence per step; none: as many steps as
    without speculation, none cheaper. On Llama-3-8B and an A100 a step of 8 sequences is
    bound by reading the weights, so verifying 3 proposals each costs what one token does and
    speculation at 60% acceptance pays; at 256 sequences the step is bound by compute, the
    proposals cost what they weigh, and the same speculation loses."""
    from pagedlab.engine import SchedulerConfig
    from pagedlab.sim import Request
    from pagedlab.sim.cost_model import CostModel
    from pagedlab.sim.simulator import PagedConfig, simulate_paged

    cost = CostModel("Llama-3-8B", "A100-80GB")
    spec = SchedulerConfig(max_num_seqs=256,
                           speculative_config={"num_speculative_tokens": 3})

    def run(batch, scheduler=SchedulerConfig(max_num_seqs=256), rate=0.0):
        requests = [Request(i, 0.0, 64, 65) for i in range(batch)]  # a prefill, 64 decodes
        return simulate_paged(requests, cost, PagedConfig(scheduler=scheduler,
                                                          acceptance_rate=rate))

    plain, every, none = run(8), run(8, spec, 1.0), run(8, spec, 0.0)
    assert len(plain.time) - 1 == 64 and len(every.time) - 1 == 64 // 4  # k + 1 per step
    assert len(none.time) == len(plain.time) and none.time[-1] >= plain.time[-1]
    assert run(8, spec, 0.6).finish.max() < 0.7 * plain.finish.max()
    assert run(256, spec, 0.6).finish.max() > run(256).finish.max()


def test_the_simulator_prices_a_draft_model_as_leviathan_et_al_s_c():
    """One sequence on Llama-3-8B and an A100, bound by reading the weights, so a verification
    step costs what a decode step does: with every proposal accepted, a draft of cost c per
    pass makes each step of gamma + 1 tokens cost 1 + gamma * c decode steps, Leviathan et
    al.'s (gamma + 1) / (gamma * c + 1) speed-up as alpha goes to 1."""
    from pagedlab.engine import SchedulerConfig
    from pagedlab.sim import Request
    from pagedlab.sim.cost_model import CostModel
    from pagedlab.sim.simulator import PagedConfig, SimExecutor, simulate_paged

    cost, gamma, c = CostModel("Llama-3-8B", "A100-80GB"), 3, 0.25
    spec = SchedulerConfig(speculative_config={"num_speculative_tokens": gamma})

    def decode_seconds(scheduler=SchedulerConfig(), **config):
        run = simulate_paged([Request(0, 0.0, 64, 97)], cost,
                             PagedConfig(scheduler=scheduler, **config))
        return run.finish[0] - run.first_token[0]  # 96 tokens after the prompt's

    plain = decode_seconds()
    free_draft = decode_seconds(spec, acceptance_rate=1.0)
    drafted = decode_seconds(spec, acceptance_rate=1.0, draft_cost=c)
    assert free_draft == pytest.approx(plain / (gamma + 1), rel=0.02)
    assert drafted == pytest.approx(plain * (gamma * c + 1) / (gamma + 1), rel=0.02)
    with pytest.raises(ValueError, match="draft_cost=-0.5 must be >= 0"):
        SimExecutor(cost, 16, draft_cost=-0.5)


def test_metrics_report_drafts_and_acceptances_under_vllm_s_names(case):
    pytest.importorskip("prometheus_client")
    from types import SimpleNamespace

    from pagedlab.metrics import EngineCollector

    refs = {tuple(p): r for p, r in zip(case["prompts"], case["refs"])}
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=64, speculative_config=NGRAM)
    llm.drafter.proposer = Oracle(refs, 0.4)
    llm.generate(case["prompts"], GREEDY, use_tqdm=False)
    collector = EngineCollector(SimpleNamespace(llm=llm, num_preemptions=0), "tiny")
    samples = {(s.name, s.labels.get("position")): s.value
               for family in collector.collect() for s in family.samples}
    spec = llm.scheduler.spec_stats
    assert samples["vllm:spec_decode_num_drafts_total", None] == spec.num_drafts > 0
    assert samples["vllm:spec_decode_num_draft_tokens_total", None] == spec.num_draft_tokens
    assert samples["vllm:spec_decode_num_accepted_tokens_total", None] == spec.num_accepted_tokens
    per_position = [samples["vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p)]
                    for p in range(3)]
    assert sum(per_position) == spec.num_accepted_tokens
    assert per_position == sorted(per_position, reverse=True)  # position i needs i - 1 before
