"""The grader, tested with the submissions of tests/grade_cases.py: broken solutions fail the task
they break, correct variants pass everything, cheats are refused or reported; and the reference
solutions reproduce their stored outputs (what nbval checked before the grader)."""

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from grade_cases import BROKEN, CORRECT, FORBIDDEN
from pagedlab.assignments import make_student
from pagedlab.grade import grade_many
from pagedlab.grade.checks import Renaming
from pagedlab.grade.notebook import SOLUTIONS, assemble, load
from pagedlab.grade.report import _diff

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENTS = sorted(BROKEN)


def solution_path(name: str) -> Path:
    return next(SOLUTIONS.glob(f"{name}_*.ipynb"))


def edited(name: str, edits: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """The solution notebook with each (old, new) applied once to its solution cells."""
    nb = nbformat.read(solution_path(name), as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "### BEGIN SOLUTION" in c.source]
    for old, new in edits:
        hits = [c for c in cells if old in c.source]
        assert len(hits) == 1 and hits[0].source.count(old) == 1, f"{name}: {old!r} is not in exactly one place"
        hits[0].source = hits[0].source.replace(old, new)
    return nb


def cheat_printed_outputs(name: str) -> nbformat.NotebookNode:
    """Stubs left as they are; every check cell replaced by a print of its stored output."""
    nb = make_student(nbformat.read(solution_path(name), as_version=4))
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("# Check"):
            text = "".join(o.get("text", "") for o in cell.outputs)
            cell.source = f"{cell.source.splitlines()[0]}\nprint({text!r}, end='')"
    return nb


def cheat_nbval_skip(name: str) -> nbformat.NotebookNode:
    nb = make_student(nbformat.read(solution_path(name), as_version=4))
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("# Check"):
            cell.source = "# NBVAL_SKIP\n" + cell.source
    return nb


def cheat_nbval_tag(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(solution_path(name), as_version=4)
    check = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("# Check"))
    check.metadata["tags"] = ["nbval-skip"]
    return nb


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_grader_fails_every_broken_solution_passes_variants_and_refuses_cheats(name, tmp_path):
    cases = []  # (label, submission, tasks, what must hold of its report)

    def add(label, nb, tasks, must):
        path = tmp_path / f"{name}_{len(cases)}.ipynb"
        nbformat.write(nb, path)
        cases.append((label, (path, tasks), must))

    add("the reference solution", nbformat.read(solution_path(name), as_version=4), None,
        lambda r: r.passed and not r.setup_mismatches)
    for label, edits in CORRECT[name].items():
        add(f"correct variant '{label}'", edited(name, edits), None, lambda r: r.passed)
    for label, (task, old, new) in BROKEN[name].items():
        add(f"broken '{label}'", edited(name, [(old, new)]), [task],
            lambda r, task=task: not r.refused and not r.task(task).ok and not r.task(task).library_use)
    if name in FORBIDDEN:
        task, old, new = FORBIDDEN[name]
        add("delegating to the library", edited(name, [(old, new)]), [task],
            lambda r, task=task: r.task(task).library_use and not r.task(task).ok)
    add("check cells replaced by prints", cheat_printed_outputs(name), None,
        lambda r: any("was edited or deleted" in x for x in r.refused))
    add("NBVAL_SKIP in the check cells", cheat_nbval_skip(name), None,
        lambda r: any("NBVAL_SKIP" in x for x in r.refused))
    add("an nbval-skip tag on a check cell", cheat_nbval_tag(name), None,
        lambda r: any("nbval-skip" in x for x in r.refused))
    first_task = load(solution_path(name)).tasks[0]
    add("the untouched student notebook", make_student(nbformat.read(solution_path(name), as_version=4)), [first_task],
        lambda r: not r.refused and r.task(first_task).passed == 0)

    reports = grade_many([submission for _, submission, _ in cases])
    wrong = [f"{label}:\n{report.text()}" for (label, _, must), report in zip(cases, reports) if not must(report)]
    assert not wrong, "\n\n".join(wrong)
