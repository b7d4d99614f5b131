"""The draft-model proposer: an early-exit draft on a paged cache of its own.

References are independent of the engine: transformers' greedy decoding of the target (the
output must not change) and of a transformers model cut to the draft's layers (each step's
guesses must be that model's greedy continuation of the sequence, which they are only if the
draft's cache holds exactly the sequence's K/V: a rejected guess left in it, or an accepted
token missing, changes them); the exact two-token distribution from transformers' logits for
rejection sampling with the draft's own distribution; block counts for the draft's pool.
"""

import copy
import random
from collections import Counter

import pytest
import torch
from _tiny import hf_greedy, random_prompts, tiny_hf

from pagedlab import LLM, SamplingParams
from pagedlab._arith import cdiv
from pagedlab.engine.draft import DraftModelProposer, early_exit
from pagedlab.engine.sequence import Sequence
from pagedlab.engine.sampling import verify_sampled
from pagedlab.engine.speculative import SpeculativeConfig
from pagedlab.engine.step import run_step
from pagedlab.model import PagedLlama, from_hf

K = 3
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def draft_config(layers, k=K):
    return {"method": "draft_model", "num_speculative_tokens": k, "draft_layers": layers}


def cut(hf, layers):
    """transformers' model with only its first ``layers`` layers (same weights): the draft's
    independent reference."""
    short = copy.deepcopy(hf)
    short.model.layers = short.model.layers[:layers]
    short.config.num_hidden_layers = layers
    return short


@pytest.fixture(scope="module")
def case():
    hf = tiny_hf("qwen2-gqa-d64")  # 4 layers
    prompts = random_prompts((9, 14, 5, 21), hf.config.vocab_size)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return dict(hf=hf, model=from_hf(hf), prompts=prompts, refs=refs)


def test_config_needs_draft_layers_and_names_bad_ones(case):
    config = SpeculativeConfig.of(draft_config(2))
    assert (config.method, config.draft_layers) == ("draft_model", 2)
    with pytest.raises(ValueError, match="draft_layers"):
        SpeculativeConfig.of({"method": "draft_model"})
    with pytest.raises(ValueError, match="draft_layers"):
        SpeculativeConfig.of({"method": "ngram", "draft_layers": 2})
    with pytest.raises(ValueError, match="draft_layers=0"):
        SpeculativeConfig.of(draft_config(0))
    with pytest.raises(ValueError, match="draft_layers=5 must be at most the target's 4"):
        LLM(case["model"], num_gpu_blocks=8, speculative_config=draft_config(5))


def test_early_exit_shares_the_targets_weights(case):
    model = case["model"]
    draft = early_exit(model, 2)
    assert draft.args.num_layers == 2 and len(draft.model.layers) == 2
    assert draft.model.layers[1] is model.model.layers[1]
    assert draft.lm_head.weight is model.lm_head.weight
    assert draft.model.norm is model.model.norm


