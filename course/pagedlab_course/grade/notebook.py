"""The reference notebook the grader owns, and a submission read against it.

The reference is the package's solution notebook: its check cells, setup cells and stored
outputs are what a submission is graded with. From the submitted file the grader takes only
the solution cells (the cells holding a task's ``### BEGIN SOLUTION`` region in the reference);
every other code cell of the reference must appear in the submission unchanged, and no cell may
carry an nbval marker, so a submission that edited or skipped a check is refused, not graded.
"""

from __future__ import annotations

import configparser
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from pagedlab_course.assignments import BEGIN, END, task_id
from pagedlab_course.grade.rules import bound_names, free_names

# the reference notebooks: the course repository's, where the grader runs (`--solutions` elsewhere)
SOLUTIONS = Path.cwd() / "notebooks" / "solutions"
CHECK = re.compile(r"^# Check (?P<task>A\d+(?:\.\d+[a-z]?)?)\b")
NBVAL_MARKER = re.compile(r"#\s*NBVAL_\w+|#\s*PYTEST_VALIDATE_IGNORE_OUTPUT")
ASSIGNMENT = re.compile(r"^(A\d+)(?!\d)")


@dataclass
class Cell:
    index: int  # position among all cells, counting from 1 as a reader does
    kind: str  # "setup", "solution" or "check"
    source: str
    task: str = ""  # "A2.1" for a check or solution cell; "A2.1/A2.2" for a cell with two
    expected: str | None = None  # the reference's stdout, sanitized; None: not compared
    cell_id: str = ""
    tags: tuple = ()

    @property
    def title(self) -> str:
        return self.source.splitlines()[0].lstrip("# ").strip() if self.source else ""


@dataclass
class Assignment:
    """A solution notebook as the grader uses it."""

    name: str  # "A2"
    path: Path
    cells: list[Cell]
    forbid: list[str] = field(default_factory=list)  # modules / callables the solutions may not use
    sanitize: list[tuple[re.Pattern, str]] = field(default_factory=list)

    @property
    def tasks(self) -> list[str]:
        """Every task with a check, in notebook order (the whole-assignment check "A2" last)."""
        seen = []
        for cell in self.cells:
            for task in cell.task.split("/") if cell.kind == "check" else []:
                if task and task not in seen:
                    seen.append(task)
        return sorted(seen, key=lambda t: (t == self.name, seen.index(t)))

    @property
    def protected(self) -> dict[str, str | None]:
        """Names a submission may not rebind: those the setup cells bind (the checks' helpers,
        tolerances, the library's classes), and those a check cell binds and another reads
        (``pool`` made in one check, used in the next), unless a reference solution cell binds
        them itself. A check's own scratch names stay free for the student's scratch code."""
        setup, checks, read, solution = {}, {}, set(), set()
        for cell in self.cells:
            names = bound_names(cell.source)
            if cell.kind == "setup":
                setup.update(names)
            elif cell.kind == "check":
                checks.update(names)
                read |= free_names(cell.source)
            else:
                solution |= set(names)
        shared = {name: what for name, what in checks.items() if name in read}
        return {name: what for name, what in {**shared, **setup}.items() if name not in solution}

    def clean(self, text: str) -> str:
        """Output as compared: sanitized (addresses, timings), trailing spaces dropped."""
        for pattern, replacement in self.sanitize:
            text = pattern.sub(replacement, text)
        return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _sanitizers(path: Path) -> list[tuple[re.Pattern, str]]:
    if not path.exists():
        return []
    cfg = configparser.ConfigParser()
    cfg.read(path)
    return [(re.compile(cfg[s]["regex"]), cfg[s]["replace"]) for s in cfg.sections()]


def load(path: Path) -> Assignment:
    """The assignment a solution notebook defines."""
    nb = nbformat.read(path, as_version=4)
    meta = nb.metadata.get("pagedlab", {})
    name = meta.get("assignment") or ASSIGNMENT.match(path.name)[1]
    sanitize = _sanitizers(path.parent.parent / "sanitize.cfg")
    assignment = Assignment(name, path, [], list(meta.get("forbid", [])), sanitize)
    for index, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        tags = tuple(cell.metadata.get("tags", ()))
        markers = [task_id(m["task"]) for line in cell.source.splitlines() if (m := BEGIN.match(line))]
        check = CHECK.match(cell.source)
        if markers:
            kind, task = "solution", "/".join(dict.fromkeys(markers))
        elif check:
            kind, task = "check", check["task"]
        else:
            kind, task = "setup", ""
        stdout = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
        compared = kind != "solution" and "nbval-ignore-output" not in tags
        expected = assignment.clean(stdout) if compared else None
        assignment.cells.append(Cell(index, kind, cell.source, task, expected, cell.get("id", ""), tags))
    return assignment


