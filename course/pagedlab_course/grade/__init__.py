"""The assignment grader: ``python -m pagedlab_course.grade NOTEBOOK [--extra-checks DIR]``.

It grades a submitted notebook against the reference the package owns (``notebooks/solutions``):
only the student's solution cells are taken from the submission, checked against the rules of
``pagedlab_course.grade.rules``, and run in a sealed process of their own (``pagedlab_course.grade.worker``,
sealed by ``pagedlab_course.grade.sandbox``) after the reference's own setup cells; the reference's
check cells and then the hidden checks (the package's ``course/pagedlab_course/grade/hidden`` and an
instructor's ``--extra-checks`` directory, sent as text) run in a second sealed process, the judge
(``pagedlab_course.grade.judge``), which calls the student's code over a channel that brings back plain
data. This process, where no student code runs, compares what the judge reports with the
reference's stored outputs and counts every check that did not report as failed. See
``notebooks/README.md``.

A hidden check is a function in a file ``<assignment>*.py`` (``A2_properties.py``), marked with
:func:`task`; it receives the notebook's namespace and fails by raising::

    from pagedlab_course.grade import task

    @task("A2.1")
    def check_release_order(nb):
        "Releasing blocks in a given order makes the last released the next one allocated."
        pool = nb.Allocator(4)
        ...
"""

from __future__ import annotations

from pagedlab_course.grade.sandbox import HIDDEN

__all__ = ["HIDDEN", "SOLUTIONS", "grade", "grade_many", "hidden_sources", "task"]


def task(name: str, reference=None):
    """Mark a function as a hidden check of task ``name`` ("A2.1", or "A2" for the whole).

    ``reference``, a function of the same file with no arguments (or one: the batch's seed,
    drawn at grading time and recorded in each report, to draw the check's cases from, so that a
    table of answers to the public cases earns nothing), computes what the check compares with: the grader calls it in its own process, where no student code runs (a
    submission cannot change the library it uses), once per file however many submissions it
    grades, and passes its value (plain data: JSON turns tuples into lists) to the check as a
    second argument."""

    def mark(fn):
        fn.__grade_task__ = name
        fn.__grade_reference__ = reference
        return fn

    return mark


def __getattr__(name: str):
    """The grading API (``grade``, ``grade_many``, ...), imported on first use: the judge
    imports this package for :func:`task` alone, and the notebook reader's imports (nbformat,
    jsonschema) would cost every judge seconds of CPU."""
    if name in __all__:
        from pagedlab_course.grade import batch

        return getattr(batch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
