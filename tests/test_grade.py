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
from pagedlab_course.assignments import make_student
from pagedlab_course.grade import grade_many
from pagedlab_course.grade.checks import Renaming
from pagedlab_course.grade.notebook import SOLUTIONS, assemble, load
from pagedlab_course.grade.report import _diff

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


@pytest.mark.slow
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
            lambda r, task=task: not r.refused and not r.task(task).ok and not r.task(task).library_use
            and not r.task(task).refused)
    if name in FORBIDDEN:
        task, old, new = FORBIDDEN[name]
        add("delegating to the library", edited(name, [(old, new)]), [task],
            lambda r, task=task: (r.task(task).library_use or r.task(task).refused) and not r.task(task).ok)
    add("check cells replaced by prints", cheat_printed_outputs(name), None,
        lambda r: any("was edited or deleted" in x for x in r.refused))
    add("NBVAL_SKIP in the check cells", cheat_nbval_skip(name), None,
        lambda r: any("NBVAL_SKIP" in x for x in r.refused))
    add("an nbval-skip tag on a check cell", cheat_nbval_tag(name), None,
        lambda r: any("nbval-skip" in x for x in r.refused))
    tasks = load(solution_path(name)).tasks
    first_task, last_task = tasks[0], [t for t in tasks if t != name][-1]
    add("the untouched student notebook, its first and last tasks",
        make_student(nbformat.read(solution_path(name), as_version=4)), [first_task, last_task],
        lambda r: not r.refused and r.task(first_task).passed == 0
        and f"NotImplementedError: {first_task}" in r.task(first_task).failures[0]
        and r.task(last_task).passed == r.task(last_task).hidden_passed == 0)

    reports = grade_many([submission for _, submission, _ in cases])
    wrong = [f"{label}:\n{report.text()}" for (label, _, must), report in zip(cases, reports) if not must(report)]
    assert not wrong, "\n\n".join(wrong)


# -- the parts, without running anything --------------------------------------------------------


def test_solution_cells_are_taken_by_metadata_even_when_ids_change():
    assignment = load(solution_path("A2"))
    student = make_student(nbformat.read(solution_path("A2"), as_version=4))
    for cell in student.cells:
        cell["id"] = "renamed-" + cell.get("id", "")
    allocator = next(c for c in student.cells if c.metadata.get("pagedlab", {}).get("solution") == "A2.1")
    allocator.source = allocator.source.replace("raise NotImplementedError('A2.1: free-list allocator')", "return 'mine'")
    submission = assemble(assignment, student)
    assert not submission.refusals
    taken = next(c for c in submission.cells if c.kind == "solution" and c.task == "A2.1")
    assert "return 'mine'" in taken.source


def test_added_cells_are_noted_and_never_run():
    nb = nbformat.read(solution_path("A1"), as_version=4)
    nb.cells.insert(3, nbformat.v4.new_code_cell("raise SystemExit('scratch')"))
    submission = assemble(load(solution_path("A1")), nb)
    assert not submission.refusals
    assert all("scratch" not in c.source for c in submission.cells)
    assert submission.notes == ["1 cell(s) you added were not run: only the solution cells are graded"]


def test_a_deleted_solution_cell_is_refused_by_name():
    nb = make_student(nbformat.read(solution_path("A3"), as_version=4))
    nb.cells = [c for c in nb.cells if c.metadata.get("pagedlab", {}).get("solution") != "A3.2"]
    refusals = assemble(load(solution_path("A3")), nb).refusals
    assert refusals and "no solution cell for A3.2" in refusals[0]


def test_an_unknown_task_is_an_error_not_an_empty_pass():
    with pytest.raises(ValueError, match="A2 has no task A2.9; its tasks are A2.1, A2.2, A2.3, A2.4, A2"):
        grade_many([solution_path("A2")], tasks=["A2.9"])


def test_diff_labels_expected_and_actual_at_the_first_differing_line():
    text = _diff("a\nfree: 2\nend", "a\nfree: 3\nend")
    assert "first difference at output line 2:" in text
    assert "expected: free: 2" in text and "actual:   free: 3" in text


def test_renaming_is_one_to_one_while_blocks_live():
    names = Renaming()
    assert names.match([5, 6], [0, 1])
    assert not names.match([5], [1])  # 5 is already 0
    assert not names.match([7], [0])  # 0 is already 5's
    names.forget([5])
    assert names.match([7], [0])  # 0 was freed: another block may take the name


# -- the command line, as the student README runs it ------------------------------------------


