"""Grading a batch of submissions (``pagedlab_course.grade.grade_many``): each notebook is read against
its reference, its solution cells checked against the rules, run in a sealed worker of its own,
and scored here, in the process where no student code runs. See the package's docstring."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import os
import secrets
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nbformat

from pagedlab_course.grade import rules, sandbox
from pagedlab_course.grade.notebook import (ASSIGNMENT, SOLUTIONS, Assignment, Submission, assemble, load,
                                            reference_for)
from pagedlab_course.grade.report import Report, score
from pagedlab_course.grade.supervise import supervise

HIDDEN = sandbox.HIDDEN


def grade_many(
    notebooks: list,
    *,
    extra_checks: list[Path] = (),
    solutions: Path = SOLUTIONS,
    tasks: list | None = None,
    cell_timeout: float = 300.0,
    timeout: float = 900.0,
    limits: sandbox.Limits = sandbox.Limits(),
    allow_unsealed: bool = False,
    seed: int | None = None,
) -> list[Report]:
    """Grade submitted notebooks (paths, or (path, tasks) pairs), each in a sealed process of
    its own, as many at a time as there are cores.

    ``tasks`` limits each run to those tasks' checks and stops after their last cell (for fast
    tests of single tasks); ``None`` grades everything. Without a working bubblewrap, a batch
    of more than one file is refused unless ``allow_unsealed``. ``seed`` (drawn now if None, and
    recorded in every report) is what hidden checks draw their cases from.
    """
    level, why = sandbox.probe()
    if level != "bwrap" and len(notebooks) > 1 and not allow_unsealed:
        raise Unsealed(f"bubblewrap is not working here ({why}), so every submission would run as your user, "
                       f"with only the static rules between it and your files and the other submissions: install "
                       f"bubblewrap (apt-get install bubblewrap), or pass --allow-unsealed to grade the batch anyway")
    checks = hidden_sources([HIDDEN, *extra_checks])
    seed = secrets.randbelow(2**31) if seed is None else seed
    plans = []
    for item in notebooks:
        path, only = (Path(item[0]), item[1]) if isinstance(item, tuple) else (Path(item), tasks)
        try:
            plans.append(_plan(path, only, checks, solutions, cell_timeout, seed))
        except (UnknownTask, ReferenceFailed):
            raise  # the instructor's mistake: nothing is graded
        except Exception as err:  # noqa: BLE001 - one file that cannot be read or checked is one row
            plans.append(_refused(path, err))
    jobs = [plan.job for plan in plans if isinstance(plan, Plan) and plan.job]
    protected = [*sandbox.PACKAGES, solutions, *extra_checks]
    before = _digest(protected)
    results = iter(_run(jobs, timeout, limits))
    changed = sorted(p for p, d in _digest(protected).items() if before.get(p) != d)
    if changed:
        raise RuntimeError(f"a submission changed the grader's files ({', '.join(changed)}): "
                           f"restore them; no grade of this batch can be trusted")
    reports = [plan if isinstance(plan, Report) else _scored(plan, next(results) if plan.job else None) for plan in plans]
    for report in reports:
        report.sandbox, report.seed = level, seed
    return reports


class UnknownTask(ValueError):
    """A task the assignment does not have was asked for: the instructor's mistake, not a file's."""


class Unsealed(ValueError):
    """A batch would run without bubblewrap, and the instructor did not ask for that."""


class ReferenceFailed(RuntimeError):
    """A hidden check's reference failed in the grader's process: the instructor's mistake."""


class Unreadable(ValueError):
    """The file is not a notebook of a known assignment; the message says why."""


class Unchecked(ValueError):
    """A solution cell the rules could not be checked on (nested too deeply to parse, say)."""


@dataclass
class Plan:
    """A readable submission: what it runs (``job``, None if it is refused) and what scores it."""

    assignment: Assignment
    submission: Submission
    cells: list
    name: str
    only: list | None
    breaches: dict
    expected: list
    job: dict | None