def serve(case, layers, check=None, prompts=None, **engine):
    """Greedy outputs with the draft proposer; after every step the target's invariants and
    the draft's: its pool's blocks add up, and it holds each live sequence's tokens (no
    rejected guess among them), then its next guesses. ``check(llm, step)`` sees each step before it is applied."""
    llm = LLM(case["model"], block_size=4, speculative_config=draft_config(layers), **engine)
    draft = llm.drafter.proposer
    start = draft.manager.num_free_blocks
    prompts = prompts or case["prompts"]
    for i, prompt in enumerate(prompts):
        llm.add_request(str(i), prompt, GREEDY)
    outputs, preempted = {}, 0
    while llm.scheduler.has_unfinished:
        step, _, done = run_step(llm.scheduler, llm.runner, drafter=llm.drafter,
                                 observe=lambda s, _: check and check(llm, s))
        preempted += len(step.preempted)
        llm.manager.check_invariants()
        draft.manager.check_invariants()
        held = 0
        for group in llm.scheduler.running:
            for seq in group.live:
                if seq.seq_id in draft.manager:
                    tokens = draft.manager.token_ids(seq.seq_id)  # and its next guesses
                    n = min(len(tokens), len(seq))
                    assert tokens[:n] == seq.token_ids[:n], "a rejected guess kept"
                    held += cdiv(len(tokens), draft.manager.block_size)
        assert draft.manager.num_used_blocks == held  # no other sequence holds a block
        for group in done:
            outputs[group.request_id] = group.seqs[0].output_token_ids
    assert draft.manager.num_free_blocks == start and llm.manager.num_used_blocks == 0
    return [outputs[str(i)] for i in range(len(prompts))], llm, preempted


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("prefix, budget", [(False, 64), (True, 6)])
def test_greedy_draft_speculation_matches_transformers(case, layers, prefix, budget):
    """Chunked prefill (a budget of 6 tokens cuts prompts and guesses) and prefix caching."""
    tokens, llm, _ = serve(case, layers, num_gpu_blocks=64, enable_prefix_caching=prefix,
                           max_num_batched_tokens=budget, max_num_seqs=4)
    assert tokens == case["refs"]
    stats = llm.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and 0 < stats.acceptance_rate < 1


def test_guesses_are_the_cut_models_greedy_continuation(case):
    """Every step, each sequence's guesses equal transformers' greedy decoding with the
    draft's layers: the draft's cache was rolled back to exactly the accepted tokens."""
    short = cut(case["hf"], 2)
    seen = []

    def check(llm, step):
        for chunk in step.decodes:
            if chunk.draft:
                context = chunk.seq.token_ids
                assert chunk.draft == hf_greedy(short, context, len(chunk.draft)), context
                seen.append(len(chunk.draft))

    tokens, llm, _ = serve(case, 2, check=check, num_gpu_blocks=64, max_num_seqs=4)
    assert tokens == case["refs"] and len(seen) > 10
    assert 0 < llm.scheduler.spec_stats.acceptance_rate < 1  # so rollbacks happened


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_frees_the_drafts_blocks_and_keeps_the_output(case, mode):
    prompts = [p + p for p in case["prompts"]]
    refs = [hf_greedy(case["hf"], p, MAX_TOKENS) for p in prompts]
    tokens, llm, preempted = serve(case, 2, prompts=prompts, num_gpu_blocks=24,
                                   num_cpu_blocks=32, preemption_mode=mode, max_num_seqs=4)
    assert tokens == refs and preempted > 0


def test_abort_in_the_middle_of_speculation_frees_the_drafts_blocks(case):
    """Requests aborted after a step was scheduled (guesses in both caches, unverified) and
    after it ran: the target's pool gets their blocks back at once, the draft's at its next
    drafting, which follows the running requests."""
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=64, speculative_config=draft_config(2))
    draft = llm.drafter.proposer
    start = draft.manager.num_free_blocks
    groups = [llm.add_request(str(i), p, GREEDY) for i, p in enumerate(case["prompts"])]
    for _ in range(3):
        llm.step()
    step = llm.scheduler.schedule()
    assert step.num_draft_tokens > 0 and draft.manager.num_used_blocks > 0
    llm.scheduler.abort(groups[0])
    llm.scheduler.update(llm.runner.execute(step).outputs[1:])  # the others' outputs
    llm.drafter(llm.scheduler.running)
    assert groups[0].seqs[0].seq_id not in draft.manager
    assert groups[1].seqs[0].seq_id in draft.manager
    for group in groups[1:]:
        llm.scheduler.abort(group)
    llm.drafter(llm.scheduler.running)
    assert draft.manager.num_free_blocks == start and llm.manager.num_used_blocks == 0


