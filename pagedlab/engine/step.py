"""What one engine step is, whoever carries it out (chapters 6, 8, 9 and 10).

The scheduler decides a :class:`Step`: its :class:`Chunk` s (each sequence's query tokens,
their positions, cache slots and block table) and the block copies to make first. An executor
carries it out and returns a :class:`StepOutput`: the model runner runs the model and samples
(as vLLM's ``ModelRunnerOutput`` carries sampled tokens), the simulator's executor prices the
step with a cost model and samples placeholders. :func:`run_step` is the loop body the engine
and the simulator share: schedule, execute, apply (and, with speculative decoding, draft the
next step's proposals).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from pagedlab.engine.sequence import GroupOutput, Sequence, SequenceGroup, SequenceOutput
from pagedlab.engine.stats import StepStats
from pagedlab.memory import KVCacheManager


@dataclass
class Chunk:
    """One sequence's work in a step: ``num_tokens`` query tokens from position ``start``.

    Everything an executor needs, so that neither the model runner nor the simulator asks
    the manager: the tokens' cache slots, the block table they attend through and how many
    keys they see. A decode is a chunk of one token; a prefill chunk follows ``start``
    tokens already cached (earlier chunks, prefix-cache hits).
    """

    seq: Sequence
    start: int  # tokens already in the cache: the first query token's position
    num_tokens: int  # query tokens this step (1 for a decode)
    block_table: list[int]  # the sequence's GPU blocks, this step's included
    slots: list[int]  # cache slot of each query token: where its key and value go
    is_sampled: bool  # does it reach the sequence's last token, whose logits pick the next?
    draft: list[int] = field(default_factory=list)  # proposals after a decode's token

    @classmethod
    def of(cls, manager: KVCacheManager, seq: Sequence, start: int, num_tokens: int,
           draft: list[int] = ()) -> Chunk:
        """``num_tokens`` tokens of ``seq`` from ``start`` (its last ``len(draft)`` the
        proposals ``draft``, whose logits verify them), once ``manager`` holds them."""
        slots = manager.slot_mapping(seq.seq_id, start, start + num_tokens)
        return cls(seq, start, num_tokens, manager.block_table(seq.seq_id), slots,
                   start + num_tokens - len(draft) == len(seq), list(draft))

    @property
    def context_len(self) -> int:
        """Keys the last query token attends to: the cached ones and the chunk's."""
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        if self.draft:  # a speculative decode: the pending token, then the proposals
            return [self.seq.token_ids[self.start], *self.draft]
        return self.seq.token_ids[self.start : self.context_len]


@dataclass
class Step:
    """One step's batch and the block copies to make before its forward pass."""

    prefills: list[Chunk] = field(default_factory=list)  # prompt chunks, whole or partial
    decodes: list[Chunk] = field(default_factory=list)  # one token per running sequence
    groups: list[SequenceGroup] = field(default_factory=list)  # every group in the batch
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[tuple[SequenceGroup, str]] = field(default_factory=list)  # (group, mode)
    swapped_in: list[SequenceGroup] = field(default_factory=list)
    failed: list[SequenceGroup] = field(default_factory=list)  # can never run: finished
    num_draft_tokens: int = 0  # proposals the decodes carry (speculative decoding)
    stats: StepStats | None = None

    @property
    def chunks(self) -> list[Chunk]:
        """The batch's rows in order: prefill chunks, then decodes."""
        return self.prefills + self.decodes

    @property
    def multi_token(self) -> list[Chunk]:
        """Chunks of several query tokens, attended like prompts (causal within the chunk):
        prefill chunks, then speculative decodes (the pending token and its proposals)."""
        verifies = [c for c in self.decodes if c.draft]
        return self.prefills + verifies if verifies else self.prefills

    @property
    def single_token(self) -> list[Chunk]:
        """One-token decodes: the decode kernel's batch."""
        return [c for c in self.decodes if not c.draft] if self.num_draft_tokens else self.decodes

    @property
    def sampled_groups(self) -> list[SequenceGroup]:
        """The groups that sample this step: all but one whose prompt chunk stops short."""
        short = [c.seq for c in self.prefills if not c.is_sampled]
        if not short:
            return self.groups
        return [g for g in self.groups if not any(s in short for s in g.seqs)]

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    def summary(self, number: int, running: int, waiting: int, swapped: int,
                used_blocks: int) -> StepStats:
        """The step's :class:`StepStats`, given its number and the queues and cache after it
        was formed."""
        return StepStats(
            step=number,
            prefill_seqs=len(self.prefills),
            prefill_tokens=sum(c.num_tokens for c in self.prefills),
            decode_seqs=len(self.decodes),
            kv_tokens_read=kv_tokens_read([c.start for c in self.multi_token],
                                          [c.context_len for c in self.single_token]),
            running=running,
            waiting=waiting,
            swapped=swapped,
            used_blocks=used_blocks,
            preempted=tuple((g.request_id, mode) for g, mode in self.preempted),
            swapped_in=tuple(g.request_id for g in self.swapped_in),
            blocks_swapped_out=len(self.swap_out),
            blocks_swapped_in=len(self.swap_in),
            blocks_copied=len(self.copies),
            draft_tokens=self.num_draft_tokens,
        )


