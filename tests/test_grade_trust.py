"""The grader's trust boundary (issue 25): the cheats of tests/grade_cheats.py get the grade
their code deserves, in a batch with an honest neighbour that is graded as when alone, and the
package, the references and an instructor's checks are byte-identical after grading them."""

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import grade_cheats as cheats
import wheels
from pagedlab_course.grade import HIDDEN, grade_many
from pagedlab_course.grade.notebook import SOLUTIONS

PACKAGE = HIDDEN.parents[1]
SECRET = "the instructor writes this line for nobody else"


def digest(*dirs: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in dirs for p in sorted(d.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def nothing_earned(report) -> bool:
    """0 for every task, counted against every check of the assignment (never '0/0')."""
    return (not report.passed and report.tasks and all(not t.ok for t in report.tasks)
            and sum(t.passed + t.hidden_passed for t in report.tasks) == 0
            and sum(t.checks for t in report.tasks) >= 15)


def flagged(report, task) -> bool:
    t = report.task(task)
    return not t.ok and bool(t.library_use or t.refused)


@pytest.mark.slow
def test_cheats_get_what_their_code_deserves_and_touch_nothing(tmp_path):
    solution = nbformat.read(next(SOLUTIONS.glob("A2_*.ipynb")), as_version=4)
    instructor = tmp_path / "instructor"
    instructor.mkdir()
    (instructor / "A2_private.py").write_text(
        "from pagedlab_course.grade import task\n\n\n"
        "@task('A2.1')\n"
        "def check_private(nb):\n"
        "    'A fresh pool of 3 has 3 free blocks.'\n"
        f"    assert nb.Allocator(3).num_free == 3  # {SECRET}\n"
    )
    cases = {  # label: (notebook, what its report must satisfy)
        "runner replaced": (cheats.cheat(solution, {"A2.1": cheats.RUNNER}), nothing_earned),
        "no results": (cheats.cheat(solution, {"A2.1": cheats.EMPTY}), nothing_earned),
        "kills its parent": (cheats.cheat(solution, {"A2.1": cheats.KILL_PARENT}), nothing_earned),
        "tampers with files": (cheats.cheat(solution, {"A2.1": cheats.TAMPER}),
                               lambda r: nothing_earned(r) and SECRET not in r.text() and SECRET not in str(r.as_dict())),
        "runs the reference": (cheats.cheat(solution, {"*": cheats.REFERENCE}), nothing_earned),
        "unwrapped library": (cheats.cheat(solution, {"A2.1": cheats.WRAPPED}), lambda r: flagged(r, "A2.1")),
        "compiled as setup": (cheats.cheat(solution, {"A2.1": cheats.SETUP_NAME}), lambda r: flagged(r, "A2.1")),
        "attribution off": (cheats.cheat(solution, {"A2.1": cheats.UNATTRIBUTED}), lambda r: flagged(r, "A2.1")),
        "honest neighbour": (solution, lambda r: r.passed),
    }
    paths = []
    for i, (label, (nb, _)) in enumerate(cases.items()):
        paths.append(tmp_path / f"A2_{i}.ipynb")
        nbformat.write(nb, paths[-1])
    before = digest(PACKAGE, SOLUTIONS, instructor)
    reports = grade_many(paths, extra_checks=[instructor])
    after = digest(PACKAGE, SOLUTIONS, instructor)
    changed = [p for p in before if before[p] != after.get(p)]
    assert not changed, f"grading changed {changed}"
    wrong = [f"{label}:\n{r.text()}" for (label, (_, must)), r in zip(cases.items(), reports) if not must(r)]
    assert not wrong, "\n\n".join(wrong)


@pytest.mark.slow
def test_helpers_and_inputs_a_submission_controls_earn_it_nothing(tmp_path):
    """Deliver 3: hidden checks called helpers of the notebook (a later cell could rebind them)
    and computed the reference from a list the student's code had been given (and could empty).
    Each cheat implements nothing its hidden check tests, and keeps the rules."""
    cases = [("A3", {"A3.4": cheats.EMPTIES_ITS_INPUT["A3"]}, ["A3.4"], "A3.4"),
             ("A5", {"A5.4": cheats.EMPTIES_ITS_INPUT["A5"]}, ["A5.4"], "A5.4"),
             ("A6", {"A6.2": cheats.FAKE_SCHEDULER}, ["A6.1", "A6.2"], "A6.1")]
    paths = []
    for name, sources, tasks, _ in cases:
        paths.append((tmp_path / f"{name}_cheat.ipynb", tasks))
        nbformat.write(cheats.cheat(nbformat.read(next(SOLUTIONS.glob(f"{name}_*.ipynb")), as_version=4), sources),
                       paths[-1][0])
    wrong = [report.text() for (name, _, _, task), report in zip(cases, grade_many(paths))
             if report.refused or report.task(task).refused or report.task(task).library_use
             or not report.task(task).hidden or report.task(task).hidden_passed]
    assert not wrong, "\n\n".join(wrong)


@pytest.mark.slow
def test_a_batch_grades_every_readable_file_and_gives_the_others_a_row(tmp_path):
    """Finding 7: a truncated file, metadata naming an unknown assignment, and an A1 notebook
    saved under A2's name each get a row of their own; the readable neighbour is graded."""
    a1 = next(SOLUTIONS.glob("A1_*.ipynb"))
    batch = tmp_path / "batch"
    batch.mkdir()
    (batch / "A1_good.ipynb").write_bytes(a1.read_bytes())
    (batch / "A1_truncated.ipynb").write_bytes(a1.read_bytes()[:5000])
    unknown = nbformat.read(a1, as_version=4)
    unknown.metadata["pagedlab"]["assignment"] = "A9"
    nbformat.write(unknown, batch / "A1_unknown.ipynb")
    (batch / "A2_actually_A1.ipynb").write_bytes(a1.read_bytes())
    gradebook, report = tmp_path / "grades.csv", tmp_path / "grades.json"
    done = subprocess.run([sys.executable, "-m", "pagedlab_course.grade", str(batch), "--task", "A1.1", "--csv", str(gradebook),
                           "--json", str(report)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {row["notebook"]: row for row in csv.DictReader(gradebook.open())}
    assert sorted(rows) == ["A1_good.ipynb", "A1_truncated.ipynb", "A1_unknown.ipynb", "A2_actually_A1.ipynb"]
    assert rows["A1_good.ipynb"]["status"] == "passed" and rows["A1_good.ipynb"]["checks passed"] != "0"
    assert {row["sandbox"] for row in rows.values()} == {"bwrap"}  # .ci/run installs bubblewrap
    assert rows["A1_truncated.ipynb"]["status"] == "refused" and "unreadable" in rows["A1_truncated.ipynb"]["why"]
    assert "the notebook is A9's" in rows["A1_unknown.ipynb"]["why"]
    assert "the file name says A2 but the notebook is A1's" in rows["A2_actually_A1.ipynb"]["why"]
    assert len(json.loads(report.read_text())) == 4


@pytest.mark.slow
def test_a_course_handed_out_as_a_wheel_is_graded_outside_the_repository(tmp_path):
    """Deliver 6: the instructors' section of notebooks/README.md, followed from a wheel, in a
    directory with no checkout: the references come from --solutions, and without it the
    grader says so."""
    handout = (SOLUTIONS.parents[1] / "notebooks" / "README.md").read_text()
    # what the section tells instructors to build and students to install: both wheels, the
    # ones built here (the test installs them without their PyPI dependencies, which this
    # environment has)
    assert "pip wheel . ./course --no-deps -w dist" in handout
    assert "pip install dist/pagedlab-*.whl dist/pagedlab_course-*.whl" in handout
    assert "--index-url https://download.pytorch.org/whl/cpu" in handout
    site = wheels.install(tmp_path, "pagedlab", "pagedlab-course")
    course = tmp_path / "course"
    shutil.copytree(SOLUTIONS, course / "solutions")
    shutil.copy(SOLUTIONS.parent / "sanitize.cfg", course / "sanitize.cfg")
    grading = tmp_path / "grading"
    grading.mkdir()
    shutil.copy(next(SOLUTIONS.glob("A1_*.ipynb")), grading / "A1_mine.ipynb")
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import pagedlab; print(pagedlab.__file__)"], cwd=grading, env=env,
                           capture_output=True, text=True, timeout=300)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr

    def grade(*extra):
        return subprocess.run([sys.executable, "-m", "pagedlab_course.grade", "A1_mine.ipynb", "--task", "A1.1", *extra],
                              cwd=grading, env=env, capture_output=True, text=True, timeout=900)

    without = grade()
    assert without.returncode == 1 and "no reference for assignment A1" in without.stdout
    assert "--solutions" in without.stdout
    done = grade("--solutions", str(course / "solutions"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("A1 (A1_mine.ipynb): 1/1 tasks passed")


@pytest.mark.slow
def test_no_file_stops_a_batch_and_its_neighbour_is_graded_as_alone(tmp_path, monkeypatch):
    """Issue 46, item 3 (the review's C11, C12): a report with a list where a cell's index
    belongs (TypeError in scoring), one nested past the JSON parser's depth, and a cell of 5,000
    minus signs (RecursionError in the rules check) each ended the batch with no gradebook."""
    cheats.let_past_the_rules(monkeypatch)
    a1 = nbformat.read(next(SOLUTIONS.glob("A1_*.ipynb")), as_version=4)
    paths = {}
    for label, source in [("honest", None), ("minus", cheats.MINUS_SIGNS), ("index", cheats.FORGED_INDEX),
                          ("nested", cheats.NESTED_REPORT)]:
        paths[label] = tmp_path / f"A1_{label}.ipynb"
        nbformat.write(cheats.cheat(a1, {"A1.1": source}) if source else a1, paths[label])
    batch = dict(zip(paths, grade_many(list(paths.values()), tasks=["A1.1"], seed=7)))
    alone = grade_many([paths["honest"]], tasks=["A1.1"], seed=7)[0]
    assert batch["honest"].as_dict() == alone.as_dict() and alone.passed
    (why,) = batch["minus"].refused
    assert why.startswith("your A1.1 cell (cell 4) could not be checked: RecursionError: maximum recursion depth"), why
    for label in ("index", "nested"):
        report = batch[label]
        assert not report.passed and report.task("A1.1").passed + report.task("A1.1").hidden_passed == 0, report.text()


@pytest.mark.slow
def test_a_result_that_compares_equal_to_anything_fails_the_hidden_check(tmp_path, monkeypatch):
    """The review's C05: A5.4's hidden check compared the student's values with `!=`, which
    Python answers with the student's own `__ne__`; it compares plain data now. (The rules refuse
    `dict(__eq__=...)` since; the cell is let past them, so that the comparison is what is tested.)"""
    cheats.let_past_the_rules(monkeypatch)
    a5 = nbformat.read(next(SOLUTIONS.glob("A5_*.ipynb")), as_version=4)
    nbformat.write(cheats.cheat(a5, {"A5.4": "# PAST_THE_RULES\n" + cheats.AGREES_WITH_EVERYTHING}),
                   tmp_path / "A5_anything.ipynb")
    report = grade_many([tmp_path / "A5_anything.ipynb"], tasks=["A5.4"])[0]
    assert not report.refused and report.task("A5.4").hidden == 1 and report.task("A5.4").hidden_passed == 0, report.text()
    assert "expected plain data" in report.text()


def lookup_table(seed: int) -> str:
    """A5.4's serve as a table of the library's answers to the hidden workloads drawn from
    ``seed``: what the review's C06 built from the public workloads, offline."""
    from pagedlab_course.grade.batch import _reference

    source = (HIDDEN / "A5.py").read_text()
    served = json.loads(_reference("<pagedlab check A5.py>", source, "check_other_workloads_beside_the_library", seed))
    table = {repr(item["case"][1]): {**item["expected"], "leaked": (0, 0)} for item in served}
    return (f"TABLE = {table!r}\n\n\ndef serve(workload, num_gpu_blocks, block_size=4, num_cpu_blocks=0, **config):\n"
            f"    return TABLE[repr([[rid, list(p), m] for rid, p, m in workload])]\n")


@pytest.mark.slow
def test_hidden_workloads_are_drawn_from_a_seed_each_report_records(tmp_path):
    """Issue 46, item 2 (the review's C06): serve as a lookup table of the public hidden workloads
    passed A5.4's hidden check. They are drawn at grading time from a seed the grader picks and
    records: a table made for one seed earns nothing at another, and the seed reproduces a grade."""
    path = tmp_path / "A5_table.ipynb"
    a5 = nbformat.read(next(SOLUTIONS.glob("A5_*.ipynb")), as_version=4)
    nbformat.write(cheats.cheat(a5, {"A5.4": lookup_table(1)}), path)
    made_for, other = (grade_many([path], tasks=["A5.4"], seed=seed)[0] for seed in (1, 2))
    assert made_for.seed == 1 and made_for.task("A5.4").hidden_passed == 1, made_for.text()
    assert other.seed == 2 and other.task("A5.4").hidden_passed == 0, other.text()
    drawn = {grade_many([tmp_path / "A5_missing.ipynb"])[0].seed for _ in range(2)}
    assert len(drawn) == 2 and None not in drawn


def earned_nothing(report) -> bool:
    """0 for every task, every check counted (never '0/0')."""
    return (not report.refused and report.tasks and all(not t.ok for t in report.tasks)
            and sum(t.passed + t.hidden_passed for t in report.tasks) == 0 and sum(t.checks for t in report.tasks) > 0)


def solved_but(name: str, task: str, source: str) -> nbformat.NotebookNode:
    """The reference solution with the solution cell of ``task`` replaced by ``source``."""
    nb = nbformat.read(next(SOLUTIONS.glob(f"{name}_*.ipynb")), as_version=4)
    next(c for c in nb.cells if f"### BEGIN SOLUTION {task}:" in c.source).source = source
    return nb


PRIVATE = {  # an instructor's checks, each failing when its task is not implemented
    "A2": ("A2.1", "assert nb.Allocator(3).allocate(2) == [0, 1]"),
    "A5": ("A5.1", "s = nb.MiniScheduler(KVCacheManager(8, 4), 2, 16)\n    s.add('r', [1, 2, 3], 2)\n"
                   "    step = nb.Step(0)\n    s.admit(step)\n    assert [r.rid for r in step.prefills] == ['r']"),
    "A7": ("A7.1", "t = nb.Table(nb.Pool(4), 2)\n    assert nb.append_tokens(t, [1, 2, 3]) is None and t.blocks == [0, 1]"),
}


@pytest.mark.slow
def test_cheats_in_the_submissions_process_earn_nothing_and_never_see_a_check(tmp_path, monkeypatch):
    """Issue 46, item 1 (the review's C01, C02, C25, C23, C24, C03, C04): the checks ran in the
    submission's interpreter, so a cell could rewrite the worker (C01, and C25 as pickled bytes),
    write a forged report to its pipe (C02), read the instructor's check source from a frame
    (C23), rebind the checks' `error` (C24), or call the forbidden library from C code that the
    setup's `error` or a thread ran (C03, C04). With nothing implemented the first three got full
    marks, private checks included. The judge runs the checks in a process of its own now. The
    rules refuse most of these spellings since (C27, C28: test_grade_rules.py); each is let past
    them here, as a spelling the rules do not know would be, so that the judge is what is tested."""
    from pagedlab_course.grade.batch import hidden_sources

    cheats.let_past_the_rules(monkeypatch)
    past = "# PAST_THE_RULES\n"

    instructor = tmp_path / "instructor"
    instructor.mkdir()
    for name, (task, body) in PRIVATE.items():
        (instructor / f"{name}_private.py").write_text(
            "from pagedlab.memory import KVCacheManager\nfrom pagedlab_course.grade import task\n\n\n"
            f"@task({task!r})\ndef check_private(nb):\n    # {SECRET}\n    {body}\n")
    solution = {name: nbformat.read(next(SOLUTIONS.glob(f"{name}_*.ipynb")), as_version=4) for name in PRIVATE}
    public = [(h["label"], check, task) for h in hidden_sources([HIDDEN]) if h["file"].startswith("A7")
              for check, task, _ in h["checks"]]
    a71 = next(c.source for c in solution["A7"].cells if "### BEGIN SOLUTION A7.1:" in c.source)
    a21 = next(c.source for c in solution["A2"].cells if "### BEGIN SOLUTION A2.1:" in c.source)
    for old, new in cheats.WRONG_ERRORS:
        a21 = a21.replace(old, new)
    leaked = lambda r: SECRET in r.text() or SECRET in json.dumps(r.as_dict())  # noqa: E731
    cases = {  # label: (notebook, what its report must satisfy)
        "C01 rewrites the worker": (cheats.cheat(solution["A7"], {"A7.1": past + cheats.forges_the_runner(solution["A7"])}),
                                    earned_nothing),
        "C02 writes a forged report": (cheats.cheat(solution["A7"], {
            "A7.1": past + cheats.writes_a_forged_report(solution["A7"], public)}), earned_nothing),
        "C25 pickled": (cheats.cheat(solution["A5"], {"A5.1": past + cheats.pickled(solution["A5"])}), earned_nothing),
        "C23 reads the checks": (solved_but("A7", "A7.1", past + a71 + cheats.READS_THE_CHECKS),
                                 lambda r: r.passed and not leaked(r)),
        "C24 renames the errors": (solved_but("A2", "A2.1", past + a21 + cheats.RENAMES_ERRORS),
                                   lambda r: r.task("A2.1").passed < r.task("A2.1").checks and not r.task("A2.1").ok),
        "C03 through the setup's error": (solved_but("A2", "A2.1", past + cheats.LAUNDERED_THROUGH_SETUP),
                                          lambda r: flagged(r, "A2.1") and r.task("A2.1").hidden_passed == 0),
        "C04 on a thread": (solved_but("A2", "A2.1", past + cheats.ON_A_THREAD),
                            lambda r: flagged(r, "A2.1") and r.task("A2.1").hidden_passed == 0),
    }
    paths = []
    for i, (label, (nb, _)) in enumerate(cases.items()):
        paths.append(tmp_path / f"{nb.metadata['pagedlab']['assignment']}_{i}.ipynb")
        nbformat.write(nb, paths[-1])
    reports = grade_many(paths, extra_checks=[instructor])
    wrong = [f"{label}:\n{r.text()}" for (label, (_, must)), r in zip(cases.items(), reports) if not must(r) or leaked(r)]
    assert not wrong, "\n\n".join(wrong)


@pytest.mark.slow
def test_a_message_utf8_cannot_write_costs_no_gradebook(tmp_path):
    """Found reviewing the channel: an error message with a lone surrogate reached the report's
    text, and printing it raised UnicodeEncodeError after the batch was graded: no CSV, no JSON,
    for anyone. The grader keeps it as an escape (``\\ud800``), which every output can write."""
    batch = tmp_path / "batch"
    batch.mkdir()
    a1 = next(SOLUTIONS.glob("A1_*.ipynb"))
    shutil.copy(a1, batch / "A1_honest.ipynb")
    nbformat.write(cheats.cheat(nbformat.read(a1, as_version=4), {"A1.1": cheats.LONE_SURROGATE}),
                   batch / "A1_surrogate.ipynb")
    gradebook, report = tmp_path / "grades.csv", tmp_path / "grades.json"
    done = subprocess.run([sys.executable, "-m", "pagedlab_course.grade", str(batch), "--task", "A1.1",
                           "--csv", str(gradebook), "--json", str(report)], capture_output=True, timeout=900)
    assert done.returncode == 1 and b"Traceback" not in done.stderr, done.stderr.decode(errors="replace")[-2000:]
    rows = {row["notebook"]: row for row in csv.DictReader(gradebook.open())}
    assert rows["A1_honest.ipynb"]["status"] == "passed" and rows["A1_surrogate.ipynb"]["status"] == "failed"
    assert b"no stats \\ud800 for you" in done.stdout
    assert "no stats \\\\ud800 for you" in report.read_text()  # the escape's backslash, escaped by JSON