@pytest.mark.slow
def test_command_line_grades_a_buggy_notebook_with_extra_checks_and_writes_json(tmp_path):
    nb = make_student(nbformat.read(solution_path("A2"), as_version=4))
    for cell in nb.cells:  # the student's cells: the solution's code with one bug (FIFO reuse)
        task = cell.metadata.get("pagedlab", {}).get("solution")
        if task:
            source = next(c.source for c in nbformat.read(solution_path("A2"), as_version=4).cells
                          if c.get("id") == cell.get("id"))
            cell.source = source.replace("self.free_list.append(b)", "self.free_list.insert(0, b)")
    path = tmp_path / "A2_block_allocator_mine.ipynb"
    nbformat.write(nb, path)
    extra = tmp_path / "instructor"
    extra.mkdir()
    (extra / "A2_more.py").write_text(
        "from pagedlab_course.grade import task\n\n\n"
        "@task('A2.2')\n"
        "def check_instructors_own(nb):\n"
        "    'An instructor check the students never see.'\n"
        "    assert nb.BlockTable(nb.Allocator(1), 4).blocks_needed(5) == 99, 'blocks_needed(5) is not 99'\n"
    )
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pagedlab_course.grade", str(path), "--extra-checks", str(extra), "--json", str(report),
         "--task", "A2.1", "--task", "A2.2"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "A2 (A2_block_allocator_mine.ipynb): 0/2 tasks passed; 5/8 checks, 1/3 hidden checks"
    assert "A2.1: 1/4 checks, hidden 0/1  [FAIL]" in lines
    assert "blocks_needed(5) is not 99" in done.stdout
    assert str(extra) not in done.stdout  # an instructor's file is named, never its path
    data = json.loads(report.read_text())[0]
    assert data["passed"] is False and [t["task"] for t in data["tasks"]] == ["A2.1", "A2.2"]
    first = data["tasks"][0]["failures"][0]
    assert "expected: [3, 5] free: 0" in first and "actual:   [5, 3] free: 0" in first


@pytest.mark.slow
def test_a_broken_check_file_fails_the_grade(tmp_path):
    (tmp_path / "A1_broken.py").write_text("def broken(:\n")
    report = grade_many([(solution_path("A1"), ["A1.1"])], extra_checks=[tmp_path])[0]
    assert not report.passed
    assert "loading" in report.task("A1").failures[0] and "SyntaxError" in report.task("A1").failures[0]


REFERENCED = """import os
from pagedlab_course.grade import task


def _where():
    return {"pid": os.getpid(), "pair": (1, 2)}


@task("A1.1", reference=_where)
def check_with_reference(nb, expected):
    "The reference came from the grader's process, as plain data."
    assert expected["pid"] != os.getpid() and expected["pair"] == [1, 2], expected
"""


@pytest.mark.slow
def test_a_reference_is_computed_by_the_grader_and_given_to_its_check(tmp_path):
    (tmp_path / "A1_referenced.py").write_text(REFERENCED)
    report = grade_many([(solution_path("A1"), ["A1.1"])], extra_checks=[tmp_path])[0]
    assert report.passed and report.task("A1.1").hidden_passed == report.task("A1.1").hidden == 2, report.text()


def test_a_failing_reference_is_an_error_naming_its_file_before_anything_is_graded():
    from pagedlab_course.grade.batch import _reference

    source = REFERENCED.replace('return {"pid"', 'return 1 / 0 or {"pid"')
    with pytest.raises(RuntimeError, match="<instructor check A1_x.py>: the reference _where of check_with_reference "
                                           "failed: ZeroDivisionError"):
        _reference("<instructor check A1_x.py>", source, "check_with_reference")


def test_a_duplicated_solution_cell_is_refused_naming_both_cells():
    """Finding 9: a cell copied in Jupyter keeps its metadata; the grader took the untouched
    copy and only noted that a cell was not run."""
    nb = make_student(nbformat.read(solution_path("A2"), as_version=4))
    index = next(i for i, c in enumerate(nb.cells) if c.metadata.get("pagedlab", {}).get("solution") == "A2.1")
    copy = nbformat.from_dict(json.loads(json.dumps(nb.cells[index])))
    copy.source = copy.source.replace("raise NotImplementedError('A2.1: free-list allocator')", "return []")
    nb.cells.insert(index + 1, copy)
    refusals = assemble(load(solution_path("A2")), nb).refusals
    assert refusals == [f"cells {index + 1}, {index + 2} are all the A2.1 solution cell (a copied cell keeps its "
                        "metadata): delete all but the one you want graded"]


def test_a_failing_property_shows_the_falsifying_example_without_hypothesis_commentary():
    from hypothesis import given
    from hypothesis import strategies as st

    from pagedlab_course.grade.checks import GRADING

    @GRADING
    @given(st.lists(st.integers(0, 9)), st.integers(0, 9))
    def check(xs, y):
        assert y != 3

    with pytest.raises(AssertionError) as failed:
        check()
    notes = "\n".join(getattr(failed.value, "__notes__", []))
    assert "y=3" in notes and "any other generated value" not in notes and "varied together" not in notes


