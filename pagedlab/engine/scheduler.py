"""Continuous batching with preemption, over the paged KV cache (chapter 6).

The scheduler decides; it never touches a tensor. :meth:`Scheduler.schedule` forms one step's
batch and updates the :class:`~pagedlab.memory.KVCacheManager` to match; whoever runs the step
(the model runner, or the simulator's cost model) reports the sampled tokens to
:meth:`Scheduler.update`. The rules are the paper's (Kwon et al. 2023, section 4.5) with vLLM
V1's chunked prefill (rule 2; vllm/v1/core/sched/scheduler.py at v0.11.0), in the order of a
:class:`~pagedlab.engine.policy.Policy` (``SchedulerConfig.policy``; first come first served
unless another is given):

1. Running groups decode one token per sequence, in the policy's order. When the blocks run
   out, the policy's last running group (under FCFS the latest arrival) is preempted, all its
   sequences at once: by *recomputation* (its blocks freed, it goes back to the head of the
   waiting queue to prefill its prompt and outputs again) or by *swapping* (its blocks move
   to the CPU pool; a group still prefilling is recomputed).
2. With chunked prefill (the default, as V1) a step has one token budget,
   ``max_num_batched_tokens``: decodes take their token each first; the one running group
   whose prompt is partly prefilled takes its next chunk, as big as the budget and the free
   blocks allow; new requests are admitted with a first chunk cut to what is left. Only a
   chunk that ends its sequence's tokens samples. Blocks are allocated chunk by chunk, and
   prefix-cache hits are not computed. Without chunking (the paper's rule, V0's) a prompt
   is prefilled whole: one bigger than what is left waits, one bigger than the budget runs
   alone.
3. In a step that preempted nothing, swapped groups come back in the policy's order while
   the GPU has room for their blocks and next decode above the watermark, and the budget
   for their decodes.
4. While any group is swapped out, or in a step that preempted, nothing is admitted.
   Otherwise waiting groups (under FCFS preempted ones first: they arrived earlier) are
   admitted in the policy's order, the first that does not fit stopping the queue, while
   the budget lasts, their seats fit ``max_num_seqs`` and a watermark of blocks stays free
   (a policy that keeps ranking a request last can starve it; FCFS cannot).
5. A group recomputed after it forked (parallel samples, beams) computes its shared prompt
   once, unchunked: one sequence prefills the prompt's full blocks, the others fork them and
   prefill their own tokens (V0 refused to recompute such groups; V1 has none: each sample
   is a request of its own).
6. A request that can never run, the whole cache being too small for it, fails alone with a
   :class:`CacheTooSmall` error; its blocks are freed and the others go on.
7. With speculative decoding, once every running group has its token, decodes take the
   proposals stored on their sequences (``spec_token_ids``, drafted after the last step) while
   the budget and the free blocks last; :meth:`update` gives back the slots of the proposals
   verification rejected, so none outlives its step (chapter 12).

Every chunk starts at its sequence's ``num_computed_tokens``, and every block comes from one
question to the manager, :meth:`~pagedlab.memory.KVCacheManager.allocate_slots`: it takes
the blocks if they fit and answers None if not.

Within a step, preempting comes before appending to a group, and a step's copies run swap
first, then copy-on-write, then the forward pass.
"""

from __future__ import annotations

import time
from collections import deque

from pagedlab.engine.lifecycle import CacheTooSmall, RequestLifecycle, TooManySequences
from pagedlab.engine.policy import enqueue, ranked
from pagedlab.engine.scheduler_config import PREEMPTION_MODES, SchedulerConfig
from pagedlab.engine.sequence import GroupStatus, SequenceGroup
from pagedlab.engine.step import Chunk, Step

__all__ = ["PREEMPTION_MODES", "CacheTooSmall", "Scheduler", "SchedulerConfig",
           "TooManySequences"]


