"""Choosing tokens from logits: greedy, temperature, top-k, top-p, seeds, parallel samples.

:class:`SamplingParams` mirrors vLLM's. A seeded request draws from its own
``torch.Generator``, so its tokens do not depend on what else shares the batch; with ``n > 1``,
sample ``i`` is seeded ``seed + i`` (as vLLM does), so it equals the same request run alone
with ``n=1, seed=seed + i``. The ``n`` samples are drawn from the prompt's logits; the
scheduler then forks the prompt's sequence into ``n``, sharing its blocks (copy-on-write).
Beam groups go to :mod:`pagedlab.engine.beams`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedlab._checks import check_positive
from pagedlab.engine.beams import beam_step
from pagedlab.engine.sequence import GroupOutput, SequenceGroup, SequenceOutput

GREEDY_BELOW = 1e-5  # a temperature this small means greedy, as in vLLM


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a request's completions (vLLM's names and defaults).

    ``temperature`` 0 is greedy; ``top_k`` 0 or -1 and ``top_p`` 1 keep every token;
    generation stops at the model's EOS (unless ``ignore_eos``), at any of
    ``stop_token_ids``, at any of the strings ``stop`` (the output text is cut before it; needs
    a tokenizer), or after ``max_tokens`` tokens; ``logprobs=k`` returns, for each generated
    token, the log-probabilities of the ``k`` likeliest tokens and of the sampled one, from the
    model's raw logits (before temperature, top-k and top-p, as vLLM V1 by default).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    def __post_init__(self):
        check_positive("n", self.n, integer=True)
        check_positive("max_tokens", self.max_tokens, integer=True)
        check_positive("temperature", self.temperature, allow_zero=True)
        check_positive("top_p", self.top_p)
        if self.top_p > 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1, 0 (both: off) or a positive int")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63 - self.n
        ):
            raise ValueError(f"seed={self.seed!r} must be None or an int in [0, 2**63 - n)")
        if self.logprobs is not None:
            check_positive("logprobs", self.logprobs, integer=True, allow_zero=True)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be token ids (ints >= 0)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "stop", stop)

    @property
    def width(self) -> int:
        """Sequences the request runs at once."""
        return self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generators(self, device) -> list[torch.Generator | None]:
        """Each sample's random stream: sample i seeded ``seed + i``; None (global) unseeded."""
        if self.seed is None:
            return [None] * self.n
        return [torch.Generator(device=device).manual_seed(self.seed + i) for i in range(self.n)]


def sample_token(logits: Tensor, params: SamplingParams, generator) -> int:
    """One token from logits [vocab] after temperature, top-k and top-p."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature  # [vocab]
    if 0 < params.top_k < logits.numel():
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)  # [vocab] each
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # mass before a token already > top_p
        drop = torch.zeros_like(drop).scatter(0, order, drop)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)  # [vocab]
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """Turns a step's logits into each group's children (the model-side half of a step)."""

    def __call__(self, groups: list[SequenceGroup], rows: dict[int, int], logits: Tensor):
        """``rows`` maps a sequence id to its row of ``logits`` [num_seqs, vocab] (fp32)."""
        logprobs = logits.log_softmax(-1)  # [num_seqs, vocab]
        return [self._group(g, rows, logits, logprobs) for g in groups]

    def _group(self, group, rows, logits, logprobs) -> GroupOutput:
        seqs = group.live
        if group.is_beam_search:
            return beam_step(group, seqs, logprobs[[rows[s.seq_id] for s in seqs]])
        if not group.is_prefilled:  # the prompt's logits give all n samples
            (seq,) = seqs
            draws = [(seq, generator) for generator in group.generators]
        else:
            draws = [(s, group.generators[s.index]) for s in seqs]
        children, k = [], group.params.logprobs
        for seq, generator in draws:
            row = rows[seq.seq_id]
            token = sample_token(logits[row], group.params, generator)
            top = None if k is None else top_logprobs(logprobs[row], k, token)
            children.append(SequenceOutput(seq, token, float(logprobs[row, token]), top))
        return GroupOutput(group, children)


def top_logprobs(logprobs: Tensor, k: int, token: int) -> dict[int, float]:
    """The ``k`` likeliest tokens' log-probabilities and the sampled ``token``'s, by token id."""
    values, ids = logprobs.topk(k) if k else (logprobs[:0], logprobs[:0].long())
    top = dict(zip(ids.tolist(), values.tolist()))
    top.setdefault(token, float(logprobs[token]))
    return top