@pytest.mark.parametrize("seed", range(4))
def test_draft_cache_after_random_accept_lengths(case, seed):
    """Drive the proposer alone: after each verification of a random length, the next
    drafting keeps the sequence's tokens and its new guesses, no rejected one, in exactly the
    blocks they need; two sequences interleave so that freed blocks are reused; a sequence
    left out of a drafting gives its blocks back, and so does everyone at the end."""
    rng = random.Random(seed)
    bs, k = 3, 4
    draft = DraftModelProposer(early_exit(case["model"], 1), bs, 120)
    seqs = [Sequence(i, list(p[:rng.randint(1, 8)])) for i, p in enumerate(case["prompts"][:2])]
    for _ in range(25):
        asked = seqs[1:] if rng.random() < 0.2 else seqs  # one leaves (preempted, say)
        guesses = draft.propose_all(asked, k)
        if asked is not seqs:
            assert seqs[0].seq_id not in draft.manager
        for seq in asked:
            held = draft.manager.token_ids(seq.seq_id)
            assert len(guesses[seq.seq_id]) == k
            assert held == seq.token_ids + guesses[seq.seq_id][:k - 1], "a rejected guess kept"
            draft.manager.check_invariants()
            accepted = rng.randint(0, k)
            bonus = rng.randrange(case["hf"].config.vocab_size)
            for token in guesses[seq.seq_id][:accepted] + [bonus]:
                seq.append(token, 0.0)
        used = sum(cdiv(draft.manager.num_tokens(s.seq_id), bs) for s in asked)
        assert draft.manager.num_used_blocks == used
    assert draft.propose_all([], k) == {}
    assert draft.manager.num_free_blocks == 120


