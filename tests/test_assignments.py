"""The assignment framework: stubs, sync of student copies, the grader's cell metadata. (That an
untouched student notebook fails its first task is tested with the grader, tests/test_grade.py.)"""

from pathlib import Path

import nbformat
import pytest

from pagedlab_course.assignments import make_student, student_text, stub_source

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "notebooks" / "solutions").glob("*.ipynb"))
STUDENT = ROOT / "notebooks" / "student"


def test_stub_replaces_region_at_its_indentation_and_keeps_the_rest():
    source = (
        "def f(x):\n"
        "    ### BEGIN SOLUTION A9.1: double it\n"
        "    y = 2 * x\n"
        "    ### END SOLUTION\n"
        "    return y\n"
    )
    stubbed, tasks = stub_source(source)
    assert tasks == ["A9.1: double it"]
    assert stubbed == "def f(x):\n    raise NotImplementedError('A9.1: double it')\n    return y"
    namespace = {}
    exec(stubbed, namespace)
    with pytest.raises(NotImplementedError, match="A9.1: double it"):
        namespace["f"](1)


@pytest.mark.parametrize(
    "source, message",
    [
        ("### BEGIN SOLUTION A\n### BEGIN SOLUTION B\n### END SOLUTION", "line 2: BEGIN SOLUTION inside task 'A'"),
        ("x = 1\n### END SOLUTION", "line 2: END SOLUTION without BEGIN"),
        ("### BEGIN SOLUTION A3.1: never closed\nx = 1", "'A3.1: never closed' has no END SOLUTION"),
    ],
)
def test_unbalanced_markers_name_the_cell_and_line(source, message):
    with pytest.raises(ValueError, match=message) as err:
        stub_source(source, where="A3.ipynb, cell 4")
    assert "A3.ipynb, cell 4" in str(err.value)


def test_a_notebook_without_tasks_is_rejected():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    with pytest.raises(ValueError, match="empty.ipynb: no '### BEGIN SOLUTION'"):
        make_student(nb, name="empty.ipynb")


def test_there_are_assignments():
    assert SOLUTIONS, "notebooks/solutions holds no assignment"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_student_copy_is_in_sync_with_its_solution(solution):
    student = STUDENT / solution.name
    assert student.exists(), f"{student} missing: run `make notebooks`"
    assert student.read_text() == student_text(solution), f"{student} is stale: run `make notebooks`"


def test_every_student_notebook_has_a_solution():
    orphans = {p.name for p in STUDENT.glob("*.ipynb")} - {p.name for p in SOLUTIONS}
    assert not orphans


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_solution_is_executed_so_the_grader_has_outputs_to_compare(solution):
    nb = nbformat.read(solution, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert all(c.execution_count is not None for c in code), f"{solution.name}: run it and save"
    assert any(c.outputs for c in code)


def test_student_solution_cells_name_their_tasks_for_the_grader():
    source = "def f(x):\n    ### BEGIN SOLUTION A9.1: one\n    y = x\n    ### END SOLUTION\n    ### BEGIN SOLUTION A9.2: two\n    y += 1\n    ### END SOLUTION\n    return y\n"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import math"), nbformat.v4.new_code_cell(source)])
    student = make_student(nb)
    assert "pagedlab" not in student.cells[0].metadata
    assert student.cells[1].metadata["pagedlab"] == {"solution": "A9.1/A9.2"}
