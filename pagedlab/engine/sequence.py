"""Requests as the scheduler sees them: sequences, and the groups they form (chapter 6).

A request becomes a :class:`SequenceGroup`: one sequence at first, ``n`` after its prompt when
it samples in parallel, up to ``beam_width`` beams in beam search. The group is the unit of
scheduling: its sequences share blocks, so they are admitted, preempted, swapped and resumed
together.

A sequence carries its own progress, ``num_computed_tokens`` (vLLM V1's name): how many of its
tokens have keys and values in the cache. Every chunk the scheduler forms starts there; a
prompt being prefilled is simply far behind, a decoding sequence one token behind: its last
output token is *pending*, sampled but written only by the next step's forward pass.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class GroupStatus(enum.Enum):
    """Where a group is in its life: the scheduler's three queues, then done."""

    WAITING = "waiting"  # not admitted yet, or preempted by recomputation
    RUNNING = "running"  # its blocks are on the GPU; it decodes every step
    SWAPPED = "swapped"  # preempted by swapping: its blocks wait in the CPU pool
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: the shared prompt and this sequence's outputs."""

    seq_id: int  # the KV-cache manager's id
    prompt_token_ids: list[int]
    index: int = 0  # which completion of its request (parallel sampling)
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per output token, if requested
    num_computed_tokens: int = 0  # tokens whose keys and values are (being) cached
    spec_token_ids: list[int] = field(default_factory=list)  # proposals for the next step

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest token, the one a decode step computes keys and values for (without
        building :attr:`token_ids`, whose copy a step per token would pay for)."""
        return (self.output_token_ids or self.prompt_token_ids)[-1]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the cache still lacks: 1 (the pending token) for a decoding sequence."""
        return len(self) - self.num_computed_tokens

    def append(self, token: int, logprob: float, top: dict[int, float] | None = None) -> None:
        """Take a sampled token; ``top`` holds the log-probabilities asked for (``logprobs``)."""
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        if top is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(top)

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A copy under a new id: same tokens and score, so far."""
        return Sequence(
            seq_id,
            self.prompt_token_ids,
            index,
            self.output_token_ids.copy(),
            self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs.copy(),
            num_computed_tokens=self.num_computed_tokens,
        )


@dataclass
class RequestMetrics:
    """When a request arrived, got its first output token and finished (``time.monotonic``
    seconds), as vLLM's ``RequestOutput.metrics``: time to first token is
    ``first_token_time - arrival_time``."""

    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed for the request
    num_accepted_tokens: int = 0  # and those its verification steps kept

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_tokens: int) -> float | None:
        """Mean seconds between output tokens after the first (None before two tokens)."""
        if self.finished_time is None or self.first_token_time is None or num_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_tokens - 1)


@dataclass(eq=False)
class SequenceGroup:
    """One request: its sequences, parameters and status.

    ``params`` is a :class:`~pagedlab.engine.sampling.SamplingParams` or a
    :class:`~pagedlab.engine.beams.BeamSearchParams`; ``stop_token_ids`` holds the
    tokens that end a sequence (the model's EOS unless ignored, plus the request's own);
    ``generators`` the random stream of each parallel sample (by index); ``completed`` the
    finished beams of beam search, best first; ``priority`` the request's urgency, smaller
    first, for a :class:`~pagedlab.engine.policy.Priority` policy (others ignore it);
    ``max_len`` caps a sequence's prompt and output tokens together (``max_model_len``);
    ``stop_check``, if set, reads a sequence after each token and returns the stop string that
    ends it, or None (the scheduler has no tokenizer: the engine supplies this);
    ``error`` is what failed the request, if anything did (it finished, the others go on).
    """

    request_id: str
    arrival: int  # order of arrival: FCFS, the default policy, serves by it
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    params: object
    is_beam_search: bool = False
    priority: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    generators: list = field(default_factory=list)  # [n] torch.Generator or None
    status: GroupStatus = GroupStatus.WAITING
    completed: list = field(default_factory=list)  # BeamSearchSequence, beam search only
    max_len: int | None = None
    stop_check: Callable[[Sequence], str | None] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: Exception | None = None

    @property
    def live(self) -> list[Sequence]:
        """The sequences still generating: each holds blocks unless the group is waiting."""
        if len(self.seqs) == 1:  # most requests, asked several times a step: kept cheap
            (seq,) = self.seqs
            return [] if seq.is_finished else [seq]
        return [s for s in self.seqs if not s.is_finished]

    @property
    def has_output(self) -> bool:
        """Has the group sampled yet? Its first sampling draws all ``n`` samples from the
        prompt's logits (and forks); after it, each live sequence samples its own."""
        return any(s.output_token_ids for s in self.seqs)

    @property
    def max_seqs(self) -> int:
        """Sequences it may run at once: the seats admission reserves for it. Parallel samples
        only ever finish; beams may come back to ``beam_width`` after some ended."""
        if self.has_output and not self.is_beam_search:
            return len(self.live)
        return self.params.width

    @property
    def is_finished(self) -> bool:
        return self.status is GroupStatus.FINISHED

    def shared_prompt(self, block_size: int) -> int:
        """Prompt tokens in full blocks its live sequences share when it is recomputed (0 if
        only one sequence is left, or the prompt fills no block)."""
        if len(self.live) < 2:
            return 0
        return len(self.prompt_token_ids) // block_size * block_size

    def assign(self, children: list[SequenceOutput], new_id: Callable[[], int]):
        """Give each child a sequence: its parent for the first child, a fork of the parent
        (id ``new_id()``) for each other, made before any parent takes its token.

        Returns the (sequence, child) pairs, the (parent, fork) pairs whose blocks the caller
        shares, and the live sequences left without a child (pruned beams), whose blocks the
        caller frees.
        """
        taken, plan, forks = set(), [], []
        for child in children:
            seq = child.parent
            if seq.seq_id in taken:
                seq = seq.fork(new_id(), index=len(self.seqs))
                self.seqs.append(seq)  # at once: an abort must find every sequence
                forks.append((child.parent, seq))
            taken.add(seq.seq_id)
            plan.append((seq, child))
        pruned = [s for s in self.live if s.seq_id not in taken]
        self.seqs = [s for s in self.seqs if s.is_finished] + [seq for seq, _ in plan]
        return plan, forks, pruned

    def take(self, seq: Sequence, child: SequenceOutput) -> bool:
        """Append ``child``'s tokens (its accepted proposals, then its own) to ``seq`` until
        one ends it (beams end as a whole); return whether one did."""
        for token, logprob, top in [*child.accepted, (child.token, child.logprob, child.top)]:
            seq.append(token, logprob, top)
            if not self.is_beam_search and self.stops(seq):
                return True
        return False

    def stops(self, seq: Sequence) -> bool:
        """Does ``seq``'s last token end it: a stop token or string, ``max_tokens`` or the
        model's length? If so, mark it finished, saying why (its blocks are the caller's)."""
        token = seq.output_token_ids[-1]
        if token in self.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif self.stop_check is not None and (found := self.stop_check(seq)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", found
        elif len(seq.output_token_ids) >= self.params.max_tokens or (
            self.max_len is not None and len(seq) >= self.max_len
        ):
            seq.finish_reason = "length"
        return seq.is_finished


@dataclass
class SequenceOutput:
    """A token chosen for a child of ``parent``: the parent itself for its first child, a fork
    of it for any other (parallel sampling after the prompt, beam search)."""

    parent: Sequence
    token: int
    logprob: float
    top: dict[int, float] | None = None  # the top log-probabilities, if the request asks
    # speculative decoding: the proposals verified before ``token``, (token, logprob, top) each
    accepted: list[tuple[int, float, dict[int, float] | None]] = field(default_factory=list)


@dataclass
class GroupOutput:
    """What a step produced for one group: its children, and whether the group is done (beam
    search decides that as a whole; sampled sequences finish one by one); ``error``, if
    sampling it raised, fails this group alone."""

    group: SequenceGroup
    children: list[SequenceOutput]
    done: bool = False
    error: Exception | None = None
