"""Scores from a run: per task, the checks passed, the first failure with expected and actual
labelled, the library uses found; a summary line and a JSON-ready dict for an instructor."""

from __future__ import annotations

import ast
import re
from dataclasses import asdict, dataclass, field

from pagedlab_course.grade.notebook import Assignment, Cell
from pagedlab_course.grade.rules import bound_names

CELL_FILE = re.compile(r"<cell (\d+)(?:: ([^>]+))?> line (\d+)")


@dataclass
class TaskScore:
    task: str
    checks: int = 0
    passed: int = 0
    hidden: int = 0
    hidden_passed: int = 0
    failures: list[str] = field(default_factory=list)  # the first failing visible and hidden check
    library_use: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # rules its solution cell broke (not run)

    @property
    def ok(self) -> bool:
        return (self.passed == self.checks and self.hidden_passed == self.hidden
                and not self.library_use and not self.refused)

    def line(self) -> str:
        hidden = f", hidden {self.hidden_passed}/{self.hidden}" if self.hidden else ""
        flag = "" if self.ok else ("  [REFUSED]" if self.refused else "  [uses the library]" if self.library_use
                                   else "  [FAIL]")
        return f"{self.task}: {self.passed}/{self.checks} checks{hidden}{flag}"


@dataclass
class Report:
    notebook: str
    assignment: str
    refused: list[str] = field(default_factory=list)
    tasks: list[TaskScore] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    setup_mismatches: list[str] = field(default_factory=list)  # the notebook's own cells (CI)
    student_output: dict[str, str] = field(default_factory=dict)
    sandbox: str = ""  # "bwrap", or "process": run without bubblewrap's seal (see grade/sandbox.py)
    seed: int | None = None  # what the hidden checks drew their cases from (--seed reproduces a grade)

    @property
    def passed(self) -> bool:
        return not self.refused and all(t.ok for t in self.tasks)

    def task(self, name: str) -> TaskScore:
        return next(t for t in self.tasks if t.task == name)

    def summary(self) -> str:
        if self.refused:
            return f"{self.assignment} ({self.notebook}): REFUSED, {len(self.refused)} problem(s); not graded"
        checks = sum(t.checks for t in self.tasks), sum(t.passed for t in self.tasks)
        hidden = sum(t.hidden for t in self.tasks), sum(t.hidden_passed for t in self.tasks)
        ok = sum(t.ok for t in self.tasks)
        return (
            f"{self.assignment} ({self.notebook}): {ok}/{len(self.tasks)} tasks passed; "
            f"{checks[1]}/{checks[0]} checks, {hidden[1]}/{hidden[0]} hidden checks"
        )

    def text(self) -> str:
        lines = []
        if self.refused:
            lines += ["The submission was refused:"] + [f"  - {r}" for r in self.refused]
        for t in self.tasks:
            lines.append(t.line())
            lines += [f"    {f}" for f in t.refused + t.library_use + t.failures]
        lines += [f"note: {n}" for n in self.notes]
        if self.sandbox == "process":
            lines.append("note: graded without bubblewrap (sandbox level 'process'): only the rules protected the "
                         "grader's files and other submissions")
        for where, out in self.student_output.items():
            shown = out.rstrip().splitlines()
            lines.append(f"note: your code printed {len(shown)} line(s) during {where} (shown, not graded)")
        lines.append(self.summary())
        return "\n".join(lines)

    def as_dict(self) -> dict:
        d = asdict(self)
        for t, task in zip(d["tasks"], self.tasks):
            t["ok"] = task.ok
        d["passed"], d["summary"] = self.passed, self.summary()
        return d


def _readable(where: str, cells: dict[int, Cell]) -> str:
    """'<cell 3: A2.1> line 15' -> 'your A2.1 cell, line 15'; a check cell by its title."""
    m = CELL_FILE.search(where)
    if not m:
        return where
    index, task, line = int(m[1]), m[2], m[3]
    if index not in cells:  # the worker's claim, unverified: shown as it came
        return where
    if task:
        return f"your {task} cell (cell {index}), line {line}"
    return f"cell {index} ('{cells[index].title}'), line {line}"


def _error_text(error: dict, cells: dict[int, Cell]) -> str:
    where = f" at {_readable(error['where'], cells)}" if error.get("where") else ""
    return f"raised {error.get('type', 'an error')}: {error.get('message', '')}{where}"


def _diff(expected: str, actual: str, limit: int = 6) -> str:
    exp, act = expected.splitlines(), actual.splitlines()
    first = next((i for i, (e, a) in enumerate(zip(exp, act)) if e != a), min(len(exp), len(act)))
    lines = [f"first difference at output line {first + 1}:"]
    lines.append(f"      expected: {exp[first] if first < len(exp) else '(no more output)'}")
    lines.append(f"      actual:   {act[first] if first < len(act) else '(no more output)'}")
    if len(exp) > 1 or len(act) > 1:
        lines.append("      expected output:" + "".join(f"\n        | {x}" for x in exp[:limit]))
        lines.append("      actual output:" + "".join(f"\n        | {x}" for x in act[:limit]))
    return "\n".join(lines)


