"""Speculative decoding: propose a few tokens cheaply, verify them in one forward pass.

A proposer guesses the next ``k`` tokens of a sequence; the step then runs the sequence's
pending token and the ``k`` guesses through the target model at once (causal within the
sequence, like a prefill chunk) and keeps the longest prefix the target agrees with, plus one
token of the target's own, so a step yields between 1 and ``k + 1`` tokens.

The work is split as vLLM V1 splits it, each part in one place:

- proposing, here: after a step's tokens are applied, a :class:`Drafter` asks the proposer
  for each running sequence's guesses and stores them on the sequence (``spec_token_ids``,
  as V1's ``update_draft_token_ids``). Proposers share the small interface of
  :class:`Proposer`: n-gram lookup here, a draft model in :mod:`pagedlab.engine.draft`.
- scheduling: the scheduler takes as many guesses as its token budget and the free blocks
  allow, reserving their slots; it never runs a model.
- verifying: the sampler keeps the guesses the target agrees with (greedy) or accepts them
  by the rejection rule (sampled), :func:`~pagedlab.engine.sampling.verify_sampled`.
- rolling back: the scheduler's update gives back the rejected guesses' slots
  (:meth:`~pagedlab.memory.KVCacheManager.truncate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlab._checks import check_positive
from pagedlab.engine.sequence import Sequence, SequenceGroup

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


class Proposer:
    """What a :class:`Drafter` asks of a proposer: guesses for a batch of sequences."""

    def propose_all(self, seqs: list[Sequence], k: int) -> dict[int, list[int]]:
        """Up to ``k`` guesses for the tokens after each of ``seqs``, by sequence id.

        Called after every step with the sequences that decode next, and only them: a
        proposer that keeps state per sequence (a draft model's cache) drops the others'.
        """
        return {seq.seq_id: self.propose(seq.token_ids, k) for seq in seqs}

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` guesses for the tokens after ``token_ids``, one sequence alone."""
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's
    last ``n`` tokens (longest ``n`` first). Cheap and model-free; it pays where the output
    copies its input (editing, summarising, code), and proposes nothing elsewhere."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
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


class Drafter:
    """Proposals for the next step, made once a step's tokens are applied (V1's runner drafts
    after sampling; its scheduler stores the guesses with ``update_draft_token_ids``).

    Every running sequence whose next step is a decode gets up to ``num_speculative_tokens``
    guesses in ``seq.spec_token_ids``, cut so that with the target's own token the sequence
    passes neither its request's ``max_tokens`` nor ``max_len``. Beam search gets none. The
    scheduler then takes what its budget and the free blocks allow.
    """

    def __init__(self, proposer: Proposer, num_speculative_tokens: int):
        self.proposer, self.k = proposer, num_speculative_tokens

    def __call__(self, running: list[SequenceGroup]) -> None:
        seqs = [seq for group in running if not group.is_beam_search for seq in group.live
                if seq.num_computed_tokens == len(seq) - 1]  # decoding: only its pending token
        guesses = self.proposer.propose_all(seqs, self.k)
        for group in running:
            if group.is_beam_search:
                continue
            for seq in group.live:
                limit = group.params.max_tokens - len(seq.output_token_ids) - 1  # the bonus
                if group.max_len is not None:
                    limit = min(limit, group.max_len - len(seq) - 1)
                seq.spec_token_ids = guesses.get(seq.seq_id, [])[:max(limit, 0)]


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