class Scheduler(RequestLifecycle):
    """Continuous batching with preemption, in the order of ``config.policy`` (FCFS by
    default); one instance per engine or simulation. The queues and a request's way in and
    out are :class:`~pagedlab.engine.lifecycle.RequestLifecycle`'s."""

    def schedule(self) -> Step:
        """Form the next step: decode the running, continue partial prefills, then swap in or
        admit as room allows.

        A step with nothing else to run admits even after a preemption; if the head of the
        queue cannot start even then, it never will: it fails, and the next one is tried.
        """
        step = Step()
        self._schedule_running(step)
        if not step.preempted:
            self._admit(step)
        self._fail_unrunnable(step)
        step.copies = self.manager.take_copies()
        step.stats = step.summary(self.num_steps, len(self.running), len(self.waiting),
                                  len(self.swapped), self.manager.num_used_blocks)
        self.num_steps += 1
        return step

    def _admit(self, step: Step) -> None:
        """Swapped groups back first; waiting ones only once none is left swapped (rule 4)."""
        self._schedule_swapped(step)
        if not self.swapped:
            self._schedule_waiting(step)

    def _fail_unrunnable(self, step: Step) -> None:
        """Rule 6, for a step with nothing to run (even after a preemption): admit again; a
        head of the queue that cannot start in an idle cache never will, so it fails and the
        next one is tried."""
        while step.is_empty and self.has_unfinished:
            self._admit(step)
            if step.is_empty:
                head = self.swapped[0] if self.swapped else self.waiting[0]
                self._fail(head, self._too_small(head, self._blocks_to_start(head)), step)

    def _fail(self, group: SequenceGroup, error: Exception, step: Step) -> None:
        """Rule 6: a request that can never run finishes with ``error``; the others go on."""
        self._end(group, "error", error)
        step.failed.append(group)

    # --- running groups: decode, or give way (rule 1) ----------------------------------------

    def _schedule_running(self, step: Step) -> None:
        """Decodes first, in the policy's order; then the proposals the decodes carry
        (chapter 12), then the next chunk of the group still prefilling (chapter 9)."""
        queue = deque(ranked(self.config.policy, self.running))  # first served first
        self.running, prefilling = [], []
        while queue:
            group = queue.popleft()
            if self._is_prefilling(group):
                prefilling.append(group)  # its next chunk comes after every decode
            else:
                self._decode_or_preempt(group, queue, bool(prefilling), step)
        self._take_proposals(step)
        for group in prefilling:
            self._prefill_next(group, step)

    def _decode_or_preempt(self, group: SequenceGroup, queue: deque, others: bool,
                           step: Step) -> None:
        """Decode ``group``, preempting the policy's last running group (FCFS: the latest
        arrival) until its blocks fit. With nobody after it left, it gives way itself if any
        group runs on (``others``: one set aside, still prefilling); alone in the cache and
        still unable to grow, it fails (rule 6)."""
        while not self._decode(group, step):
            if queue:
                self._preempt(queue.pop(), step)
            elif self.running or others:
                self._preempt(group, step)
                return
            else:
                need = self.manager.blocks_needed({s.seq_id: 1 for s in group.live})
                self._fail(group, self._too_small(group, need + self.manager.num_used_blocks),
                           step)
                return

    def _decode(self, group: SequenceGroup, step: Step) -> bool:
        """Store each live sequence's pending token, if its blocks fit (else False): its key
        and value come this step."""
        seqs = group.live
        if self.manager.allocate_slots({s.seq_id: [s.last_token_id] for s in seqs}) is None:
            return False
        step.decodes += [self._chunk(s, s.num_computed_tokens, 1) for s in seqs]
        group.status = GroupStatus.RUNNING
        self.running.append(group)
        step.groups.append(group)
        return True

    def _preempt(self, group: SequenceGroup, step: Step) -> None:
        """Evict a whole group: to the CPU pool when swapping, if it can go there; else to
        recompute from its first token."""
        if self.config.preemption_mode == "swap" and self._can_swap(group):
            mode, group.status = "swap", GroupStatus.SWAPPED
            step.swap_out += self.manager.swap_out(*(s.seq_id for s in group.live))
            enqueue(self.config.policy, self.swapped, group)
        else:
            mode, group.status = "recompute", GroupStatus.WAITING  # or the CPU pool is full
            for seq in group.live:
                self.manager.free(seq.seq_id)
                seq.num_computed_tokens = 0
            enqueue(self.config.policy, self.waiting, group)  # FCFS: before later arrivals
        step.preempted.append((group, mode))

    def _can_swap(self, group: SequenceGroup) -> bool:
        """Does the CPU pool hold the group, and is it past its prompt? (A prompt part-way
        through its chunks is recomputed: chapter 9.)"""
        return (not self._is_prefilling(group)
                and self.manager.can_swap_out(*(s.seq_id for s in group.live)))

    def _take_proposals(self, step: Step) -> None:
        """Give this step's decodes their proposals to verify, while the budget and the free
        blocks last: after every running group has its token, so speculation never preempts
        anyone. The proposals' slots are reserved now; :meth:`update` gives back those the
        verification rejects, and until then no block holding one enters the prefix cache."""
        left = self._budget_left(step)
        for i, chunk in enumerate(step.decodes):
            seq = chunk.seq
            k = min(len(seq.spec_token_ids), left, self.manager.room(seq.seq_id))
            draft, seq.spec_token_ids = seq.spec_token_ids[:k], []
            if draft:
                self.manager.allocate_slots({seq.seq_id: draft}, num_speculative=k)
                step.decodes[i] = self._chunk(seq, chunk.start, 1 + k, draft)
                step.num_draft_tokens += k
                left -= k

    def _prefill_next(self, group: SequenceGroup, step: Step) -> None:
        """The next chunk of a group still prefilling: as many of its tokens as the budget and
        the free blocks allow, or none this step (it keeps its blocks).

        It never has to evict anyone: at most one group is partly prefilled at a time
        (admission cuts only a step's last chunk, and a continuing chunk takes the budget
        before anyone is admitted), and its tokens fit the cache (a longer prompt is refused
        by :meth:`add_request`; a recomputed sequence held all but its last token in fewer
        blocks than the cache has).
        """
        (seq,) = group.live
        self.running.append(group)
        start = seq.num_computed_tokens
        n = min(seq.num_uncomputed_tokens, self._budget_left(step), self.manager.room(seq.seq_id))
        if n:
            self.manager.allocate_slots({seq.seq_id: seq.token_ids[start:start + n]})
            self._add(group, [self._chunk(seq, start, n)], step)

    # --- waiting and swapped groups: admission (rules 3 to 5) -------------------------------

    def _schedule_swapped(self, step: Step) -> None:
        """Bring swapped groups back in the policy's order while their blocks (and next
        decode) fit above the watermark and the budget holds their decodes."""
        while self.swapped:
            group = self.swapped[0]
            ids = [s.seq_id for s in group.live]
            if not self._has_seats(group) or len(ids) > self._budget_left(step):
                return
            pairs = self.manager.swap_in(*ids, keep_free=self.watermark_blocks)
            if pairs is None:
                return
            self.swapped.pop(0)
            step.swap_in += pairs
            step.swapped_in.append(group)
            self._decode(group, step)  # it fits: swap_in counted its decode's blocks

    def _schedule_waiting(self, step: Step) -> None:
        """Admit waiting groups in the policy's order while their first chunks fit; the first
        that does not fit stops the queue."""
        while self.waiting:
            group = self.waiting[0]
            chunks = self._has_seats(group) and self._start(group, step)
            if not chunks:
                return
            self.waiting.popleft()
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = time.monotonic()
            group.status = GroupStatus.RUNNING
            self.running.append(group)
            self._add(group, chunks, step)

    def _start(self, group: SequenceGroup, step: Step) -> list[Chunk] | None:
        """A waiting group's first chunk, its blocks taken above the watermark, or None if it
        does not fit: its prompt from the first token the prefix cache does not hold, as much
        of it as the budget allows (:meth:`_first_chunk`). A recomputed forked group: its
        shared prompt once (rule 5)."""
        if len(group.live) > 1:
            return self._start_forked(group, step)
        (seq,) = group.live
        start = self.manager.cached_prefix(seq.token_ids)
        n = self._first_chunk(len(seq) - start, step)
        if not n or self.manager.allocate_slots({seq.seq_id: seq.token_ids[:start + n]},
                                                keep_free=self.watermark_blocks,
                                                prompt_len=len(seq)) is None:
            return None
        return [self._chunk(seq, start, n)]

    def _first_chunk(self, n: int, step: Step) -> int:
        """How many of a prompt's ``n`` tokens to compute start in this step: with chunked
        prefill, what the budget leaves (chapter 9); without, all or none, unless the step is
        empty: a prompt bigger than the budget then runs alone."""
        budget = self._budget_left(step)
        if self.config.chunked_prefill:
            return min(n, budget)
        return n if n <= budget or step.is_empty else 0

    def _start_forked(self, group: SequenceGroup, step: Step) -> list[Chunk] | None:
        """A recomputed forked group (parallel samples, beams): one sequence computes the
        prompt's full blocks, the others fork them and compute their own tokens, unchunked."""
        seqs, shared = group.live, group.shared_prompt(self.manager.block_size)
        tokens = sum(map(len, seqs)) - (len(seqs) - 1) * shared
        if tokens > self._budget_left(step) and not step.is_empty:  # runs alone
            return None
        starts = self.manager.allocate_slots({s.seq_id: s.token_ids for s in seqs},
                                             keep_free=self.watermark_blocks, shared=shared)
        if starts is None:
            return None
        return [self._chunk(s, starts[s.seq_id], len(s) - starts[s.seq_id]) for s in seqs]

    # --- the step's chunks, and what is left of its budget ----------------------------------

    def _chunk(self, seq, start: int, num_tokens: int, draft: list[int] = ()) -> Chunk:
        """``num_tokens`` of ``seq``'s tokens from ``start``, their slots taken: the
        sequence's progress moves past them."""
        seq.num_computed_tokens = start + num_tokens
        return Chunk.of(self.manager, seq, start, num_tokens, draft)

    def _add(self, group: SequenceGroup, chunks: list[Chunk], step: Step) -> None:
        step.prefills += chunks
        step.groups.append(group)

    def _is_prefilling(self, group: SequenceGroup) -> bool:
        """Does a running group still lack more of its prompt than the pending token?"""
        return any(s.num_uncomputed_tokens > 1 for s in group.live)

    def _budget_left(self, step: Step) -> int:
        """Tokens the step can still take (none once a prefill too big for the budget ran)."""
        used = sum(c.num_tokens for c in step.prefills) + len(step.decodes) + step.num_draft_tokens
        return max(0, self.config.token_budget - used)

    def _has_seats(self, group: SequenceGroup) -> bool:
        """Would a waiting or swapped group's sequences fit under ``max_num_seqs``?"""
        seats = sum(g.max_seqs for g in self.running) + group.max_seqs
        return seats <= self.config.max_num_seqs

    def _blocks_to_start(self, group: SequenceGroup) -> int:
        """GPU blocks the head of a queue needs to run at all: a swapped group's return and
        decode; a waiting group's first chunk, or all its tokens unchunked (prefix hits
        ignored)."""
        if group.status is GroupStatus.SWAPPED:
            return self.manager.blocks_to_swap_in(*(s.seq_id for s in group.live))
        budget = self.config.token_budget if self.config.chunked_prefill else None
        first = {s.seq_id: len(s) if len(group.live) > 1 or budget is None
                 else min(len(s), budget) for s in group.live}
        return self.manager.blocks_needed(first, group.shared_prompt(self.manager.block_size))

    def _too_small(self, group: SequenceGroup, need: int) -> CacheTooSmall:
        m = self.manager
        return CacheTooSmall(
            f"request {group.request_id!r} needs {need} blocks of {m.block_size} tokens to go "
            f"on; the cache has {m.num_gpu_blocks}, of which admission keeps "
            f"{self.watermark_blocks} free: give it more blocks or fewer tokens"
        )
