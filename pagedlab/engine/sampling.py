"""Choosing tokens from logits: greedy, temperature, top-k, top-p, seeds, parallel samples.

:class:`SamplingParams` mirrors vLLM's. A seeded request draws from its own
``torch.Generator``, so its tokens do not depend on what else shares the batch; with ``n > 1``,
sample ``i`` is seeded ``seed + i`` (as vLLM does), so it equals the same request run alone
with ``n=1, seed=seed + i``. The ``n`` samples are drawn from the prompt's logits; the
scheduler then forks the prompt's sequence into ``n``, sharing its blocks (copy-on-write).
Beam groups go to :mod:`pagedlab.engine.beams`. A speculative decode's proposals are verified
here too (:func:`verify_greedy`, :func:`verify_sampled`: chapter 12). A request whose sampling
raises fails alone: the others of its step are sampled without it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedlab.engine.beams import beam_step
from pagedlab.engine.params import SamplingParams
from pagedlab.engine.sequence import GroupOutput, SequenceGroup, SequenceOutput


def adjusted_logits(logits: Tensor, params: SamplingParams, prompt: list[int],
                    output: list[int]) -> Tensor:
    """One row of ``logits`` [vocab] after ``params``' logit bias and penalties, given the
    sequence's ``prompt`` and ``output`` token ids (vLLM's ``apply_penalties``)."""
    logits = logits.clone()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    vocab = logits.shape[-1]
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64, device=logits.device),
                            minlength=vocab)[:vocab]  # [vocab]
    seen = counts > 0
    seen_anywhere = seen.clone()
    seen_anywhere[torch.tensor(prompt, dtype=torch.int64, device=logits.device)] = True
    penalty = torch.where(seen_anywhere, params.repetition_penalty, 1.0).to(logits.dtype)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - params.frequency_penalty * counts - params.presence_penalty * seen


def filtered_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The distribution each row of ``logits`` [rows, vocab] is sampled from: softmax at the
    row's ``temperature``, keeping its ``top_k`` largest logits (<= 0: all), then the smallest
    set of those whose probabilities (renormalized) reach ``top_p`` ([rows] each).
    Probabilities [rows, vocab], in vocabulary order."""
    rows, vocab = logits.shape
    logits = logits / temperature[:, None]  # [rows, vocab]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        ordered, order = logits.sort(-1, descending=True)  # [rows, vocab] each
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [rows]
        ranks = torch.arange(vocab, device=logits.device)
        ordered = ordered.masked_fill(ranks >= k[:, None], float("-inf"))
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p[:, None]  # mass before a token already > p
        ordered = ordered.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, ordered)  # back to vocab order
    return logits.softmax(-1)


def sample_tokens(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                  generators) -> Tensor:
    """One token per row of ``logits`` [rows, vocab] from :func:`filtered_probs` (each row
    with its own ``temperature``, ``top_k``, ``top_p`` and generator; None: torch's global
    one).

    The draw is an exponential race: with E_i ~ Exp(1) independent, ``argmax_i p_i / E_i``
    is token i with probability p_i, so one noise tensor and one argmax sample the whole
    batch; only the noise is drawn row by row, for rows that carry their own generator.
    """
    probs = filtered_probs(logits, temperature, top_k, top_p)  # [rows, vocab]
    rows = probs.shape[0]
    noise = torch.empty_like(probs)
    own = [i for i, g in enumerate(generators) if g is not None]
    for i in own:
        noise[i].exponential_(generator=generators[i])
    if len(own) < rows:
        shared = torch.ones(rows, dtype=torch.bool, device=logits.device)
        shared[own] = False
        noise[shared] = torch.empty_like(noise[shared]).exponential_()
    return (probs / noise).argmax(-1)  # [rows]


# --- speculative decoding: verifying a decode's proposals ---------------------------------

def verify_greedy(target: Tensor, drafts: list[int]) -> list[int]:
    """Greedy verification: ``target`` [k + 1] holds the target's argmax after the pending
    token and after each guess. Keep the guesses that match, then the target's own token."""
    best = target.tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return drafts[:accepted] + [best[accepted]]


def verify_sampled(probs: Tensor, drafts: list[int], draft_probs: Tensor | None = None,
                   generator: torch.Generator | None = None) -> list[int]:
    """Rejection sampling: ``probs`` [k + 1, vocab] is the target's distribution after the
    pending token and after each guess; ``draft_probs`` [k, vocab] the proposer's (None: each
    guess was certain). Returns the accepted guesses and one token drawn by the target."""
    for i, x in enumerate(drafts):
        p = probs[i]
        q = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator, device=probs.device))
        if u * q < float(p[x]):  # u < min(1, p(x) / q(x)), without dividing by q = 0
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        return drafts[:i] + [_draw(residual, generator)]
    return drafts + [_draw(probs[len(drafts)], generator)]


def _draw(weights: Tensor, generator) -> int:
    """A token with probability proportional to ``weights`` [vocab] (all zero: the argmax,
    which rounding alone can bring about when ``p`` and ``q`` agree)."""
    if not float(weights.sum()) > 0:
        return int(weights.argmax())
    return int(torch.multinomial(weights, 1, generator=generator))


