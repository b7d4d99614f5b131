"""The assignment grader: ``python -m pagedlab.grade NOTEBOOK [--extra-checks DIR]``.

It grades a submitted notebook against the reference the package owns (``notebooks/solutions``):
only the student's solution cells are taken from the submission and run, in a fresh process,
between the reference's own setup and check cells; outputs are compared with the reference's
stored ones; then the hidden checks run (the package's ``pagedlab/grade/hidden`` and an
instructor's ``--extra-checks`` directory). See ``notebooks/README.md``.

A hidden check is a function in a file ``<assignment>*.py`` (``A2_properties.py``), marked with
:func:`task`; it receives the notebook's namespace and fails by raising::

    from pagedlab.grade import task

    @task("A2.1")
    def check_release_order(nb):
        "Releasing blocks in a given order makes the last released the next one allocated."
        pool = nb.Allocator(4)
        ...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat

from pagedlab.grade.notebook import SOLUTIONS, Assignment, assemble, load, reference_for
from pagedlab.grade.report import Report, score

HIDDEN = Path(__file__).resolve().parent / "hidden"
PRELOAD = ["pagedlab", "pagedlab.grade", "torch", "numpy", "matplotlib.pyplot", "hypothesis"]


def task(name: str):
    """Mark a function as a hidden check of task ``name`` ("A2.1", or "A2" for the whole)."""

    def mark(fn):
        fn.__grade_task__ = name
        return fn

    return mark


def grade_many(
    notebooks: list,
    *,
    extra_checks: list[Path] = (),
    solutions: Path = SOLUTIONS,
    tasks: list | None = None,
    cell_timeout: float = 300.0,
    timeout: float = 900.0,
) -> list[Report]:
    """Grade submitted notebooks (paths, or (path, tasks) pairs), each in a fresh process.

    The processes are forked from one that imported torch and the package once, so a batch
    costs one import. ``tasks`` limits each run to those tasks' checks and stops after their
    last cell (for fast tests of single tasks); ``None`` grades everything.
    """
    jobs, plans = [], []
    for item in notebooks:
        path, only = (Path(item[0]), item[1]) if isinstance(item, tuple) else (Path(item), tasks)
        name = path.name
        assignment = load(reference_for(path, solutions))
        unknown = sorted(set(only or ()) - set(assignment.tasks))
        if unknown:
            raise ValueError(f"{path.name}: {assignment.name} has no task {', '.join(unknown)}; "
                             f"its tasks are {', '.join(assignment.tasks)}")
        submission = assemble(assignment, nbformat.read(path, as_version=4))
        cells = _selected(assignment, submission.cells, only)
        plans.append((assignment, submission, cells, name, only))
        if submission.refusals:
            continue
        hidden_dirs = [str(HIDDEN)] + [str(d) for d in extra_checks]
        jobs.append({
            "assignment": assignment.name,
            "cells": [{"index": c.index, "kind": c.kind, "task": c.task, "source": c.source} for c in cells],
            "forbid": assignment.forbid,
            "hidden_dirs": hidden_dirs,
            "only": only,
            "cell_timeout": cell_timeout,
            "timeout": timeout,
        })
    results = iter(_run(jobs, timeout) if jobs else [])
    reports = []
    for assignment, submission, cells, name, only in plans:
        if submission.refusals:
            report = Report(name, assignment.name, refused=submission.refusals, notes=submission.notes)
        else:
            report = score(assignment, cells, next(results), name)
            keep = set(only or ()) | {assignment.name} if only else None  # a broken check file fails "A2"
            report.tasks = [t for t in report.tasks if keep is None or t.task in keep and (t.task in only or not t.ok)]
            report.notes[:0] = submission.notes
        reports.append(report)
    return reports


def grade(notebook, **options) -> Report:
    """Grade one submission; see :func:`grade_many`."""
    return grade_many([notebook], **options)[0]


def _selected(assignment: Assignment, cells: list, tasks: list | None) -> list:
    """The cells up to the last check of ``tasks`` (all of them: runs that differ only in a
    late cell then share the cells before it, see worker._run_group)."""
    if tasks is None:
        return cells
    last = max((i for i, c in enumerate(cells) if c.kind == "check" and c.task in tasks), default=len(cells) - 1)
    return cells[: last + 1]


def _run(jobs: list[dict], timeout: float) -> list[dict]:
    """Run the jobs in one worker process (it forks a child per job, see worker._run_group)."""
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOLUTIONS.parents[1]), env.get("PYTHONPATH")]))
    parallel = max(1, min(len(jobs), len(os.sched_getaffinity(0))))
    request = {"jobs": jobs, "preload": PRELOAD, "parallel": parallel}
    done = subprocess.run(
        [sys.executable, "-m", "pagedlab.grade.worker"],
        input=json.dumps(request), capture_output=True, text=True, env=env,
        timeout=timeout * len(jobs) + 120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the grader's worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)