def reference_for(notebook: Path, nb: nbformat.NotebookNode, solutions: Path = SOLUTIONS) -> Path:
    """The solution notebook of the assignment a submission's file name names (``A2_mine.ipynb``);
    ValueError if the name names none, names one with no reference, or its metadata names another."""
    match = ASSIGNMENT.match(notebook.name)
    if match is None:
        raise ValueError(f"{notebook.name}: cannot tell which assignment this is (name it A<n>_...ipynb)")
    name = match[1]
    claimed = nb.metadata.get("pagedlab", {}).get("assignment") if isinstance(nb.metadata, dict) else None
    if claimed and claimed != name:
        raise ValueError(f"{notebook.name}: the file name says {name} but the notebook is {claimed}'s "
                         f"(its metadata): grade it under a name that starts with {claimed}_")
    found = sorted(Path(solutions).glob(f"{name}_*.ipynb"))
    if not found:
        raise ValueError(f"{notebook.name}: no reference for assignment {name} in {solutions} "
                         f"(pass the directory of the solution notebooks with --solutions)")
    return found[0]


def _same(a: str, b: str) -> bool:
    return [line.rstrip() for line in a.strip().splitlines()] == [line.rstrip() for line in b.strip().splitlines()]


@dataclass
class Submission:
    """What the grader runs for a submitted notebook, or why it refuses to."""

    cells: list[Cell]  # the reference's cells, with the student's source in the solution cells
    refusals: list[str]
    notes: list[str]


def assemble(assignment: Assignment, nb: nbformat.NotebookNode) -> Submission:
    """Take the solution cells out of a submitted notebook and put them into the reference."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    refusals, used, cells = [], set(), []
    for ref in assignment.cells:
        if ref.kind == "solution":
            twins = [c for c in code if c.metadata.get("pagedlab", {}).get("solution") == ref.task]
            if len(twins) > 1:
                where = [next(i for i, c in enumerate(nb.cells, start=1) if c is t) for t in twins]
                refusals.append(
                    f"cells {', '.join(map(str, where))} are all the {ref.task} solution cell (a copied cell "
                    f"keeps its metadata): delete all but the one you want graded")
                continue
            mine = _solution_cell(ref, [c for c in code if id(c) not in used], assignment)
            if mine is None:
                refusals.append(
                    f"no solution cell for {ref.task} (the cell that held `raise NotImplementedError"
                    f"('{ref.task.split('/')[0]}...')`): keep that cell and write your code in it"
                )
                continue
            used.add(id(mine))
            source = mine.source
        else:
            mine = next((c for c in code if id(c) not in used and _same(c.source, ref.source)), None)
            if mine is None:
                what = f"check cell {ref.task}" if ref.kind == "check" else "cell"
                refusals.append(f"{what} '{ref.title}' (cell {ref.index}) was edited or deleted")
                continue
            used.add(id(mine))
            source = ref.source
        cells.append(Cell(ref.index, ref.kind, source, ref.task, ref.expected, ref.cell_id, ref.tags))
        extra = [t for t in mine.metadata.get("tags", ()) if t.startswith("nbval") and t not in ref.tags]
        if extra:
            refusals.append(f"cell {ref.index} ('{ref.title}') carries the nbval tag {extra[0]}")
    for number, cell in enumerate(code, start=1):
        marker = NBVAL_MARKER.search(cell.source)
        if marker:
            refusals.append(f"code cell {number} carries the nbval marker {marker[0].lstrip('# ')}")
    added = [c for c in code if id(c) not in used and c.source.strip()]
    notes = []
    if added:
        notes.append(f"{len(added)} cell(s) you added were not run: only the solution cells are graded")
    return Submission(cells, refusals, notes)


def _solution_cell(ref: Cell, code: list, assignment: Assignment) -> nbformat.NotebookNode | None:
    """The submitted cell for a reference solution cell: by the grader's metadata, its cell id,
    the stub or markers naming its first task, or (a notebook that lost all three) its content."""
    for cell in code:
        if cell.metadata.get("pagedlab", {}).get("solution") == ref.task:
            return cell
    for cell in code:
        if ref.cell_id and cell.get("id") == ref.cell_id:
            return cell
    first = ref.task.split("/")[0]
    for cell in code:
        if f"NotImplementedError('{first}:" in cell.source or f"BEGIN SOLUTION {first}:" in cell.source:
            return cell
    others = [c.source for c in assignment.cells if c.kind != "solution"]
    unclaimed = [c for c in code if not c.metadata.get("pagedlab", {}).get("solution")
                 and not any(_same(c.source, other) for other in others)]
    return _by_content(ref, unclaimed)


def _by_content(ref: Cell, code: list) -> nbformat.NotebookNode | None:
    """The cell holding most of the lines the reference cell keeps around its solution regions
    (its ``class``/``def`` lines, docstrings, the assignments after them), if it holds at least
    half of them and more than any other cell: what an editor that strips metadata leaves."""
    kept, inside = set(), False
    for line in ref.source.splitlines():
        if BEGIN.match(line) or END.match(line):
            inside = bool(BEGIN.match(line))
        elif not inside and line.strip():
            kept.add(line.strip())
    found = sorted(((len(kept & {line.strip() for line in c.source.splitlines()}), i) for i, c in enumerate(code)),
                   reverse=True)
    if found and 2 * found[0][0] >= len(kept) > 0 and (len(found) == 1 or found[1][0] < found[0][0]):
        return code[found[0][1]]
    return None