def test_a_knock_on_failure_names_the_task_that_failed_first():
    """Finding 9: A2.4's check failed inside its own code when A2.3's fork was broken."""
    from pagedlab_course.grade.report import score

    assignment = load(solution_path("A2"))
    results = []
    for cell in assignment.cells:
        broken = cell.kind == "check" and cell.task in ("A2.3", "A2.4")
        error = {"type": "IndexError", "message": "list index out of range", "where": ""} if broken else None
        results.append({"index": cell.index, "stdout": "" if broken else cell.expected or "", "student_stdout": "",
                        "error": error})
    report = score(assignment, assignment.cells, {"cells": results, "hidden": [], "violations": []}, "A2_x.ipynb")
    assert "(because A2.3 failed: this check uses its SharedBlockTable)" in report.task("A2.4").failures[0]
    assert "because" not in report.task("A2.3").failures[0]


# Issue 46, item 6: bugs of the review's honest student that every hidden check passed.
MISSED = {
    "B8 watermark compared with >=": ("A5", ["A5.1"], [("if self.blocks_for(n) > room or", "if self.blocks_for(n) >= room or")]),
    "B9 a recomputed request queued at the head": ("A5", ["A5.2"], [(
        "    later = [i for i, r in enumerate(self.waiting) if r.arrival > req.arrival]\n"
        "    self.waiting.insert(later[0] if later else len(self.waiting), req)", "    self.waiting.appendleft(req)")]),
    "B13 peak measured after finished requests freed their blocks": ("A5", ["A5.4"], [(
        "        peak = max(peak, manager.num_used_blocks)\n        peak_cpu = max(peak_cpu, manager.cpu.num_used)\n",
        ""), ("        sched.update(step)\n", "        sched.update(step)\n        peak = max(peak, manager.num_used_blocks)\n"
                                        "        peak_cpu = max(peak_cpu, manager.cpu.num_used)\n")]),
    "C24's control: other exception classes": ("A2", ["A2.1"], [
        ("raise OutOfBlocks(n, len(self.free_list))", "raise RuntimeError('out of blocks')"),
        ('raise NotInUse(b, "share")', "raise KeyError(b)"), ('raise NotInUse(b, "release")', "raise KeyError(b)")]),
}


@pytest.mark.slow
def test_bugs_the_hidden_checks_missed_fail_their_own_task_in_a_hidden_check(tmp_path):
    paths = []
    for i, (name, tasks, edits) in enumerate(MISSED.values()):
        paths.append((tmp_path / f"{name}_{i}.ipynb", tasks))
        nbformat.write(edited(name, edits), paths[-1][0])
    reports = grade_many(paths)
    wrong = [f"{label}:\n{r.text()}" for label, r, (_, tasks, _) in zip(MISSED, reports, MISSED.values())
             if r.refused or r.task(tasks[0]).hidden_passed == r.task(tasks[0]).hidden]
    assert not wrong, "\n\n".join(wrong)


def test_a_solution_cell_an_editor_stripped_of_metadata_and_id_is_found_by_its_content():
    """Issue 46, item 6 (the review's C22): an editor dropped the A2.1 cell's metadata and id, and
    its code no longer holds the stub: it was refused as 'no solution cell for A2.1'."""
    nb = make_student(nbformat.read(solution_path("A2"), as_version=4))
    cell = next(c for c in nb.cells if c.metadata.get("pagedlab", {}).get("solution") == "A2.1")
    cell.metadata, cell["id"] = {}, "stripped"
    cell.source = cell.source.replace("raise NotImplementedError('A2.1: free-list allocator')", "return 'mine'")
    submission = assemble(load(solution_path("A2")), nb)
    assert not submission.refusals, submission.refusals
    taken = next(c for c in submission.cells if c.kind == "solution" and c.task == "A2.1")
    assert "return 'mine'" in taken.source


def test_expect_never_asks_the_students_value_whether_it_is_equal():
    """Issue 46, item 2 (the review's C05): `expected != actual` lets Python ask the student's
    `__ne__`; `expect` compares the student's value as plain data."""
    from pagedlab_course.grade.checks import Diverged, expect

    anything = type("Anything", (), dict(__eq__=lambda s, o: True, __ne__=lambda s, o: False, __hash__=lambda s: 0))()
    for actual in (anything, [anything], {"peak_blocks": anything}):
        with pytest.raises(TypeError, match="expected plain data"):
            expect(0, "serve(...)", "counts", {"peak_blocks": 1}, actual)
    with pytest.raises(Diverged, match="expected: 1\n    actual:   2"):
        expect(0, "serve(...)", "peak_blocks", 1, 2)
    expect(0, "serve(...)", "counts", {"leaked": (0, 0)}, {"leaked": (0, 0)})
