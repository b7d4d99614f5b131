"""A request's life in the scheduler, apart from the policy that forms steps (chapter 6).

:class:`RequestLifecycle` holds the queues and does the bookkeeping every policy shares: a
request is checked and queued (:meth:`~RequestLifecycle.add_request`), each step's sampled
tokens are applied to its sequences (:meth:`~RequestLifecycle.update`: fork, prune, roll
back rejected proposals, stop, free), and it ends one way (:meth:`~RequestLifecycle._end`),
finished, aborted or failed.
:class:`~pagedlab.engine.scheduler.Scheduler` adds the policy: which groups run each step.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from pagedlab.engine.params import BeamSearchParams
from pagedlab.engine.policy import enqueue
from pagedlab.engine.scheduler_config import SchedulerConfig
from pagedlab.engine.sequence import GroupOutput, GroupStatus, Sequence, SequenceGroup
from pagedlab.engine.speculative import SpecDecodingStats
from pagedlab.memory import KVCacheManager


class CacheTooSmall(RuntimeError):
    """A request can never run: the whole cache is too small for it. Names the request."""


class TooManySequences(ValueError):
    """A request runs more sequences at once (``n``, ``beam_width``) than ``max_num_seqs``."""


class RequestLifecycle:
    """The queues (waiting, running, swapped), and a request's way in, through and out."""

    def __init__(self, manager: KVCacheManager, config: SchedulerConfig | None = None):
        self.manager = manager
        self.config = config or SchedulerConfig()
        self.waiting: deque[SequenceGroup] = deque()  # waiting and swapped: in policy order
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.unfinished: dict[str, SequenceGroup] = {}  # by request id, whatever their queue
        self.num_steps = 0
        self.spec_stats = SpecDecodingStats()
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    @property
    def watermark_blocks(self) -> int:
        """GPU blocks admission leaves free (the cache may grow, so this follows it)."""
        return int(self.config.watermark * self.manager.num_gpu_blocks)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params,
                    stop_token_ids=(), generators=(), priority: int = 0,
                    stop_check=None) -> SequenceGroup:
        """Queue a request; raise :class:`CacheTooSmall` if its prompt can never be admitted.

        ``params`` is a SamplingParams or BeamSearchParams; ``generators`` the random stream
        of each parallel sample (None entries: the global one); ``priority`` the request's
        urgency, smaller first, which only a :class:`~pagedlab.engine.policy.Priority` policy
        (or one of your own) reads; ``stop_check`` ends a sequence on a stop string
        (:attr:`SequenceGroup.stop_check`). Its sequences stop at ``config.max_model_len``.
        """
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if params.width > self.config.max_num_seqs:
            raise TooManySequences(
                f"request {request_id!r} runs {params.width} sequences at once, more than "
                f"max_num_seqs={self.config.max_num_seqs}"
            )
        need = self.manager.blocks_for(len(prompt))
        capacity = self.manager.num_gpu_blocks - self.watermark_blocks
        if need > capacity:
            raise CacheTooSmall(
                f"request {request_id!r}: its prompt of {len(prompt)} tokens needs {need} "
                f"blocks of {self.manager.block_size} tokens, but admission can use at most "
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
            max_len=self.config.max_model_len,
            stop_check=stop_check,
        )
        if request_id in self.unfinished:
            raise ValueError(f"request {request_id!r} is already running; ids must be unique")
        enqueue(self.config.policy, self.waiting, group)
        self.unfinished[request_id] = group
        return group

    def abort_all(self) -> None:
        """Drop every unfinished request, its blocks and any copies pending (after an error,
        which may have struck between taking a group off its queue and putting it back)."""
        for group in list(self.unfinished.values()):
            self._end(group, "abort")
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.manager.take_copies()

    def abort(self, group: SequenceGroup) -> None:
        """Drop one unfinished request and free its blocks (vLLM's ``abort_request``)."""
        if group.status is GroupStatus.FINISHED:
            raise ValueError(f"request {group.request_id!r} has already finished")
        self._end(group, "abort")

    def _end(self, group: SequenceGroup, reason: str | None, error: Exception | None = None):
        """The one way a request ends (its sequences done, aborted, or failed with ``error``):
        off its queue, every live sequence finished with ``reason`` and its blocks freed."""
        queue = {GroupStatus.RUNNING: self.running, GroupStatus.SWAPPED: self.swapped,
                 GroupStatus.WAITING: self.waiting}[group.status]  # never a finished one
        if group in queue:  # not there if an error struck while it was off its queue
            queue.remove(group)
        for seq in group.live:
            if seq.seq_id in self.manager:
                self.manager.free(seq.seq_id)
            seq.finish_reason = reason
        group.status, group.error = GroupStatus.FINISHED, error
        group.metrics.finished_time = time.monotonic()
        del self.unfinished[group.request_id]

    def update(self, outputs: list[GroupOutput]) -> list[SequenceGroup]:
        """Apply a step's sampled tokens: fork, prune, stop, free. Return the groups finished.

        The step has run, so its keys and values are in the cache: the blocks it filled may
        serve prefix hits from now on (see :meth:`KVCacheManager.rollback` for a step that
        failed instead).
        """
        finished = []
        for out in outputs:
            group = out.group
            if out.error is not None:  # this group alone failed
                self._end(group, "error", out.error)
                finished.append(group)
                continue
            if out.done:  # beam search over: the finished beams are in group.completed
                for seq in group.live:
                    self.manager.free(seq.seq_id)
                group.seqs = []
            else:
                self._apply(group, out.children)
            if not group.live:
                self._end(group, None)
                finished.append(group)
        self.manager.commit()
        return finished

    def _apply(self, group: SequenceGroup, children) -> None:
        """Give each child its sequence (forks share their parent's blocks; pruned beams are
        freed), give back rejected proposals' slots, then append the tokens, freeing a
        sequence that stops."""
        plan, forks, pruned = group.assign(children, self._seq_ids.__next__)
        for parent, seq in forks:
            self.manager.fork(parent.seq_id, seq.seq_id)
        for seq in pruned:
            self.manager.free(seq.seq_id)
        if group.metrics.first_token_time is None:  # every sampled group has a child
            group.metrics.first_token_time = time.monotonic()
        for seq, child in plan:
            if seq.num_computed_tokens > len(seq):  # it verified proposals this step
                self._roll_back(group, seq, len(child.accepted))
            if group.take(seq, child):
                self.manager.free(seq.seq_id)

    def _roll_back(self, group: SequenceGroup, seq: Sequence, accepted: int) -> None:
        """After a verification step the cache keeps the pending token and the ``accepted``
        proposals; the other proposals' slots go back."""
        proposed, kept = seq.num_computed_tokens - len(seq), len(seq) + accepted
        self.manager.truncate(seq.seq_id, kept)
        seq.num_computed_tokens = kept
        self.spec_stats.observe(proposed, accepted)
        group.metrics.num_draft_tokens += proposed
        group.metrics.num_accepted_tokens += accepted
