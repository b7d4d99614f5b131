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
7. With speculative decoding (``speculative_config``), once every running group has its
   token, decodes take proposals while the budget and the free blocks last; :meth:`update`
   truncates each sequence to what verification accepted, so no proposal outlives its step
   (chapter 12).

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
                self._fail(head, self._too_small(head, self._blocks_to_resume(head)), step)

    def _fail(self, group: SequenceGroup, error: Exception, step: Step) -> None:
        """Rule 6: a request that can never run finishes with ``error``; the others go on."""
        self._end(group, "error", error)
        step.failed.append(group)

    def _schedule_running(self, step: Step) -> None:
        """Decodes first, in the policy's order, preempting from the order's end when the
        blocks run out; then the next chunk of each group still prefilling."""
        queue = deque(ranked(self.config.policy, self.running))  # first served first
        prefilling = []  # in the policy's order, for after decodes
        self.running = []
        while queue:
            group = queue.popleft()
            if self._prefilling(group):
                prefilling.append(group)
                continue
            need = self.manager.blocks_to_append([s.seq_id for s in group.live])
            while need > self.manager.num_free_blocks and queue:
                self._preempt(queue.pop(), step)  # the policy's last (FCFS: latest) gives way
            if need <= self.manager.num_free_blocks:
                self._decode(group, step)
            elif self.running or prefilling:
                self._preempt(group, step)  # it is itself the policy's last left
            else:  # alone in the cache and still it cannot grow
                self._fail(group, self._too_small(group, need + self.manager.num_used_blocks),
                           step)
        if self.proposer is not None:
            self._speculate(step)
        for group in prefilling:
            self._prefill_next(group, step)

    def _speculate(self, step: Step) -> None:
        """Give this step's decodes proposals to verify, while the budget and the free blocks
        last: after every running group has its token, so speculation never preempts anyone.
        The proposals' slots are reserved now and given back by :meth:`update` for those the
        verification rejects; until then no block holding one enters the prefix cache."""
        k_max, left = self.config.speculative_config.num_speculative_tokens, self._budget_left(step)
        index = {c.seq.seq_id: i for i, c in enumerate(step.decodes)}
        self.proposer.start_step([s for g in step.groups if not g.is_beam_search for s in g.live])
        for group in step.groups:
            if group.is_beam_search:
                continue
            for seq in group.live:
                k = min(k_max, left, self.manager.room(seq.seq_id),
                        group.params.max_tokens - len(seq.output_token_ids) - 1,  # the bonus
                        k_max if group.max_len is None else group.max_len - len(seq) - 1)
                draft = self.proposer.propose(seq.token_ids, k, seq.seq_id) if k > 0 else []
                if draft:
                    self.manager.append(seq.seq_id, draft, num_speculative=len(draft))
                    step.decodes[index[seq.seq_id]] = Chunk.of(
                        self.manager, seq, len(seq) - 1, 1 + len(draft), draft)
                    step.num_draft_tokens += len(draft)
                    left -= len(draft)

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
        start = self.manager.num_tokens(seq.seq_id)
        n = min(len(seq) - start, self._budget_left(step), self.manager.room(seq.seq_id))
        if n:
            self.manager.append(seq.seq_id, seq.token_ids[start : start + n])
            self._add_prefill(group, [Chunk.of(self.manager, seq, start, n)], step)

    def _schedule_swapped(self, step: Step) -> None:
        while self.swapped:
            group = self.swapped[0]
            if (not self._can_resume(group, group.blocks_to_swap_in)
                    or len(group.live) > self._budget_left(step)):  # its decodes' tokens
                return
            self.swapped.pop(0)
            step.swap_in += self.manager.swap_in(*(s.seq_id for s in group.live))
            step.swapped_in.append(group)
            self._decode(group, step)

    def _schedule_waiting(self, step: Step) -> None:
        """Admit waiting groups while they fit: with chunked prefill each starts with a chunk
        of what is left of the budget; without, a prompt must fit whole (or run alone)."""
        chunked = self.config.chunked_prefill
        while self.waiting:
            group = self.waiting[0]
            budget = self._budget_left(step)
            if len(group.live) > 1:  # a forked group recomputed: its prompt once, unchunked
                shared = group.shared_prompt(self.manager.block_size)
                tokens = sum(map(len, group.live)) - (len(group.live) - 1) * shared
                if not self._can_resume(group, self._blocks_to_resume(group)):
                    return
                if tokens > budget and not step.is_empty:  # too big for the budget: runs alone
                    return
                self.waiting.popleft()
                chunks = self._allocate(group)
            else:
                (seq,) = group.live
                hits = self.manager.cached_prefix(seq.token_ids)
                n = len(seq) - hits
                if chunked:
                    n = min(n, budget)
                elif n > budget and not step.is_empty:  # too big for the budget: runs alone
                    return
                if not n or not self._can_resume(group, self.manager.blocks_for(hits + n)):
                    return
                self.waiting.popleft()
                self.manager.allocate(seq.seq_id, seq.token_ids[: hits + n], prompt_len=len(seq))
                chunks = [Chunk.of(self.manager, seq, hits, n)]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = time.monotonic()
            group.status = GroupStatus.RUNNING
            self.running.append(group)
            self._add_prefill(group, chunks, step)

    def _add_prefill(self, group: SequenceGroup, chunks: list[Chunk], step: Step) -> None:
        step.prefills += chunks
        step.groups.append(group)
        if not chunks[-1].is_sampled:
            step.partial.append(group)

    def _allocate(self, group: SequenceGroup) -> list[Chunk]:
        """Blocks for a recomputed forked group's prefill (its prompt's full blocks computed
        once, then shared), and each sequence's chunk."""
        seqs = group.live
        starts = self.manager.allocate_shared([s.seq_id for s in seqs],
                                              [s.token_ids for s in seqs],
                                              group.shared_prompt(self.manager.block_size))
        return [Chunk.of(self.manager, s, start, len(s) - start) for s, start in zip(seqs, starts)]

    def _decode(self, group: SequenceGroup, step: Step) -> None:
        """Store each live sequence's pending token; its key and value come this step."""
        for seq in group.live:
            self.manager.append(seq.seq_id, [seq.last_token_id])
            step.decodes.append(Chunk.of(self.manager, seq, len(seq) - 1, 1))
        group.status = GroupStatus.RUNNING
        self.running.append(group)
        step.groups.append(group)

    def _preempt(self, group: SequenceGroup, step: Step) -> None:
        """Evict a whole group: to the CPU pool if swapping (and it fits, and it is past its
        prefill), else to recompute."""
        ids = [s.seq_id for s in group.live]
        mode = self.config.preemption_mode
        if mode == "swap" and not self._prefilling(group) and self.manager.can_swap_out(*ids):
            decode_need = self.manager.blocks_to_append(ids)  # the same once it is back
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
        if self.proposer is not None:  # a draft's cache is neither swapped nor kept
            for seq_id in ids:
                self.proposer.free(seq_id)
        step.preempted.append((group, mode))

    # --- block, token and seat arithmetic ---------------------------------------------------

    def _prefilling(self, group: SequenceGroup) -> bool:
        """Is a running group still short of its prompt (more than one token not cached)?"""
        seqs = group.live
        return len(seqs) == 1 and self.manager.num_tokens(seqs[0].seq_id) < len(seqs[0]) - 1

    def _budget_left(self, step: Step) -> int:
        """Tokens the step can still take (none once a prefill too big for the budget ran)."""
        used = sum(c.num_tokens for c in step.prefills) + len(step.decodes) + step.num_draft_tokens
        return max(0, self.config.token_budget - used)

    def _blocks_to_resume(self, group: SequenceGroup) -> int:
        """GPU blocks a swapped group's return and next decode take, or a waiting group's
        first step (prefix hits ignored): its first chunk, or all its tokens unchunked."""
        if group.status is GroupStatus.SWAPPED:
            return group.blocks_to_swap_in
        if len(group.live) == 1 and self.config.chunked_prefill:
            return self.manager.blocks_for(min(len(group.live[0]), self.config.token_budget))
        shared = group.shared_prompt(self.manager.block_size)
        return shared // self.manager.block_size + sum(
            self.manager.blocks_for(len(seq) - shared) for seq in group.live)

    def _can_resume(self, group: SequenceGroup, blocks: int) -> bool:
        """Would a waiting or swapped group's ``blocks`` fit now above the watermark, and its
        seats under ``max_num_seqs``?"""
        room = self.manager.num_free_blocks - self.watermark_blocks
        seats = sum(g.max_seqs for g in self.running) + group.max_seqs
        return blocks <= room and seats <= self.config.max_num_seqs

    def _too_small(self, group: SequenceGroup, need: int) -> CacheTooSmall:
        m = self.manager
        return CacheTooSmall(
            f"request {group.request_id!r} needs {need} blocks of {m.block_size} tokens to go "
            f"on; the cache has {m.num_gpu_blocks}, of which admission keeps "
            f"{self.watermark_blocks} free: give it more blocks or fewer tokens"
        )