def score(assignment: Assignment, cells: list[Cell], result: dict, notebook: str,
          hidden: list[tuple[str, str, str]] = (), refused: dict[str, list[str]] | None = None) -> Report:
    """The report of one run. ``result`` is what the worker sent, untrusted: every check cell of
    ``cells`` and every hidden check of ``hidden`` ((label, function, task), found by the
    grader) that it does not report on fails; ``refused``: rules broken, by task."""
    report = Report(notebook, assignment.name)
    run = {c.task for c in cells if c.kind == "check"}
    scores = {t: TaskScore(t) for t in assignment.tasks if t in run}
    by_index = {c.index: c for c in cells}
    crash = result.get("crash") if isinstance(result, dict) else "the worker sent no results"
    missing = f"did not run: {crash}" if crash else "did not run: the submission's process reported nothing for it"
    outs = {o["index"]: o for o in _list(result, "cells")  # an index the worker made up is dropped
            if isinstance(o, dict) and type(o.get("index")) is int and o["index"] in by_index}
    for cell in cells:
        out = outs.get(cell.index)
        if out is None:
            if cell.kind == "check" and cell.task in scores:
                scores[cell.task].checks += 1
                _first(scores[cell.task], f"first failing check: '{cell.title}' (cell {cell.index})\n      {missing}")
            continue
        actual, error = assignment.clean(str(out.get("stdout", ""))), out.get("error")
        error = {k: str(v) for k, v in error.items()} if isinstance(error, dict) else None
        if str(out.get("student_stdout", "")).strip():
            report.student_output[f"cell {cell.index} ('{cell.title}')"] = str(out["student_stdout"])
        if cell.kind == "check" and cell.task in scores:
            s = scores[cell.task]
            s.checks += 1
            if error is None and actual == cell.expected:
                s.passed += 1
            else:
                what = _error_text(error, by_index) if error else _diff(cell.expected, actual)
                what += _because(assignment, cell, scores)
                _first(s, f"first failing check: '{cell.title}' (cell {cell.index})\n      {what}")
        elif cell.kind == "setup" and (error or (cell.expected is not None and actual != cell.expected)):
            what = _error_text(error, by_index) if error else _diff(cell.expected or "", actual)
            report.setup_mismatches.append(f"cell {cell.index} ('{cell.title}'): {what}")
        elif cell.kind == "solution" and error:
            report.notes.append(f"your {cell.task} cell (cell {cell.index}) {_error_text(error, by_index)}")
    reported = {(str(h.get("file")), str(h.get("name"))): h for h in _list(result, "hidden") if isinstance(h, dict)}
    broken = [h for h in reported.values() if str(h.get("name", "")).startswith("loading ")]
    for label, name, task in [*hidden, *((str(h["file"]), str(h["name"]), str(h.get("task"))) for h in broken)]:
        h = reported.get((label, name))
        s = scores.setdefault(task, TaskScore(task))
        s.hidden += 1
        if h is not None and h.get("error") is None:
            s.hidden_passed += 1
            continue
        doc = f" ({str(h['doc'])[:500]})" if h and h.get("doc") else ""
        why = _error_text({k: str(v) for k, v in h["error"].items()}, by_index) if h and isinstance(h.get("error"), dict) else missing
        s.failures.append(f"failing hidden check: {name}{doc}\n      {why}")
    for v in _list(result, "violations"):
        if not isinstance(v, dict):
            continue
        where = f" ({_readable(str(v.get('where')), by_index)})" if v.get("where") else ""
        message = f"your {v.get('task')} code {v.get('what')}{where}: the assignment forbids it"
        for task in str(v.get("task")).split("/"):
            s = scores.setdefault(task, TaskScore(task))
            if message not in s.library_use:
                s.library_use.append(message)
    for task, breaches in (refused or {}).items():
        scores.setdefault(task, TaskScore(task)).refused += breaches
    report.tasks = list(scores.values())
    report.notes += [n for n in _list(result, "notes") if isinstance(n, str)]
    return report


def _because(assignment: Assignment, check: Cell, scores: dict[str, TaskScore]) -> str:
    """' (because A2.3 failed: this check uses its SharedBlockTable)' when the check cell uses a
    name that the solution cell of an earlier task, failing so far, defines."""
    used = {n.id for n in ast.walk(ast.parse(check.source)) if isinstance(n, ast.Name)}
    for cell in assignment.cells:
        tasks = [t for t in cell.task.split("/") if t != check.task]
        failed = [t for t in tasks if t in scores and scores[t].passed < scores[t].checks]
        if cell.kind == "solution" and failed:
            names = sorted(used & set(bound_names(cell.source)))
            if names:
                return f"\n      (because {failed[0]} failed: this check uses its {', '.join(names)})"
    return ""


def _list(result, key: str) -> list:
    value = result.get(key) if isinstance(result, dict) else None
    return value if isinstance(value, list) else []


def _first(s: TaskScore, failure: str) -> None:
    """Keep a task's first failing visible check, ahead of its hidden ones."""
    if not any(f.startswith("first failing check") for f in s.failures):
        s.failures.insert(0, failure)
