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
4. A group preempted by recomputation after it forked (parallel samples, beams) computes its
   shared prompt once when it comes back: one sequence prefills the prompt's full blocks, the
   others fork them and prefill only their own tokens (vLLM V0 refused to recompute such
   groups and required swapping).
5. A request that can never run, because the whole cache is too small for it, fails alone:
   it finishes with a :class:`CacheTooSmall` error of its own and its blocks are freed; the
   other requests go on.

Order within a step, as the manager requires: preempting comes before appending to a group,
and a step's copies run swap first, then copy-on-write, then the forward pass.
"""

from __future__ import annotations

import itertools
import time
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


class TooManySequences(ValueError):
    """A request runs more sequences at once (``n``, ``beam_width``) than ``max_num_seqs``."""


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
    failed: list[SequenceGroup] = field(default_factory=list)  # can never run: finished
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
        self.waiting: deque[SequenceGroup] = deque()  # waiting and swapped: in policy order
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.unfinished: dict[str, SequenceGroup] = {}  # by request id, whatever their queue
        self.num_steps = 0
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    @property
    def watermark_blocks(self) -> int:
        """GPU blocks admission leaves free (the cache may grow, so this follows it)."""
        return int(self.config.watermark * self.manager.num_gpu_blocks)

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
            raise TooManySequences(
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
        if request_id in self.unfinished:
            raise ValueError(f"request {request_id!r} is already running; ids must be unique")
        enqueue(self.config.policy, self.waiting, group)
        self.unfinished[request_id] = group
        return group

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort_all(self) -> None:
        """Drop every unfinished request, its blocks and any copies pending (after an error,
        which may have struck between taking a group off its queue and putting it back)."""
        for group in list(self.unfinished.values()):
            self._finish(group, "abort")
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.manager.take_copies()

    def abort(self, group: SequenceGroup) -> None:
        """Drop one unfinished request and free its blocks (vLLM's ``abort_request``)."""
        self._remove(group)
        self._finish(group, "abort")

    def _finish(self, group: SequenceGroup, reason: str) -> None:
        """End every live sequence of a group taken off its queue, freeing what it holds."""
        for seq in group.live:
            if seq.seq_id in self.manager:
                self.manager.free(seq.seq_id)
            seq.finish_reason = reason
        self._finished(group)

    def _finished(self, group: SequenceGroup) -> None:
        group.status = GroupStatus.FINISHED
        group.metrics.finished_time = time.monotonic()
        self.unfinished.pop(group.request_id, None)

    def _remove(self, group: SequenceGroup) -> None:
        queue = {GroupStatus.RUNNING: self.running, GroupStatus.SWAPPED: self.swapped,
                 GroupStatus.WAITING: self.waiting}.get(group.status)
        if queue is None:
            raise ValueError(f"request {group.request_id!r} has already finished")
        queue.remove(group)

    def _fail(self, group: SequenceGroup, error: Exception, step: Step) -> None:
        """Finish a request that can never run with ``error``; the others go on."""
        self._remove(group)
        self._finish(group, "error")
        group.error = error
        step.failed.append(group)

    # --- forming a step ---------------------------------------------------------------------

    def schedule(self) -> Step:
        """Form the next step: decode the running, then swap in or admit as room allows.

        A step with nothing else to run admits even after a preemption; if the head of the
        queue cannot start even then, it never will: it fails, and the next one is tried.
        """
        step = Step()
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_swapped(step)
            if not self.swapped:
                self._schedule_waiting(step)
        while step.is_empty and self.has_unfinished:  # nothing runs
            self._schedule_swapped(step)
            if not self.swapped:
                self._schedule_waiting(step)
            if step.is_empty:  # and the head cannot start in an idle cache
                head = self.swapped[0] if self.swapped else self.waiting[0]
                self._fail(head, self._too_small(head, self._blocks_to_resume(head)), step)
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
                self.running.append(group)
                self._fail(group, self._too_small(group, need + self.manager.num_used_blocks),
                           step)

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
            # the prompt, or prompt + outputs again (a shared prompt counted once)
            tokens = sum(map(len, group.live)) - (len(group.live) - 1) * self._shared_prompt(group)
            if not self._can_resume(group):
                return
            if tokens > budget and not step.is_empty:  # too big for the budget: runs alone
                return
            self.waiting.popleft()
            prefills = self._allocate(group)
            step.prefills += prefills
            budget -= sum(len(seq) - cached for seq, cached in prefills)
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = time.monotonic()
            group.status = GroupStatus.RUNNING
            self.running.append(group)
            step.groups.append(group)

    def _allocate(self, group: SequenceGroup) -> list[tuple[Sequence, int]]:
        """Blocks for a waiting group's prefill: each sequence, with its tokens already cached.

        Forked sequences share their prompt's full blocks: the first computes them, the others
        fork it before anyone appends, and then compute only what follows (the prompt's partial
        last block and their own outputs, re-computed by each).
        """
        seqs, shared = group.live, self._shared_prompt(group)
        if not shared:
            return [(seq, self.manager.allocate(seq.seq_id, seq.token_ids)) for seq in seqs]
        first = seqs[0]
        hits = self.manager.allocate(first.seq_id, group.prompt_token_ids[:shared])
        for seq in seqs[1:]:
            self.manager.fork(first.seq_id, seq.seq_id)
        for seq in seqs:
            self.manager.append(seq.seq_id, seq.token_ids[shared:])
        return [(first, hits)] + [(seq, shared) for seq in seqs[1:]]

    def _shared_prompt(self, group: SequenceGroup) -> int:
        """Prompt tokens in full blocks that a waiting group's live sequences will share
        (0 if only one sequence is left, or the prompt fills no block)."""
        if len(group.live) < 2:
            return 0
        bs = self.manager.block_size
        return len(group.prompt_token_ids) // bs * bs

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
        bs, shared = self.manager.block_size, self._shared_prompt(group)
        return shared // bs + sum(-(-(len(seq) - shared) // bs) for seq in group.live)

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
        """Apply a step's sampled tokens: fork, prune, stop, free. Return the groups finished.

        The step has run, so its keys and values are in the cache: the blocks it filled may
        serve prefix hits from now on (see :meth:`KVCacheManager.rollback` for a step that
        failed instead).
        """
        self.manager.commit()
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
                self.running.remove(group)
                self._finished(group)
                finished.append(group)
        return finished

    def _apply(self, group: SequenceGroup, children) -> None:
        """Give each child a sequence: its parent for the first child, a fork for the others.

        Forks first, so that a fork copies its parent before the parent takes its new token;
        live sequences left without a child (pruned beams) are freed.
        """
        kept, plan = set(), []
        for child in children:
            parent = child.parent
            if parent.seq_id in kept:
                seq = parent.fork(next(self._seq_ids), index=len(group.seqs))
                self.manager.fork(parent.seq_id, seq.seq_id)
                group.seqs.append(seq)  # at once: an abort must find every sequence
                kept.add(seq.seq_id)
            else:
                seq = parent
                kept.add(parent.seq_id)
            plan.append((seq, child))
        for seq in group.live:
            if seq.seq_id not in kept:
                self.manager.free(seq.seq_id)
        group.seqs = [s for s in group.seqs if s.is_finished] + [seq for seq, _ in plan]
        if plan and group.metrics.first_token_time is None:
            group.metrics.first_token_time = time.monotonic()
        for seq, child in plan:
            seq.append(child.token, child.logprob, child.top)
            if not group.is_beam_search:
                self._check_stop(group, seq)

    def _check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        """Finish a sampled sequence at a stop token or string, at ``max_tokens`` or at the
        model's length; free its blocks."""
        token = seq.output_token_ids[-1]
        if token in group.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif group.stop_check is not None and (found := group.stop_check(seq)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", found
        elif len(seq.output_token_ids) >= group.params.max_tokens or (
            group.max_len is not None and len(seq) >= group.max_len
        ):
            seq.finish_reason = "length"
        else:
            return
        self.manager.free(seq.seq_id)