class Sampler:
    """Turns a step's logits into each group's children (the model-side half of a step).

    Batched: one ``log_softmax`` and one ``argmax`` over the whole batch (a greedy row reads
    its token from the second), one :func:`sample_tokens` for every random draw. A seeded
    draw takes its noise from its request's own generator, so it does not depend on its batch.
    """

    def __call__(self, groups: list[SequenceGroup], rows: dict[int, int], logits: Tensor,
                 drafts: dict[int, list[int]] | None = None):
        """``rows`` maps a sequence id to its (first) row of ``logits`` [rows, vocab] (fp32);
        ``drafts`` a speculative decode's sequence id to its proposals, verified by the
        ``len(draft) + 1`` rows from there (:mod:`pagedlab.engine.speculative`).

        If the batch raises, each group is sampled alone, so that a group whose sampling
        raises fails by itself (its output carries the error) and no other request with it."""
        try:
            return self._sample(groups, rows, logits, drafts)
        except Exception as error:  # noqa: BLE001  (whatever it is, it is this batch's)
            if len(groups) == 1:
                return [GroupOutput(groups[0], [], error=error)]
            return [out for group in groups for out in self([group], rows, logits, drafts)]

    def _sample(self, groups, rows, logits, drafts):
        logprobs = logits.log_softmax(-1)  # [rows, vocab]
        logits = _adjusted(groups, rows, logits)
        drafts = drafts or {}
        draws, outputs = [], []  # draws: (group, seq, row, generator) of every sampled child
        for group in groups:
            seqs = group.live
            if group.is_beam_search:
                outputs.append(beam_step(group, seqs, logprobs[[rows[s.seq_id] for s in seqs]]))
                continue
            if not group.has_output:  # the prompt's logits give all n samples
                (seq,) = seqs
                pairs = [(seq, generator) for generator in group.generators]
            else:
                pairs = [(s, group.generators[s.index]) for s in seqs]
            out = GroupOutput(group, [])
            for seq, gen in pairs:
                if seq.seq_id in drafts:
                    out.children.append(self._verify(group, seq, rows[seq.seq_id], gen, logits,
                                                     logprobs, drafts[seq.seq_id]))
                else:
                    draws.append((group, seq, rows[seq.seq_id], gen))
            outputs.append(out)
        children = {id(out.group): out.children for out in outputs}
        for (group, seq, row, _), token in zip(draws, self._tokens(logits, draws)):
            k = group.params.logprobs
            top = None if k is None else top_logprobs(logprobs[row], k, token)
            children[id(group)].append(SequenceOutput(seq, token, float(logprobs[row, token]), top))
        return outputs

    @staticmethod
    def _verify(group, seq, row, generator, logits, logprobs, draft) -> SequenceOutput:
        """Verify a speculative decode's ``draft`` on its ``len(draft) + 1`` rows."""
        rows = slice(row, row + len(draft) + 1)
        p = group.params
        if p.greedy:
            tokens = verify_greedy(logits[rows].argmax(-1), draft)
        else:
            def column(value, dtype):  # [len(draft) + 1]
                return torch.full((len(draft) + 1,), value, dtype=dtype, device=logits.device)

            probs = filtered_probs(logits[rows], column(p.temperature, logits.dtype),
                                   column(p.top_k, torch.int64), column(p.top_p, logits.dtype))
            tokens = verify_sampled(probs, draft, None, generator)
        scored = []
        for i, token in enumerate(tokens):
            lp = logprobs[row + i]
            top = None if p.logprobs is None else top_logprobs(lp, p.logprobs, token)
            scored.append((token, float(lp[token]), top))
        return SequenceOutput(seq, *scored[-1], accepted=scored[:-1])

    @staticmethod
    def _tokens(logits: Tensor, draws) -> list[int]:
        """Each draw's token: greedy ones from one argmax, random ones from one sample_tokens."""
        tokens = [0] * len(draws)
        greedy = [i for i, (group, *_) in enumerate(draws) if group.params.greedy]
        if greedy:
            best = logits.argmax(-1).tolist()  # [num_seqs]
            for i in greedy:
                tokens[i] = best[draws[i][2]]
        random = [i for i in range(len(draws)) if not draws[i][0].params.greedy]
        if random:
            params = [draws[i][0].params for i in random]

            def column(values, dtype):  # [num_random]
                return torch.tensor(values, dtype=dtype, device=logits.device)

            picked = sample_tokens(
                logits[column([draws[i][2] for i in random], torch.int64)],
                column([p.temperature for p in params], logits.dtype),
                column([p.top_k for p in params], torch.int64),
                column([p.top_p for p in params], logits.dtype),
                [draws[i][3] for i in random],
            )
            for i, token in zip(random, picked.tolist()):
                tokens[i] = token
        return tokens


def _adjusted(groups: list[SequenceGroup], rows: dict[int, int], logits: Tensor) -> Tensor:
    """``logits`` with the rows of groups that ask for a bias or penalties adjusted."""
    adjusting = [g for g in groups if not g.is_beam_search and g.params.adjusts_logits]
    if not adjusting:
        return logits
    logits = logits.clone()
    for group in adjusting:
        for seq in group.live:
            row = rows[seq.seq_id]
            logits[row] = adjusted_logits(logits[row], group.params, group.prompt_token_ids,
                                          seq.output_token_ids)
    return logits


def top_logprobs(logprobs: Tensor, k: int, token: int) -> dict[int, float]:
    """The ``k`` likeliest tokens' log-probabilities and the sampled ``token``'s, by token id."""
    values, ids = logprobs.topk(k) if k else (logprobs[:0], logprobs[:0].long())
    top = dict(zip(ids.tolist(), values.tolist()))
    top.setdefault(token, float(logprobs[token]))
    return top