def kv_tokens_read(prefill_starts: Iterable[int], decode_lens: Iterable[int]) -> int:
    """Cached keys a step's attention reads, for its :class:`StepStats` and the cost fit alike.

    A chunk of several query tokens (a prefill chunk, or a speculative decode: the pending
    token and its proposals, shaped like one) reads the ``start`` tokens cached before it
    (``prefill_starts``) and attends to its own keys within the chunk, as a prompt does; a
    one-token decode reads its whole context, its new token included (``decode_lens``).
    """
    return sum(prefill_starts) + sum(decode_lens)


class StepOutput(NamedTuple):
    """What executing a step produced: each sampled group's children, for
    :meth:`~pagedlab.engine.scheduler.Scheduler.update`; from a simulator also the seconds the
    forward pass and the block swaps would take (a real run is timed by a clock instead)."""

    outputs: list[GroupOutput]
    seconds: float = 0.0
    swap_seconds: float = 0.0


class Executor(Protocol):
    """Carries out a step: the model runner, or the simulator's cost model."""

    def execute(self, step: Step) -> StepOutput: ...


def run_step(scheduler, executor: Executor, observe: Callable[[Step, StepOutput], None] | None
             = None, drafter=None) -> tuple[Step, StepOutput, list[SequenceGroup]]:
    """One step of the serving loop: the scheduler forms a batch, the executor runs it, the
    scheduler applies its outputs (fork, prune, verify, stop, free); a ``drafter``
    (:class:`~pagedlab.engine.speculative.Drafter`, speculative decoding) then proposes the
    next step's guesses. ``observe(step, output)``, if given, sees the step once it ran,
    before its outputs change the queues and the cache. Returns the step, what it produced
    and the groups that finished."""
    step = scheduler.schedule()
    ran = executor.execute(step)
    if observe is not None:
        observe(step, ran)
    finished = scheduler.update(ran.outputs)
    if drafter is not None:
        drafter(scheduler.running)
    return step, ran, finished


class Placeholders:
    """An executor without a model: every sequence samples ``token`` (a prompt with parallel
    samples starts all ``n`` of them), which is all a scheduler needs to be driven alone."""

    def __init__(self, token: int = 0):
        self.token = token

    def outputs(self, step: Step) -> list[GroupOutput]:
        """The children of every group the step samples."""
        outputs, token = [], self.token
        for group in step.sampled_groups:
            if group.is_beam_search:
                raise ValueError(f"request {group.request_id!r}: placeholder tokens cannot "
                                 "rank beams")
            if group.params.n == 1:  # the common case, kept fast: one sequence, one token
                children = [SequenceOutput(group.seqs[0], token, 0.0)]
            elif group.has_output:
                children = [SequenceOutput(s, token, 0.0) for s in group.live]
            else:  # the prompt's step starts all n samples from the one sequence
                children = [SequenceOutput(group.seqs[0], token, 0.0)] * group.params.n
            outputs.append(GroupOutput(group, children))
        return outputs

    def execute(self, step: Step) -> StepOutput:
        return StepOutput(self.outputs(step))


def drive(scheduler, executor: Executor | None = None) -> list[Step]:
    """Run ``scheduler`` until no request is left (with :class:`Placeholders` by default);
    return its steps."""
    executor = executor or Placeholders()
    steps = []
    while scheduler.has_unfinished:
        steps.append(run_step(scheduler, executor)[0])
    return steps
