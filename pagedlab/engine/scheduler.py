"""Continuous batching with preemption, over the paged KV cache (chapter 6).

The scheduler decides; it never touches a tensor. Each :meth:`Scheduler.schedule` forms one
step's batch and updates the :class:`~pagedlab.memory.KVCacheManager` to match; whoever runs
the step (the model runner, or the simulator's cost model) then reports the sampled tokens to
:meth:`Scheduler.update`. The rules are the paper's (Kwon et al. 2023, section 4.5), vLLM's;
the order of service is a :class:`~pagedlab.engine.policy.Policy`'s (``SchedulerConfig.policy``),
first come first served (:class:`~pagedlab.engine.policy.FCFS`) unless another is given:

1. Running groups decode one token per sequence, in the policy's order. When the blocks run
   out, the last running group in that order (under FCFS the latest arrival) is preempted,
   all of its sequences at once: by *recomputation* (its blocks are freed; it goes back to the
   head of the waiting queue to prefill its prompt and generated tokens again) or by
   *swapping* (its blocks move to the CPU pool).
2. In a step that preempted nothing, swapped groups come back in the policy's order while
   the GPU has room for their blocks and their next decode, above the watermark.
3. While any group is swapped out, or in a step that preempted, nothing is admitted.
   Otherwise waiting groups (under FCFS preempted ones first: they arrived earlier) are
   admitted in the policy's order, the first that does not fit stopping the queue, while
   their prefill fits the token budget ``max_num_batched_tokens``, their seats fit
   ``max_num_seqs``, and the GPU keeps a watermark of free blocks. A prefill bigger than the
   whole budget runs in a step of its own, so it is not stuck behind the budget (a policy
   that keeps ranking it last can still starve it; FCFS cannot).

Order within a step, as the manager requires: preempting comes before appending to a group,
and a step's copies run swap first, then copy-on-write, then the forward pass.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from pagedlab._checks import check_positive
from pagedlab.engine.beams import BeamSearchParams
from pagedlab.engine.policy import FCFS, Policy, enqueue, ranked
from pagedlab.engine.sequence import GroupOutput, GroupStatus, Sequence, SequenceGroup
from pagedlab.engine.stats import StepStats
from pagedlab.memory import KVCacheManager

PREEMPTION_MODES = ("recompute", "swap")


class CacheTooSmall(RuntimeError):
    """A request can never run: the whole cache is too small for it. Names the request."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits (vLLM's names and defaults) and its policy."""

    max_num_seqs: int = 256  # sequences decoding at once
    max_num_batched_tokens: int = 2048  # tokens in one forward pass
    preemption_mode: str = "recompute"  # or "swap"
    watermark: float = 0.01  # fraction of GPU blocks admission leaves free
    policy: Policy = FCFS()  # the order of admission, decode, preemption and swap-in

    def __post_init__(self):
        check_positive("max_num_seqs", self.max_num_seqs, integer=True)
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens, integer=True)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least "
                f"max_num_seqs={self.max_num_seqs}: each running sequence decodes a token a step"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r} must be one of {PREEMPTION_MODES}"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark={self.watermark!r} must be in [0, 1)")
        if not isinstance(self.policy, Policy):
            raise TypeError(
                f"policy={self.policy!r} must be an instance of a pagedlab.engine.Policy "
                "subclass, such as FCFS() (an instance, not the class)"
            )