def test_a_full_draft_pool_proposes_nothing_rather_than_fail(case):
    """A draft pool too small for a sequence's context gives it no guesses; the output holds."""
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=64, speculative_config=draft_config(2))
    small = DraftModelProposer(early_exit(case["model"], 2), 4, 3)  # 12 token slots
    llm.drafter.proposer = small
    outs = llm.generate(case["prompts"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == case["refs"]
    assert llm.scheduler.spec_stats.num_draft_tokens > 0  # the short prompt got guesses
    assert small.manager.num_free_blocks == 3


def test_the_draft_pool_fills_exactly_and_a_sequence_too_big_skips_only_itself(case):
    """Blocks are counted exactly: a pool with just the blocks a sequence's context and its
    guesses need drafts it; a sequence that does not fit is passed over, and the next one,
    which fits, still gets its guesses."""
    k, bs = 3, 4
    long_seq, short_seq = Sequence(0, list(range(1, 15))), Sequence(1, [5, 6, 7, 8, 9])
    need = cdiv(len(short_seq) + k - 1, bs)  # its context and k - 1 guesses' keys and values
    draft = DraftModelProposer(early_exit(case["model"], 1), bs, need)
    guesses = draft.propose_all([long_seq, short_seq], k)
    assert list(guesses) == [1] and len(guesses[1]) == k
    assert draft.manager.num_free_blocks == 0 and draft.num_forward_passes == k  # 1 + k - 1


def test_the_draft_keeps_the_accepted_guesses_and_computes_only_what_is_new(case):
    """After a verification that accepted some guesses, the draft's cache keeps their keys and
    values: the next catch-up pass runs only the target's own token (and, all rejected,
    only that one after the context)."""
    k = 4
    for accepted in range(k):
        draft = DraftModelProposer(early_exit(case["model"], 1), 4, 32)
        seq = Sequence(0, list(case["prompts"][0]))
        guesses = draft.propose_all([seq], k)[0]
        for token in guesses[:accepted] + [(guesses[accepted] + 1) % 50]:  # then a rejection
            seq.append(token, 0.0)
        caught_up = []
        forward = draft._forward
        draft._forward = lambda step: (caught_up.append([c.num_tokens for c in step.prefills]),
                                       forward(step))[1]
        draft.propose_all([seq], k)
        assert caught_up[0] == [1], (accepted, caught_up[0])


def test_a_draft_holds_no_swap_space(case):
    """A draft never swaps (a sequence its pool cannot hold gets no guesses instead), so its
    runner keeps no CPU blocks: on a GPU machine each would be pinned host memory held for
    nothing. Its GPU cache holds the pool it was given, block for block."""
    draft = DraftModelProposer(early_exit(case["model"], 2), 4, 6)
    assert [tuple(t.shape[0] for t in kv) for kv in draft.runner.kv_caches] == [(6, 6)] * 2
    assert [tuple(t.shape[0] for t in kv) for kv in draft.runner.cpu_caches] == [(0, 0)] * 2


def test_early_exit_keeps_the_targets_kernels_and_names_a_bad_depth(case):
    model = from_hf(case["hf"])
    model.kernels = "triton"
    assert early_exit(model, 4).kernels == "triton"  # all of the target's 4 layers is allowed
    with pytest.raises(ValueError, match=r"^draft_layers=1.5 must be an integer"):
        early_exit(model, 1.5)
    with pytest.raises(ValueError, match=r"^draft_layers=5 must be at most the target's 4 "
                                         r"layers$"):
        early_exit(model, 5)


# --- sampling ----------------------------------------------------------------------------------

def chi2_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at 0.999 (z of the normal), by Wilson and Hilferty's cube."""
    h = 2 / (9 * dof)
    return dof * (1 - h + z * h ** 0.5) ** 3


def test_rejection_sampling_with_the_drafts_distribution_emits_the_targets(case):
    """Guesses drawn from the draft's own distribution q (the 1-layer model's softmax at
    temperature 6, not a point mass) and verified by Leviathan et al.'s rule against the
    target's at the same temperature: the first two tokens emitted follow the target's exact
    distribution (chi-square over the pairs, those expected fewer than 5 times pooled; 2,000
    seeded trials). Ignoring q (the point-mass rule) is exact too, since it holds for any
    guess, but accepts fewer; drawing from the target after a rejection must fail."""
    hf = tiny_hf("qwen2-gqa-d64", vocab_size=6)
    short = cut(hf, 1)
    cache = {}

    def dist(model, context):
        key = (id(model), tuple(context))
        if key not in cache:
            with torch.no_grad():
                cache[key] = (model(torch.tensor([context])).logits[0, -1] / 6).softmax(-1)
        return cache[key]

    prompt, k, trials = [1, 4, 2], 2, 2000
    p0 = dist(hf, prompt)
    exact = {(a, b): float(p0[a] * dist(hf, prompt + [a])[b]) for a in range(6) for b in range(6)}
    bins = [t for t, e in exact.items() if trials * e >= 5]

    def from_p_after_rejection(probs, guesses, draft_probs, g):  # a plausible wrong rule
        tokens = verify_sampled(probs, guesses, draft_probs, g)
        i = len(tokens) - 1
        if i < len(guesses):
            tokens[i] = int(torch.multinomial(probs[i], 1, generator=g))
        return tokens

    def chi2(use_q, rule=verify_sampled):
        g = torch.Generator().manual_seed(0)
        counts, accepted = Counter(), 0
        for _ in range(trials):
            out = []
            while len(out) < 2:
                context, guesses, q = prompt + out, [], []
                for _ in range(k):
                    q.append(dist(short, context + guesses))
                    guesses.append(int(torch.multinomial(q[-1], 1, generator=g)))
                p = torch.stack([dist(hf, context + guesses[:i]) for i in range(k + 1)])
                emitted = rule(p, guesses, torch.stack(q) if use_q else None, g)
                accepted += len(emitted) - 1
                out += emitted
            counts[tuple(out[:2])] += 1
        observed = [counts[t] for t in bins] + [trials - sum(counts[t] for t in bins)]
        expected = [trials * exact[t] for t in bins]
        expected.append(trials - sum(expected))
        return sum((o - e) ** 2 / e for o, e in zip(observed, expected)), accepted

    critical = chi2_critical(len(bins))  # bins + the pooled rest, less one
    (with_q, accepted_q), (point, accepted_point) = chi2(True), chi2(False)
    assert with_q < critical and point < critical
    assert accepted_q > 1.1 * accepted_point  # sum min(p, q) > sum p q
    wrong = chi2(True, from_p_after_rejection)[0]
    assert wrong > critical  # the test can fail


def test_sampled_speculation_with_a_draft_follows_the_target(case):
    """Three tokens at temperature 1, top-k 2, drafted by the 3-layer model (its argmax, a
    point mass), over 1,200 seeded requests: frequencies against transformers' exact
    probabilities of the 8 outcomes."""
    hf, prompt = case["hf"], case["prompts"][2][:6]

    def top2(context):
        with torch.no_grad():
            values, ids = hf(torch.tensor([context])).logits[0, -1].topk(2)
        return ids.tolist(), values.softmax(-1).tolist()

    exact = {}
    for a, pa in zip(*top2(prompt)):
        for b, pb in zip(*top2(prompt + [a])):
            for c, pc in zip(*top2(prompt + [a, b])):
                exact[(a, b, c)] = pa * pb * pc
    n = 1200
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=1024, max_num_seqs=512,
              max_num_batched_tokens=4096, speculative_config=draft_config(3, k=2))
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=3, seed=s) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    assert set(counts) <= set(exact)
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in exact.items())
    assert chi2 < 24.32, (counts, exact)  # 7 degrees of freedom, 0.999
    stats = llm.scheduler.spec_stats
    assert stats.num_drafts >= n and 0 < stats.acceptance_rate < 1
    assert llm.drafter.proposer.manager.num_used_blocks == 0