def _plan(path: Path, only: list | None, checks: list[dict], solutions: Path, cell_timeout: float,
          seed: int) -> Plan:
    """Read one submission against its reference and check its cells: what its worker runs."""
    try:
        nb = nbformat.read(path, as_version=4)
        assignment = load(reference_for(path, nb, solutions))
        submission = assemble(assignment, nb)
    except Exception as err:  # noqa: BLE001
        why = str(err) if isinstance(err, ValueError) and path.name in str(err) else f"{type(err).__name__}: {err}"
        raise Unreadable(f"unreadable: {why}") from err
    unknown = sorted(set(only or ()) - set(assignment.tasks))
    if unknown:
        raise UnknownTask(f"{path.name}: {assignment.name} has no task {', '.join(unknown)}; "
                          f"its tasks are {', '.join(assignment.tasks)}")
    cells, breaches = _checked(assignment, _selected(assignment, submission.cells, only))
    hidden = [h for h in checks if _for(h["file"], assignment.name)]
    expected = [(h["label"], name, task) for h in hidden for name, task, _ in h["checks"] if not only or task in only]
    interface = _interface(assignment)
    job = None if submission.refusals else {
        "assignment": assignment.name,
        "cells": [{"index": c.index, "kind": c.kind, "task": c.task, "source": c.source,
                   **({"names": interface[c.index]} if c.kind == "solution" else {})} for c in cells],
        "forbid": _forbidden(tuple(assignment.forbid)),
        "hidden": [{"label": h["label"], "source": h["source"],
                    "references": {name: json.loads(_reference(h["label"], h["source"], name, seed))
                                   for name, task, referenced in h["checks"] if referenced and (not only or task in only)}}
                   for h in hidden],
        "only": only,
        "cell_timeout": cell_timeout,
    }
    return Plan(assignment, submission, cells, path.name, only, breaches, expected, job)


def _interface(assignment: Assignment) -> dict[int, list[str]]:
    """The names each reference solution cell binds that the checks may take from the student
    (not a setup cell's or a check's, which the judge keeps), by cell index."""
    protected = assignment.protected
    return {c.index: sorted(set(rules.bound_names(c.source)) - set(protected))
            for c in assignment.cells if c.kind == "solution"}


@functools.lru_cache(maxsize=None)
def _forbidden(names: tuple[str, ...]) -> dict[str, list[str]]:
    return sandbox.forbidden(list(names))


def _refused(path: Path, err: Exception) -> Report:
    """The row of a file that could not be read or checked: why, naming the file."""
    match = ASSIGNMENT.match(path.name)
    why = str(err) if isinstance(err, (Unreadable, Unchecked)) else f"could not be graded: {type(err).__name__}: {err}"
    return Report(path.name, match[1] if match else "?", refused=[why])


def _scored(plan: Plan, result: dict | None) -> Report:
    """The report of a planned file; whatever its untrusted results make scoring raise is its refusal."""
    if plan.job is None:
        return Report(plan.name, plan.assignment.name, refused=plan.submission.refusals, notes=plan.submission.notes)
    try:
        report = score(plan.assignment, plan.cells, result, plan.name, plan.expected, plan.breaches)
    except Exception as err:  # noqa: BLE001 - a forged result no validation foresaw ends one row, never the batch
        return Report(plan.name, plan.assignment.name,
                      refused=[f"its results could not be scored: {type(err).__name__}: {err}"])
    only = plan.only
    keep = set(only or ()) | {plan.assignment.name} if only else None  # a broken check file fails "A2"
    report.tasks = [t for t in report.tasks if keep is None or t.task in keep and (t.task in only or not t.ok)]
    report.notes[:0] = plan.submission.notes
    return report


def grade(notebook, **options) -> Report:
    """Grade one submission; see :func:`grade_many`."""
    return grade_many([notebook], **options)[0]


def _selected(assignment: Assignment, cells: list, tasks: list | None) -> list:
    """The cells up to the last check of ``tasks`` (all of them if ``tasks`` is None)."""
    if tasks is None:
        return cells
    last = max((i for i, c in enumerate(cells) if c.kind == "check" and c.task in tasks), default=len(cells) - 1)
    return cells[: last + 1]


