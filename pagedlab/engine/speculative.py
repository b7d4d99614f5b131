"""Speculative decoding: propose a few tokens cheaply, verify them in one forward pass.

A proposer guesses the next ``k`` tokens of a sequence; the step then runs the sequence's
pending token and the ``k`` guesses through the target model at once (causal within the
sequence, like a prefill chunk) and keeps the longest prefix the target agrees with, plus one
token of the target's own, so a step yields between 1 and ``k + 1`` tokens.

Greedy requests accept a guess when it is the target's argmax, so the output is the one
decoding without speculation gives. Sampled requests use the rejection rule of Leviathan et
al. (2023) and Chen et al. (2023): accept guess ``x`` drawn from ``q`` with probability
``min(1, p(x) / q(x))``; at the first rejection draw from ``max(p - q, 0)`` renormalized;
after ``k`` acceptances draw the bonus token from ``p``. Each emitted token is then
distributed exactly as the target's ``p`` (chapter 12 proves it). A proposal that is not
random (n-gram lookup, a draft model's argmax) is a point mass: ``q(x) = 1``.

Proposers share the small interface of :class:`Proposer`. A draft model
(:mod:`pagedlab.engine.draft`) keeps K/V of its own, so it also hears which proposals were
accepted and when a sequence leaves the running batch.

The paged cache's side (slots reserved for the guesses, rolled back when they are rejected,
never cached before they are verified) is the scheduler's and the manager's:
:meth:`~pagedlab.memory.KVCacheManager.append` with ``num_speculative`` and
:meth:`~pagedlab.memory.KVCacheManager.truncate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from pagedlab._checks import check_positive

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` fields. ``"ngram"``: propose up to
    ``num_speculative_tokens`` tokens that followed the latest earlier occurrence of the
    sequence's last ``n`` tokens, for the longest ``n`` from ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` that occurs. ``"draft_model"``: the target's first ``draft_layers``
    layers, its final norm and its head guess greedily, on a paged cache of their own (an
    early-exit draft; ``draft_layers`` is pagedlab's field, vLLM names a separate ``model``)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_layers: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} must be one of {METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            check_positive(name, getattr(self, name), integer=True)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be at most "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model":
            if self.draft_layers is None:
                raise ValueError("speculative method 'draft_model' needs draft_layers, the "
                                 "number of the target's layers the draft keeps")
            check_positive("draft_layers", self.draft_layers, integer=True)
        elif self.draft_layers is not None:
            raise ValueError(f"draft_layers={self.draft_layers} is for method 'draft_model', "
                             f"not {self.method!r}")

    @classmethod
    def of(cls, config: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A config from vLLM's dict form (``{"method": "ngram", ...}``), or as given."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config={config!r} must be a dict or SpeculativeConfig")
        unknown = set(config) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {sorted(unknown)}")
        return cls(**config)

    def proposer(self, model=None, block_size: int = 16, num_blocks: int = 1024) -> Proposer:
        """The configured proposer; a draft model is cut from the target ``model`` and gets
        a cache of ``num_blocks`` blocks of ``block_size`` tokens."""
        if self.method == "ngram":
            return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)
        if model is None:
            raise ValueError("speculative method 'draft_model' needs the target model: "
                             "an LLM builds its proposer (the simulator has none)")
        from pagedlab.engine.draft import DraftModelProposer, early_exit

        return DraftModelProposer(early_exit(model, self.draft_layers), block_size, num_blocks,
                                  self.num_speculative_tokens)


class Proposer:
    """What the scheduler asks of a proposer. Only :meth:`propose` is required; the hooks
    are for a proposer with state per sequence (a draft model's cache), and do nothing here."""

    def start_step(self, seqs) -> None:
        """The step's decoding sequences, before any is asked: a model drafts them together."""

    def propose(self, token_ids: list[int], k: int, seq_id=None) -> list[int]:
        """Up to ``k`` guesses for the tokens after ``token_ids`` (sequence ``seq_id``)."""
        raise NotImplementedError

    def keep(self, seq_id, num_tokens: int) -> None:
        """Verification kept the first ``num_tokens`` tokens of ``seq_id`` (the rest of what
        it was proposed was rejected)."""

    def free(self, seq_id) -> None:
        """``seq_id`` left the running batch (finished, aborted or preempted)."""


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's
    last ``n`` tokens (longest ``n`` first). Cheap and model-free; it pays where the output
    copies its input (editing, summarising, code), and proposes nothing elsewhere."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int, seq_id=None) -> list[int]:
        """``k`` guesses for the tokens after ``token_ids`` (none if no n-gram recurs).

        The guesses copy what followed the match; a match that ends less than ``k`` tokens
        before the end copies on into its own guesses, as an LZ77 back-reference does, so a
        repeating pattern of period ``p`` is continued however close the match is.
        """
        n_tokens = len(token_ids)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = token_ids[n_tokens - n:]
            for start in range(n_tokens - n - 1, -1, -1):  # latest occurrence first
                if token_ids[start:start + n] == suffix:
                    source = token_ids[start + n:]  # what followed, then the guesses
                    guesses = source[:k]
                    while len(guesses) < k:
                        guesses.append(guesses[len(guesses) - len(source)])
                    return guesses
        return []


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


@dataclass
class SpecDecodingStats:
    """Counts over verification steps, as vLLM's ``spec_decode`` metrics: drafts verified,
    tokens proposed and accepted, and acceptances by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        grow = proposed - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(grow, 0)
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Fraction of proposed tokens accepted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: the accepted ones and the target's."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