def test_serve_takes_the_draft_method_on_its_command_line(case, tmp_path, monkeypatch):
    """``python -m pagedlab.serve --speculative-config '{"method": "draft_model", ...}'``
    builds an engine that drafts with the model's first layers (the server itself is not
    started: the engine it would serve is checked)."""
    pytest.importorskip("fastapi", reason="the server's extra is not installed")
    import json

    from pagedlab import serve

    case["hf"].save_pretrained(tmp_path)
    built = {}
    monkeypatch.setattr(serve, "build_app",
                        lambda llm, name, **kw: built.setdefault("llm", llm))
    monkeypatch.setattr(serve.Server, "run", lambda self, *args, **kw: None)
    serve.main(["--model", str(tmp_path), "--block-size", "4", "--num-gpu-blocks", "64",
                "--speculative-config", json.dumps(draft_config(2))])
    llm = built["llm"]
    assert isinstance(llm.drafter.proposer, DraftModelProposer)
    assert llm.drafter.proposer.model.args.num_layers == 2
    outs = llm.generate(case["prompts"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == case["refs"]
    assert llm.scheduler.spec_stats.num_draft_tokens > 0


def test_the_scheduler_runs_no_model_the_drafter_does(case, monkeypatch):
    """The scheduler decides and never runs a model, the draft's included: each forward pass
    runs in the runner (the target's) or in the drafter, after the step's tokens are applied
    (the draft's)."""
    llm = LLM(case["model"], block_size=4, num_gpu_blocks=64, speculative_config=draft_config(2))
    stage, passes, forward = [None], Counter(), PagedLlama.forward

    def counted(self, *args, **kwargs):
        passes[stage[0], self.args.num_layers] += 1
        return forward(self, *args, **kwargs)

    def labelled(name, method):  # a pass belongs to the outermost stage it runs in
        def run(*args, **kwargs):
            outer = stage[0]
            stage[0] = outer or name
            try:
                return method(*args, **kwargs)
            finally:
                stage[0] = outer
        return run

    monkeypatch.setattr(PagedLlama, "forward", counted)
    llm.scheduler.schedule = labelled("schedule", llm.scheduler.schedule)
    llm.runner.execute = labelled("execute", llm.runner.execute)
    llm.drafter.proposer.propose_all = labelled("draft", llm.drafter.proposer.propose_all)
    outs = llm.generate(case["prompts"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == case["refs"]
    layers = case["model"].args.num_layers
    assert set(passes) == {("execute", layers), ("draft", 2)}, passes
