"""Helpers for hidden checks: Hypothesis settings fit for grading, a side-by-side replay
that names the first operation where the student's code and the reference part ways, and the
grader's own copies of notebook helpers that the checks need."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

from pagedlab_course.grade.proxy import is_remote, kind_of, snapshot

# Deterministic (the same examples for every student), no example database, no deadline
# (the Triton interpreter and a loaded CI machine are slow), few examples (seconds, not minutes),
# and no "explain" phase: its comments on which parts of the example varied are noise to a
# student, who needs the falsifying example alone.
GRADING = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                   suppress_health_check=list(HealthCheck), print_blob=False,
                   phases=[p for p in Phase if p is not Phase.explain])


def outcome(call):
    """('ok', value) or ('error', exception type name): what a call did, for comparing."""
    try:
        return "ok", call()
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - the student's error is what is compared
        return "error", type(e).__name__


def plain(value):
    """``value`` as plain data (numbers, strings, lists, tuples, dicts of them), so that a
    comparison runs the interpreter's ``==``, never a method of the student's classes: a proxy of
    a student's list or dict is its snapshot; of any other object, an error naming its class."""
    if is_remote(value):
        kind, name = kind_of(value)
        if kind == "object":
            raise TypeError(f"expected plain data (numbers, strings, lists, tuples, dicts), got a {name}")
        value = snapshot(value)
        value = list(value) if kind in ("list", "deque") else set(value) if kind == "set" else dict(value)
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) in (list, tuple):
        return type(value)(plain(v) for v in value)
    if type(value) is dict:
        return {plain(k): plain(v) for k, v in value.items()}
    raise TypeError(f"expected plain data (numbers, strings, lists, tuples, dicts), got a {type(value).__name__}")


def a5_next_token(tokens):
    """A5's made-up model (its setup cell's ``next_token``), the grader's own copy for the
    hidden checks: a submission cannot change it."""
    return (31 * sum(tokens[-4:]) + 7 * len(tokens)) % 1000


class Diverged(AssertionError):
    """The student's code and the reference disagreed; the message names the operation."""


def expect(step: int, op: str, what: str, expected, actual) -> None:
    """Fail with the first diverging operation, expected and actual labelled; ``actual`` (the
    student's) is compared as plain data, so its own ``==`` and ``!=`` are never asked."""
    actual = plain(actual)
    if expected != actual:
        raise Diverged(f"operation {step}, {op}: {what}\n    expected: {expected!r}\n    actual:   {actual!r}")


class Renaming:
    """Block ids equal up to a renaming: a one-to-one map from the student's live blocks to the
    reference's, made as blocks are handed out and dropped as they are freed."""

    def __init__(self):
        self.mine_to_ref: dict[int, int] = {}

    def match(self, mine, ref) -> bool:
        """Extend the map with mine[i] -> ref[i]; False if that contradicts it."""
        if len(mine) != len(ref):
            return False
        taken = {r: m for m, r in self.mine_to_ref.items()}
        for m, r in zip(mine, ref):
            if self.mine_to_ref.get(m, r) != r or taken.get(r, m) != m:
                return False
            self.mine_to_ref[m], taken[r] = r, m
        return True

    def forget(self, mine) -> None:
        for m in mine:
            self.mine_to_ref.pop(m, None)
