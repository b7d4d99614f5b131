"""Beam search built from fork and free, with Hugging Face transformers' semantics (chapter 5).

Each step, every live beam proposes its continuations; the best ``beam_width`` that do not
end become the next beams. A beam chosen by several continuations is forked (the children
share its blocks, copy-on-write), a beam chosen by none is freed. So the group's memory is
the beams' shared prefix tree, which is what makes beam search cheap under paging.

The selection follows ``transformers``' ``generate(num_beams=k, do_sample=False)`` step for
step, so that the two agree token for token: scores are cumulative log-probabilities in fp32;
``max(2, 1 + number of EOS ids) * k`` candidates are ranked; a candidate that ends (EOS, or
``max_tokens`` reached) is kept among the finished beams only if it ranks in the top ``k``,
scored ``cum_logprob / generated_tokens ** length_penalty``; the search stops when no running
beam can beat the worst of ``k`` finished ones (``early_stopping``: False is transformers'
heuristic, True stops as soon as ``k`` beams have finished, "never" assumes the longest
continuation when ``length_penalty > 0``), or when every candidate ended.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedlab.engine.params import BeamSearchParams
from pagedlab.engine.sequence import GroupOutput, Sequence, SequenceGroup, SequenceOutput


@dataclass
class BeamSearchSequence:
    """A finished beam; ``tokens`` holds the prompt, then the generated tokens (as vLLM)."""

    tokens: list[int]
    cum_logprob: float
    score: float  # cum_logprob / generated_tokens ** length_penalty: its rank among finished beams
    finish_reason: str  # "stop" (an EOS) or "length"


@dataclass
class BeamSearchOutput:
    """The best finished beams of one request, best first (at most ``beam_width``)."""

    sequences: list[BeamSearchSequence]


def beam_step(group: SequenceGroup, beams: list[Sequence], logprobs: Tensor) -> GroupOutput:
    """Choose the next beams of ``group`` from its live ``beams``' logprobs [num_beams, vocab].

    Finished candidates go to ``group.completed`` (the best ``beam_width``, best first); the
    returned children continue; ``done`` says the search is over.
    """
    params: BeamSearchParams = group.params
    k, vocab, finished = params.beam_width, logprobs.shape[1], group.completed
    cums = torch.tensor([b.cumulative_logprob for b in beams], dtype=torch.float32,
                        device=logprobs.device)  # [num_beams]
    scores = (cums[:, None] + logprobs).flatten()  # [num_beams * vocab], fp32 as transformers
    num_candidates = min(max(2, 1 + len(group.stop_token_ids)) * k, scores.numel())
    top, flat = scores.topk(num_candidates)  # best first
    generated = len(beams[0].output_token_ids) + 1  # tokens each candidate has generated
    children, running_scores = [], []
    for rank, (score, i) in enumerate(zip(top.tolist(), flat.tolist())):
        parent, token = beams[i // vocab], i % vocab
        ends = token in group.stop_token_ids
        if ends or generated >= params.max_tokens:
            if rank < k:  # only the top k may finish; the rest are spares for running
                reason = "stop" if ends else "length"
                normalized = score / generated**params.length_penalty
                finished.append(
                    BeamSearchSequence(parent.token_ids + [token], score, normalized, reason)
                )
                finished.sort(key=lambda h: h.score, reverse=True)
                del finished[k:]
        elif len(children) < k:
            # The logprob that makes the child's cumulative score the fp32 candidate score.
            children.append(SequenceOutput(parent, token, score - parent.cumulative_logprob))
            running_scores.append(score)
    return GroupOutput(group, children, done=_done(params, finished, running_scores, generated))


def _done(params: BeamSearchParams, finished, running_scores, generated: int) -> bool:
    """transformers' stopping test: nothing left to run, or no running beam can still win."""
    if not running_scores:
        return True
    if len(finished) < params.beam_width:
        return False
    if params.early_stopping is True:
        return True
    never = params.early_stopping == "never" and params.length_penalty > 0
    best_length = params.max_tokens if never else generated
    best_possible = running_scores[0] / best_length**params.length_penalty
    return best_possible <= finished[-1].score
