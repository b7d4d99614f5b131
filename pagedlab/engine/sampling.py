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
    ``stop_token_ids``, or after ``max_tokens`` tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        check_positive("n", self.n, integer=True)
        check_positive("max_tokens", self.max_tokens, integer=True)
        check_positive("temperature", self.temperature, allow_zero=True)
        check_positive("top_p", self.top_p)
        if self.top_p > 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1, 0 (both: off) or a positive int")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int or None")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

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
        children = []
        for seq, generator in draws:
            row = rows[seq.seq_id]
            token = sample_token(logits[row], group.params, generator)
            children.append(SequenceOutput(seq, token, float(logprobs[row, token])))
        return GroupOutput(group, children)
