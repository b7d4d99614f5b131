"""Scheduling policies: which request the scheduler serves first, and which it preempts first.

vLLM's first scheduler kept this in ``vllm/core/policy.py``: a ``Policy`` ranks a sequence
group (``get_priority``) and the scheduler sorts its queues by that rank; ``FCFS`` ranks by
arrival. Its later ``priority`` mode ranks by a number each request carries and preempts the
least urgent running group first. Here a :class:`Policy` ranks by :meth:`Policy.key`, smaller
first, and the :class:`~pagedlab.engine.Scheduler` applies that one ranking to its three queues:

- waiting groups are admitted in order, the first that does not fit stopping the queue;
- running groups decode in order, and when blocks run out the *last* of them is preempted;
- swapped groups come back in order.

A policy only ranks: what fits is still the scheduler's decision, and a sort can neither lose
nor duplicate a request. It promises nothing about fairness: FCFS serves every request in the
end, but a policy that always prefers some requests can starve the others.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, MutableSequence
from dataclasses import dataclass

from pagedlab.engine.sequence import SequenceGroup


@dataclass(frozen=True)
class Policy:
    """Ranks sequence groups: subclass it and define :meth:`key`.

    The key must depend on the group alone: the scheduler keeps its waiting and swapped queues
    sorted as groups join them (:func:`enqueue`), and re-sorts only the running groups, which
    grow (:func:`ranked`). Policies are frozen dataclasses, so that a
    :class:`~pagedlab.engine.SchedulerConfig` holding one stays hashable and travels to the
    simulator's worker processes; give a subclass fields the same way.
    """

    def key(self, group: SequenceGroup):
        """A sortable rank: smaller is admitted, decoded and resumed sooner, preempted later."""
        raise NotImplementedError(f"{type(self).__name__} must define key(group)")


@dataclass(frozen=True)
class FCFS(Policy):
    """First come, first served, the paper's policy and vLLM's default: rank by arrival, so
    the latest arrival is preempted first. Every request is served in the end."""

    def key(self, group: SequenceGroup) -> int:
        return group.arrival


@dataclass(frozen=True)
class Priority(Policy):
    """Rank by the request's ``priority``, smaller first (vLLM's convention), then by arrival.

    The least urgent, latest arrival is preempted first. Unlike vLLM, an urgent request that
    does not fit waits for room instead of preempting less urgent running ones; and a steady
    stream of urgent requests starves the others.
    """

    def key(self, group: SequenceGroup) -> tuple[int, int]:
        return group.priority, group.arrival


POLICIES = {"fcfs": FCFS(), "priority": Priority()}  # vLLM's scheduling_policy names


def ranked(policy: Policy, groups: Iterable[SequenceGroup]) -> list[SequenceGroup]:
    """``groups`` in ``policy``'s order, first served first (stable: equal keys keep theirs)."""
    groups = list(groups)
    try:
        return sorted(groups, key=policy.key)
    except TypeError as err:
        raise _incomparable(policy, groups, err) from err


def enqueue(policy: Policy, queue: MutableSequence[SequenceGroup], group: SequenceGroup) -> None:
    """Insert ``group`` into ``queue``, which is in ``policy``'s order, after its equals."""
    try:
        bisect.insort(queue, group, key=policy.key)
    except TypeError as err:
        raise _incomparable(policy, [*queue, group], err) from err


def _incomparable(policy: Policy, groups: list[SequenceGroup], err: TypeError) -> TypeError:
    keys = ", ".join(f"{g.request_id!r}: {policy.key(g)!r}" for g in groups[:6])
    more = ", ..." if len(groups) > 6 else ""
    return TypeError(f"{policy!r}.key gives ranks that do not compare ({err}); "
                     f"the keys by request: {keys}{more}")