@dataclass
class Step:
    """One step's batch and the block copies to make before its forward pass."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, cached tokens)
    decodes: list[Sequence] = field(default_factory=list)
    groups: list[SequenceGroup] = field(default_factory=list)  # every group in the batch
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[tuple[SequenceGroup, str]] = field(default_factory=list)  # (group, mode)
    swapped_in: list[SequenceGroup] = field(default_factory=list)
    stats: StepStats | None = None

    @property
    def seqs(self) -> list[Sequence]:
        """The batch's sequences in the order of its logits: prefills, then decodes."""
        return [seq for seq, _ in self.prefills] + self.decodes

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Continuous batching with preemption, in the order of ``config.policy`` (FCFS by
    default); one instance per engine or simulation."""

    def __init__(self, manager: KVCacheManager, config: SchedulerConfig | None = None):
        self.manager = manager
        self.config = config or SchedulerConfig()
        self.watermark_blocks = int(self.config.watermark * manager.num_gpu_blocks)
        self.waiting: deque[SequenceGroup] = deque()  # waiting and swapped: in policy order
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_steps = 0
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    # --- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params,
        stop_token_ids=(),
        generators=(),
        priority: int = 0,
    ) -> SequenceGroup:
        """Queue a request; raise :class:`CacheTooSmall` if its prompt can never be admitted.

        ``params`` is a SamplingParams or BeamSearchParams; ``generators`` the random stream
        of each parallel sample (None entries: the global one); ``priority`` the request's
        urgency, smaller first, which only a :class:`~pagedlab.engine.policy.Priority` policy
        (or one of your own) reads.
        """
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if params.width > self.config.max_num_seqs:
            raise ValueError(
                f"request {request_id!r} runs {params.width} sequences at once, more than "
                f"max_num_seqs={self.config.max_num_seqs}"
            )
        bs = self.manager.block_size
        capacity = self.manager.num_gpu_blocks - self.watermark_blocks
        if -(-len(prompt) // bs) > capacity:
            raise CacheTooSmall(
                f"request {request_id!r}: its prompt of {len(prompt)} tokens needs "
                f"{-(-len(prompt) // bs)} blocks of {bs} tokens, but admission can use at most "
                f"{capacity} ({self.manager.num_gpu_blocks} blocks, {self.watermark_blocks} kept "
                "free as the watermark)"
            )
        group = SequenceGroup(
            request_id,
            next(self._arrivals),
            prompt,
            [Sequence(next(self._seq_ids), prompt)],
            params,
            is_beam_search=isinstance(params, BeamSearchParams),
            priority=priority,
            stop_token_ids=frozenset(stop_token_ids),
            generators=list(generators) or [None] * params.width,
        )
        enqueue(self.config.policy, self.waiting, group)
        return group

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort_all(self) -> None:
        """Drop every unfinished request, its blocks and any copies pending (after an error)."""
        for group in (*self.running, *self.swapped, *self.waiting):
            for seq in group.live:
                if group.status is not GroupStatus.WAITING:
                    self.manager.free(seq.seq_id)
                seq.finish_reason = "abort"
            group.status = GroupStatus.FINISHED
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.manager.take_copies()

    # --- forming a step ---------------------------------------------------------------------

    def schedule(self) -> Step:
        """Form the next step: decode the running, then swap in or admit as room allows."""
        step = Step()
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_swapped(step)
            if not self.swapped:
                self._schedule_waiting(step)
        if step.is_empty and self.has_unfinished:  # nothing runs, and the head cannot start
            head = self.swapped[0] if self.swapped else self.waiting[0]
            raise self._too_small(head, self._blocks_to_resume(head))
        step.copies = self.manager.take_copies()
        step.stats = self._step_stats(step)
        self.num_steps += 1
        return step

    def _schedule_running(self, step: Step) -> None:
        queue = deque(ranked(self.config.policy, self.running))  # first served first
        self.running = []
        while queue:
            group = queue.popleft()
            need = self._blocks_to_decode(group)
            while need > self.manager.num_free_blocks and queue:
                self._preempt(queue.pop(), step)  # the policy's last (FCFS: latest) gives way
            if need <= self.manager.num_free_blocks:
                self._decode(group, step)
            elif self.running:
                self._preempt(group, step)  # it is itself the policy's last left
            else:  # alone in the cache and still it cannot grow
                self.running.append(group)  # it holds blocks: abort_all must find it
                raise self._too_small(group, need + self.manager.num_used_blocks)

    def _schedule_swapped(self, step: Step) -> None:
        while self.swapped:
            group = self.swapped[0]
            if not self._can_resume(group):
                return
            self.swapped.pop(0)
            step.swap_in += self.manager.swap_in(*(s.seq_id for s in group.live))
            step.swapped_in.append(group)
            self._decode(group, step)

    def _schedule_waiting(self, step: Step) -> None:
        budget = self.config.max_num_batched_tokens - len(step.decodes)
        while self.waiting:
            group = self.waiting[0]
            tokens = sum(len(s) for s in group.live)  # the prompt, or prompt + outputs again
            if not self._can_resume(group):
                return
            if tokens > budget and not step.is_empty:  # too big for the budget: runs alone
                return
            self.waiting.popleft()
            for seq in group.live:
                cached = self.manager.allocate(seq.seq_id, seq.token_ids)
                step.prefills.append((seq, cached))
            budget -= tokens
            group.status = GroupStatus.RUNNING
            self.running.append(group)
            step.groups.append(group)

    def _decode(self, group: SequenceGroup, step: Step) -> None:
        """Store each live sequence's pending token; its key and value come this step."""
        for seq in group.live:
            self.manager.append(seq.seq_id, seq.output_token_ids[-1:])
            step.decodes.append(seq)
        group.status = GroupStatus.RUNNING
        self.running.append(group)
        step.groups.append(group)

    def _preempt(self, group: SequenceGroup, step: Step) -> None:
        """Evict a whole group: to the CPU pool if swapping (and it fits), else to recompute."""
        ids = [s.seq_id for s in group.live]
        mode = self.config.preemption_mode
        if mode == "swap" and self.manager.can_swap_out(*ids):
            decode_need = self._blocks_to_decode(group)  # the same once it is back
            pairs = self.manager.swap_out(*ids)
            step.swap_out += pairs
            group.blocks_to_swap_in = len(pairs) + decode_need
            group.status = GroupStatus.SWAPPED
            enqueue(self.config.policy, self.swapped, group)
        else:
            mode = "recompute"  # also the fallback when the CPU pool is full
            for seq_id in ids:
                self.manager.free(seq_id)
            group.status = GroupStatus.WAITING
            enqueue(self.config.policy, self.waiting, group)  # FCFS: before later arrivals
        step.preempted.append((group, mode))

    # --- block and seat arithmetic ----------------------------------------------------------

    def _blocks_to_decode(self, group: SequenceGroup) -> int:
        """GPU blocks that appending one token to each live sequence takes, exactly: a fresh
        block after a full last block; a copy of a shared, partly filled last block, except
        for the last of its sharers to append, who finds it unshared by then."""
        bs, need, sharers = self.manager.block_size, 0, {}
        for seq in group.live:
            if self.manager.num_tokens(seq.seq_id) % bs == 0:
                need += 1
            else:
                last = self.manager.block_table(seq.seq_id)[-1]
                sharers[last] = sharers.get(last, 0) + 1
        for block, count in sharers.items():
            need += count - (self.manager.gpu.refcount(block) == count)
        return need

    def _blocks_to_resume(self, group: SequenceGroup) -> int:
        """GPU blocks a waiting group's prefills (prefix hits ignored) or a swapped group's
        return and next decode take."""
        if group.status is GroupStatus.SWAPPED:
            return group.blocks_to_swap_in
        bs = self.manager.block_size
        return sum(-(-len(seq) // bs) for seq in group.live)

    def _can_resume(self, group: SequenceGroup) -> bool:
        """Would a waiting or swapped group fit now: its blocks above the watermark, its seats
        under ``max_num_seqs``?"""
        room = self.manager.num_free_blocks - self.watermark_blocks
        seats = sum(g.max_seqs for g in self.running) + group.max_seqs
        return self._blocks_to_resume(group) <= room and seats <= self.config.max_num_seqs

    def _too_small(self, group: SequenceGroup, need: int) -> CacheTooSmall:
        m = self.manager
        return CacheTooSmall(
            f"request {group.request_id!r} needs {need} blocks of {m.block_size} tokens to go "
            f"on, more than the cache's {m.num_gpu_blocks} (watermark {self.watermark_blocks}): "
            "give it more blocks or fewer tokens"
        )

    def _step_stats(self, step: Step) -> StepStats:
        return StepStats(
            step=self.num_steps,
            prefill_seqs=len(step.prefills),
            prefill_tokens=sum(len(seq) - cached for seq, cached in step.prefills),
            decode_seqs=len(step.decodes),
            running=len(self.running),
            waiting=len(self.waiting),
            swapped=len(self.swapped),
            used_blocks=self.manager.num_used_blocks,
            preempted=tuple((g.request_id, mode) for g, mode in step.preempted),
            swapped_in=tuple(g.request_id for g in step.swapped_in),
            blocks_swapped_out=len(step.swap_out),
            blocks_swapped_in=len(step.swap_in),
            blocks_copied=len(step.copies),
        )

    # --- after the step ---------------------------------------------------------------------

    def update(self, outputs: list[GroupOutput]) -> list[SequenceGroup]:
        """Apply a step's sampled tokens: fork, prune, stop, free. Return the groups finished."""
        finished = []
        for out in outputs:
            group = out.group
            if out.done:  # beam search over: the finished beams are in group.completed
                for seq in group.live:
                    self.manager.free(seq.seq_id)
                group.seqs = []
            else:
                self._apply(group, out.children)
            if not group.live:
                group.status = GroupStatus.FINISHED
                self.running.remove(group)
                finished.append(group)
        return finished

    def _apply(self, group: SequenceGroup, children) -> None:
        """Give each child a sequence: its parent for the first child, a fork for the others.

        Forks first, so that a fork copies its parent before the parent takes its new token;
        live sequences left without a child (pruned beams) are freed.
        """
        kept, plan, num_forks = set(), [], 0
        for child in children:
            parent = child.parent
            if parent.seq_id in kept:
                seq = parent.fork(next(self._seq_ids), index=len(group.seqs) + num_forks)
                self.manager.fork(parent.seq_id, seq.seq_id)
                num_forks += 1
            else:
                seq = parent
                kept.add(parent.seq_id)
            plan.append((seq, child))
        for seq in group.live:
            if seq.seq_id not in kept:
                self.manager.free(seq.seq_id)
        group.seqs = [s for s in group.seqs if s.is_finished] + [seq for seq, _ in plan]
        for seq, child in plan:
            seq.append(child.token, child.logprob)
            if not group.is_beam_search:
                self._check_stop(group, seq)

    def _check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        """Finish a sampled sequence at a stop token or at ``max_tokens``; free its blocks."""
        if seq.output_token_ids[-1] in group.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= group.params.max_tokens:
            seq.finish_reason = "length"
        else:
            return
        self.manager.free(seq.seq_id)
