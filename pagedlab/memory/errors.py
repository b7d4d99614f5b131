"""The memory manager's errors: each names the sequence, block and pool involved.

Every operation that raises leaves the manager exactly as it was, so a scheduler can catch
:class:`OutOfBlocks`, preempt something and retry.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """A pool has fewer free blocks than an all-or-nothing request needs; nothing was taken."""

    def __init__(self, needed: int, free: int, pool: str, owner=None):
        self.needed, self.free, self.pool, self.owner = needed, free, pool, owner
        super().__init__(
            f"{name_owner(owner)} needs {needed} block{'s' * (needed != 1)}, "
            f"pool {pool!r} has {free} free"
        )


class UnknownSequence(KeyError):
    """No live sequence has this id: never allocated, or already freed."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class StateError(ValueError):
    """The operation is not allowed in the current state (double free, reused id, swapped)."""


class InvariantError(AssertionError):
    """``check_invariants`` found the bookkeeping inconsistent: a bug, never a user error."""


def name_owner(owner) -> str:
    """How messages name who asked: a sequence id, a list of them (a group), or nobody."""
    if owner is None:
        return "a request"
    if isinstance(owner, list):  # sequence ids are hashable, so a list always means a group
        return "sequences " + ", ".join(map(repr, owner))
    return f"sequence {owner!r}"
