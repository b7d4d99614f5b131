"""Student notebooks generated from solution notebooks, the single source of an assignment.

A solution notebook marks each task's code in a code cell::

    def online_softmax(x, block_size):
        ### BEGIN SOLUTION A1.2: online softmax
        ...
        ### END SOLUTION

The student copy replaces each region with ``raise NotImplementedError("A1.2: online
softmax")`` at the marker's indentation, keeps the solution's stored outputs for the student to
read, and names the cell's tasks in its metadata (``{"pagedlab": {"solution": "A1.2"}}``): the
grader (``pagedlab_course.grade``) takes those cells, and only those, from a submission.

Regenerate every student notebook with ``python -m pagedlab_course.assignments SOLUTIONS STUDENT``.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import nbformat

BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION (?P<task>\S.*?)\s*$")
END = re.compile(r"^[ \t]*### END SOLUTION\s*$")


def task_id(task: str) -> str:
    """A marker's task name without its description: 'A2.1: free-list allocator' -> 'A2.1'."""
    return task.split(":")[0].strip()


def stub_source(source: str, where: str = "cell") -> tuple[str, list[str]]:
    """Replace each solution region in ``source``; return the new source and the task names.

    ``where`` names the cell in error messages for unbalanced markers.
    """
    out, tasks, task = [], [], None
    for lineno, line in enumerate(source.splitlines(), start=1):
        begin = BEGIN.match(line)
        if begin:
            if task is not None:
                raise ValueError(f"{where}, line {lineno}: BEGIN SOLUTION inside task {task!r}")
            task = begin["task"]
            tasks.append(task)
            out.append(f"{begin['indent']}raise NotImplementedError({task!r})")
        elif END.match(line):
            if task is None:
                raise ValueError(f"{where}, line {lineno}: END SOLUTION without BEGIN SOLUTION")
            task = None
        elif task is None:
            out.append(line)
    if task is not None:
        raise ValueError(f"{where}: task {task!r} has no END SOLUTION")
    return "\n".join(out), tasks


def make_student(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The student copy of a solution notebook: regions stubbed, outputs kept, solution cells
    named in their metadata."""
    student = copy.deepcopy(solution)
    tasks = []
    for index, cell in enumerate(student.cells):
        if cell.cell_type == "code":
            cell.source, found = stub_source(cell.source, where=f"{name}, cell {index}")
            if found:
                cell.metadata["pagedlab"] = {"solution": "/".join(dict.fromkeys(map(task_id, found)))}
            tasks += found
    if not tasks:
        raise ValueError(f"{name}: no '### BEGIN SOLUTION' region, nothing for a student to do")
    return student


def student_text(solution_path: Path) -> str:
    """The exact file contents the student copy of ``solution_path`` must have."""
    solution = nbformat.read(solution_path, as_version=4)
    return nbformat.writes(make_student(solution, name=solution_path.name)) + "\n"


def build(solutions: Path, student: Path) -> list[Path]:
    """Write the student copy of every solution notebook; return the paths written."""
    student.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(solutions.glob("*.ipynb")):
        target = student / path.name
        target.write_text(student_text(path))
        written.append(target)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pagedlab_course.assignments SOLUTIONS_DIR STUDENT_DIR")
    for written in build(Path(sys.argv[1]), Path(sys.argv[2])):
        print("wrote", written)