def _checked(assignment: Assignment, cells: list) -> tuple[list, dict[str, list[str]]]:
    """The cells, each solution cell that breaks a rule emptied (it is not run), and the
    refusals by task: 'your A2.1 cell (cell 4), line 3: `sys` (no introspection ...)'."""
    protected, out, breaches = assignment.protected, [], {}
    for cell in cells:
        try:
            found = rules.check(cell.source, forbid=assignment.forbid, protected=protected) if cell.kind == "solution" else []
        except Exception as err:  # noqa: BLE001 - RecursionError, MemoryError: the parser's limits
            raise Unchecked(f"your {cell.task} cell (cell {cell.index}) could not be checked: {type(err).__name__}: "
                            f"{err} (the parser's limit; write it with less nesting)") from err
        if found:
            for task in cell.task.split("/"):
                breaches.setdefault(task, []).extend(
                    f"your {cell.task} cell (cell {cell.index}), {b.text()}: it was not run" for b in found)
            cell = type(cell)(cell.index, cell.kind, "", cell.task, cell.expected, cell.cell_id, cell.tags)
        out.append(cell)
    return out, breaches


def _for(file: str, assignment: str) -> bool:
    """Whether a check file belongs to the assignment: A2.py, A2_more.py; not A20.py."""
    stem = file.removesuffix(".py")
    return stem.startswith(assignment) and not stem[len(assignment):][:1].isdigit()


def hidden_sources(dirs: list[Path]) -> list[dict]:
    """Every hidden-check file of the directories, read now (the submission never sees the
    files): a label that shows no path, its text, and what :func:`_marked` finds in it."""
    found = []
    for n, d in enumerate(dirs):
        for path in sorted(Path(d).glob("A*.py")):
            source = path.read_text()
            owner = "pagedlab" if n == 0 else "instructor" + (f" {n}" if len(dirs) > 2 else "")
            found.append({"label": f"<{owner} check {path.name}>", "file": path.name, "source": source, "checks": _marked(source)})
    return found


@functools.lru_cache(maxsize=None)
def _trusted(label: str, source: str) -> types.ModuleType:
    """A hidden-check file executed here, where no student code runs, to compute references."""
    module = types.ModuleType(label)
    exec(compile(source, label, "exec"), module.__dict__)
    return module


@functools.lru_cache(maxsize=None)
def _reference(label: str, source: str, check: str, seed: int = 0) -> str:
    """The value (as JSON) of the ``reference`` a hidden check names, computed here once per file,
    check and seed in a grader's process (a batch, or a whole test session); a reference with a
    parameter gets the batch's seed."""
    fn = getattr(_trusted(label, source), check).__grade_reference__
    try:
        return json.dumps(fn(seed) if inspect.signature(fn).parameters else fn())
    except Exception as err:  # noqa: BLE001 - an instructor's error, named, before any grading
        raise ReferenceFailed(f"{label}: the reference {fn.__name__} of {check} failed: "
                              f"{type(err).__name__}: {err}") from err


def _marked(source: str) -> list[tuple[str, str, bool]]:
    """(function, task, whether it names a reference) of each function decorated with
    ``@task("...")``, read statically."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in tree.body:
        for dec in getattr(node, "decorator_list", []):
            if (isinstance(dec, ast.Call) and getattr(dec.func, "id", getattr(dec.func, "attr", None)) == "task"
                    and dec.args and isinstance(dec.args[0], ast.Constant)):
                found.append((node.name, dec.args[0].value, any(k.arg == "reference" for k in dec.keywords)))
    return found


def _digest(dirs: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for d in dirs for p in sorted(Path(d).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def _run(jobs: list[dict], timeout: float, limits: sandbox.Limits) -> list[dict]:
    """Each job's results, from a sealed worker process of its own, as many at a time as there are cores."""

    def one(job):
        try:
            return supervise(job, timeout, limits)
        except Exception as err:  # noqa: BLE001 - the grader's side failed for this file alone
            return {"crash": f"the grader could not run it: {type(err).__name__}: {err}"}

    parallel = max(1, min(len(jobs), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(one, jobs))
