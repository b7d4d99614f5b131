"""The process a submission runs in (pagedlab_course.grade.sandbox), at each level: what it can see and
change, and the digest check that stands in for the sealed level where bubblewrap cannot run."""

import json
import os
import shutil
import subprocess
import sys

from pathlib import Path

import nbformat
import pytest

from pagedlab_course.grade import grade_many, rules, sandbox
from pagedlab_course.grade.notebook import SOLUTIONS

PROBE = """
import json, os
seen = {}
for name, path in {'solutions': %r, 'hidden': %r}.items():
    try:
        seen[name] = sorted(os.listdir(path))
    except OSError as e:
        seen[name] = type(e).__name__
try:
    open(%r, 'a').close()
    seen['write package'] = 'written'
except OSError as e:
    seen['write package'] = type(e).__name__
seen['cwd'], seen['ppid'], seen['env'] = os.getcwd(), os.getppid(), sorted(os.environ)
print(json.dumps(seen))
"""


def probe() -> dict:
    script = PROBE % (str(SOLUTIONS), str(sandbox.HIDDEN), str(sandbox.PACKAGES[1] / "grade" / "__init__.py"))
    status, out, err = sandbox.run([sys.executable, "-c", script], "", 120)
    assert status == 0, err
    return json.loads(out)


@pytest.fixture
def level(monkeypatch, request):
    """Run under the level named by the test's parameter (``process`` is forced by the
    environment variable the README documents)."""
    if request.param == "process":
        monkeypatch.setenv("PAGEDLAB_GRADE_SANDBOX", "process")
    sandbox.probe.cache_clear()
    yield sandbox.level()
    sandbox.probe.cache_clear()


@pytest.mark.parametrize("level", ["best"], indirect=True)
def test_sealed_worker_sees_neither_references_nor_hidden_checks_and_writes_nothing(level):
    if level != "bwrap":
        pytest.skip("bubblewrap cannot create namespaces here (.ci/run installs it)")
    seen = probe()
    assert seen["solutions"] == "FileNotFoundError" and seen["hidden"] == []
    assert seen["write package"] == "OSError" and seen["cwd"] == "/scratch"
    assert seen["ppid"] in (0, 1)  # its own pid namespace: the grader is not there to signal


@pytest.mark.parametrize("level", ["process"], indirect=True)
def test_fallback_runs_in_an_empty_scratch_directory_with_a_clean_environment(level, monkeypatch):
    assert level == "process"
    monkeypatch.setenv("A_GRADER_SECRET", "x")
    seen = probe()
    assert "A_GRADER_SECRET" not in seen["env"] and "pagedlab-grade-" in seen["cwd"]


TAMPER = "with open(%r, 'a') as f:\n    f.write('\\n')\n"


@pytest.mark.slow
@pytest.mark.parametrize("level", ["best", "process"], indirect=True)
def test_a_cell_that_gets_past_the_rules_and_writes_a_reference(level, tmp_path, monkeypatch):
    """With the rules switched off, a cell appends to the reference notebook: the sealed level
    never lets it see the file; the fallback notices the change and refuses the batch."""
    solutions = tmp_path / "solutions"
    shutil.copytree(SOLUTIONS, solutions)
    target = next(solutions.glob("A1_*.ipynb"))
    before = target.read_bytes()
    nb = nbformat.read(target, as_version=4)
    cell = next(c for c in nb.cells if "### BEGIN SOLUTION A1.1" in c.source)
    cell.source += "\n" + TAMPER % str(target)
    nbformat.write(nb, tmp_path / "A1_tamper.ipynb")
    monkeypatch.setattr(rules, "check", lambda *args, **kwargs: [])
    if level == "bwrap":
        report = grade_many([(tmp_path / "A1_tamper.ipynb", ["A1.1"])], solutions=solutions)[0]
        assert target.read_bytes() == before and "FileNotFoundError" in "\n".join(report.notes)
    else:
        with pytest.raises(RuntimeError, match="changed the grader's files"):
            grade_many([(tmp_path / "A1_tamper.ipynb", ["A1.1"])], solutions=solutions)


def test_a_worker_that_reports_nothing_earns_nothing_for_every_check():
    """Finding 1: an empty result was '0/0 checks', a pass. The parent counts the checks."""
    from pagedlab_course.grade.notebook import load
    from pagedlab_course.grade.report import score

    assignment = load(next(SOLUTIONS.glob("A2_*.ipynb")))
    hidden = [("<pagedlab check A2.py>", "check_allocator_random_runs", "A2.1")]
    for result in ({"cells": [], "hidden": [], "violations": []}, {"crash": "it died"}, {"cells": "nonsense"}, None):
        report = score(assignment, assignment.cells, result, "A2_x.ipynb", hidden)
        assert not report.passed and sum(t.passed + t.hidden_passed for t in report.tasks) == 0
        assert sum(t.checks for t in report.tasks) == 15 and report.task("A2.1").hidden == 1


@pytest.mark.slow
@pytest.mark.parametrize("level", ["best"], indirect=True)
def test_a_cell_that_gets_past_the_rules_and_kills_its_parent_harms_no_neighbour(level, tmp_path, monkeypatch):
    if level != "bwrap":
        pytest.skip("without namespaces only the rules stop this; it would kill the test run")
    import grade_cheats

    a1 = nbformat.read(next(SOLUTIONS.glob("A1_*.ipynb")), as_version=4)
    nbformat.write(grade_cheats.cheat(a1, {"A1.1": grade_cheats.KILL_PARENT}), tmp_path / "A1_kill.ipynb")
    nbformat.write(a1, tmp_path / "A1_honest.ipynb")
    monkeypatch.setattr(rules, "check", lambda *args, **kwargs: [])
    cheat, honest = grade_many([tmp_path / "A1_kill.ipynb", tmp_path / "A1_honest.ipynb"], tasks=["A1.1"])
    assert cheat.task("A1.1").passed == 0 and cheat.task("A1.1").checks > 0 and not cheat.passed
    assert honest.passed  # its parent, in the sandbox, is bwrap's pid 1, which ignores the signal


PATCHES_THE_LIBRARY = """

_block_stats = block_stats


def block_stats(x, block_size):
    lib = torch
    lib.equal = lambda *args, **kwargs: True
    return _block_stats(x, block_size)
"""
ASKS_FOR_A_PATCH = """from pagedlab_course.grade import task
import torch


@task("A1.1")
def check_the_judges_library(nb):
    nb.block_stats(torch.zeros(4), 2)
    assert not torch.equal(torch.zeros(1), torch.ones(1)), "the judge's torch.equal says yes to anything"
"""


@pytest.mark.slow
def test_a_library_patched_in_the_submissions_process_changes_nothing_the_judge_compares_with(tmp_path):
    """The rules see `torch.equal = ...` but not `lib = torch; lib.equal = ...`. The worker used to
    compare the libraries' functions before and after each cell to catch it; since issue 46 the
    checks compare with the judge's own torch, which no code of the submission's process reaches."""
    a1 = nbformat.read(next(SOLUTIONS.glob("A1_*.ipynb")), as_version=4)
    next(c for c in a1.cells if "### BEGIN SOLUTION A1.1" in c.source).source += PATCHES_THE_LIBRARY
    nbformat.write(a1, tmp_path / "A1_patch.ipynb")
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "A1_patch.py").write_text(ASKS_FOR_A_PATCH)
    report = grade_many([tmp_path / "A1_patch.ipynb"], tasks=["A1.1"], extra_checks=[tmp_path / "checks"])[0]
    assert report.passed and report.task("A1.1").hidden == 2, report.text()


# -- issue 46: limits enforced from outside the student's code, and the level in every report ---


def a1_cheats(tmp_path, **sources) -> dict:
    """A1 notebooks whose A1.1 cell (cell 4) is each source, written to tmp_path; label: path."""
    import grade_cheats

    a1 = nbformat.read(next(SOLUTIONS.glob("A1_*.ipynb")), as_version=4)
    paths = {label: tmp_path / f"A1_{label}.ipynb" for label in sources}
    for label, source in sources.items():
        nbformat.write(grade_cheats.cheat(a1, {"A1.1": source}), paths[label])
    return paths


@pytest.mark.slow
def test_each_resource_a_cell_takes_costs_at_most_its_limit_and_the_report_names_it(tmp_path, monkeypatch):
    """The review's C13 (200 MB printed: a 200 MB report), C08 (3 GB allocated, no limit), a
    file written past its size, a flood of its pipe, 40 processes forked: each stopped or cut."""
    import grade_cheats as cheats

    cheats.let_past_the_rules(monkeypatch)
    paths = a1_cheats(tmp_path, prints=cheats.PRINTS_200_MB, floods=cheats.FLOODS_THE_RESULTS,
                      allocates=cheats.ALLOCATES_3_GB, file=cheats.WRITES_A_BIG_FILE, forks=cheats.FORKS)
    limits = sandbox.Limits(memory_mb=1024, file_mb=1, processes=8, output_mb=1)
    reports = dict(zip(paths, grade_many(list(paths.values()), tasks=["A1.1"], limits=limits, allow_unsealed=True)))
    assert all(not r.passed for r in reports.values())
    (printed,) = reports["prints"].student_output.values()
    assert len(json.dumps(reports["prints"].as_dict())) < 100_000
    assert printed.endswith("[... 199980001 more characters cut: the grader keeps 20000 per cell]")
    notes = {label: "\n".join(r.notes) for label, r in reports.items()}
    # the pipe it floods is its own channel to the judge since issue 46, item 1: broken for itself alone
    assert "your A1.1 cell (cell 4) raised Broken: a frame of" in notes["floods"]
    assert "cell 4 hit the memory limit (1024 MB)" in notes["allocates"]
    assert "cell 4 hit the file size limit (1 MB)" in notes["file"]
    assert "it started more than 8 processes (the limit) during cell 4" in notes["forks"]


@pytest.mark.slow
def test_a_cell_that_catches_its_timeout_is_stopped_by_the_grader(tmp_path):
    """The review's C15: a cell that catches CellTimeout ran until the fixed 900 s limit, and the
    results of the cells before it were lost with it. A1.2's cell does it here: the judge stops
    waiting for it at its limit and gives the channel up, so what follows fails at once."""
    import grade_cheats as cheats
    import time

    a1 = nbformat.read(next(SOLUTIONS.glob("A1_*.ipynb")), as_version=4)  # A1.1 solved
    next(c for c in a1.cells if "### BEGIN SOLUTION A1.2" in c.source).source = cheats.CATCHES_ITS_TIMEOUT
    nbformat.write(a1, tmp_path / "A1_catches.ipynb")
    started = time.monotonic()
    report = grade_many([tmp_path / "A1_catches.ipynb"], tasks=["A1.1", "A1.2"], cell_timeout=3)[0]
    assert time.monotonic() - started < 60
    assert "your A1.2 cell (cell 8) raised CellTimeout: ran for more than 3 s" in "\n".join(report.notes), report.text()
    assert report.task("A1.2").passed == 0
    assert report.task("A1.1").passed == report.task("A1.1").checks > 0, report.text()  # sent before the hang


def test_a_batch_without_a_working_bubblewrap_is_refused_unless_asked_for(tmp_path, monkeypatch):
    """The review's C19: a bwrap that fails (a stub first on PATH) dropped a batch to the process
    level with no word anywhere."""
    stub = tmp_path / "bin" / "bwrap"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\necho 'bwrap: no permission to create namespaces' >&2\nexit 1\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}:{os.environ['PATH']}")
    sandbox.probe.cache_clear()
    try:
        with pytest.raises(ValueError, match="bubblewrap is not working here .bwrap failed .status 1.: bwrap: no "
                                             "permission to create namespaces.*--allow-unsealed"):
            grade_many([tmp_path / "A1_a.ipynb", tmp_path / "A1_b.ipynb"])
        # one file, as a student grades their own: graded, and said so
        report = grade_many([tmp_path / "A1_missing.ipynb"])[0]
    finally:
        sandbox.probe.cache_clear()
    assert report.sandbox == "process" and "graded without bubblewrap" in report.text()


@pytest.mark.slow
@pytest.mark.parametrize("level", ["process"], indirect=True)
def test_processes_a_submission_leaves_behind_are_killed_with_it(level, tmp_path, monkeypatch):
    """The review's C10, C17: in the process level, a cell's children outlived the grading of
    its file (a daemon then edited a hidden check). All three, the daemon too, are killed."""
    import grade_cheats as cheats

    cheats.let_past_the_rules(monkeypatch)
    report = grade_many([a1_cheats(tmp_path, leaves=cheats.LEAVES_CHILDREN)["leaves"]], tasks=["A1.1"])[0]
    pids = [int(p) for out in report.student_output.values() for p in out.split()]
    assert len(pids) == 3 and report.sandbox == "process", report.text()
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    assert not alive, alive


@pytest.mark.slow
def test_a_hang_in_one_task_loses_only_what_follows_it(tmp_path):
    """The review's B23: A2.4's find_violations waits for a duplicated free-list entry to go
    away; its hidden property check caught its CellTimeout as a failing example and ran on,
    and the whole run was killed at 900 s with nothing reported: A2.1 to A2.3, correct, got 0.
    Now the check fails at its limit, naming the line, and A2.4's other hidden check still runs."""
    from test_grade import edited

    path = tmp_path / "A2_hang.ipynb"
    nbformat.write(edited("A2", [("    entries = Counter(b for table in tables for b in table.blocks)\n    on_free_list",
                                  "    while len(set(allocator.free_list)) != len(allocator.free_list):\n        pass\n"
                                  "    entries = Counter(b for table in tables for b in table.blocks)\n    on_free_list")]),
                   path)
    # a limit the correct tasks' hidden checks keep under on a loaded machine (each call to the
    # student's objects crosses the judge's channel: 3 s was not enough beside a book build)
    report = grade_many([path], cell_timeout=30)[0]
    assert [t.task for t in report.tasks if t.ok] == ["A2.1", "A2.2", "A2.3", "A2"], report.text()
    a24 = report.task("A2.4")
    assert a24.hidden_passed == 1 and "check_find_violations" in "\n".join(a24.failures), report.text()
    assert "raised CellTimeout: ran for more than 30 s at your A2.4 cell (cell 22)" in "\n".join(a24.failures)


# Grades a batch in a process of its own, at the process level, with the cells marked
# PAST_THE_RULES let past the rules: a cell that kills its grader must not take the test run with it.
BATCH_AT_THE_PROCESS_LEVEL = """
import json, sys
import grade_cheats
from pagedlab_course.grade import grade_many, rules

real = rules.check
rules.check = lambda source, **kw: [] if "PAST_THE_RULES" in source else real(source, **kw)
*paths, out = sys.argv[1:]
batch = grade_many(paths, tasks=["A1.1"], allow_unsealed=True, seed=3)
alone = grade_many([paths[1]], tasks=["A1.1"], seed=3)
with open(out, "w") as f:
    json.dump({"batch": [r.as_dict() for r in batch], "alone": alone[0].as_dict()}, f)
"""


@pytest.mark.slow
def test_a_cell_at_the_process_level_can_neither_kill_the_grader_nor_touch_a_neighbour(tmp_path):
    """The review's C18 (`kill(getppid(), 9)` ended the batch with no gradebook) and C17 (a cell
    stopped its neighbour, wrote an end into its pipes through /proc and killed it: the neighbour
    got 0) at the process level, where the submission's process ran as the grader's user (root,
    here, whom undumpable processes do not stop). Its process now runs as a user of its own when
    the grader is root, and under a seccomp filter that lets it signal nothing but itself."""
    import grade_cheats as cheats

    paths = a1_cheats(tmp_path, a_forges=cheats.STOPS_AND_FORGES_A_NEIGHBOUR, b_honest=None,
                      c_kills=cheats.KILLS_THE_GRADER, d_honest=None)
    a1 = next(SOLUTIONS.glob("A1_*.ipynb"))
    for label in ("b_honest", "d_honest"):
        shutil.copy(a1, paths[label])
    out = tmp_path / "reports.json"
    env = {**os.environ, "PAGEDLAB_GRADE_SANDBOX": "process",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", BATCH_AT_THE_PROCESS_LEVEL, *map(str, paths.values()), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and out.exists(), f"the grader died ({done.returncode}): {done.stderr[-2000:]}"
    reports = json.loads(out.read_text())
    forges, honest, kills, other = reports["batch"]
    assert all(r["sandbox"] == "process" for r in reports["batch"])
    assert honest == {**reports["alone"], "notebook": honest["notebook"]} and not honest["refused"]
    assert all(t["passed"] == t["checks"] > 0 for r in (honest, other) for t in r["tasks"]), (honest, other)
    for cheat in (forges, kills):
        assert not cheat["refused"] and all(t["passed"] + t["hidden_passed"] == 0 for t in cheat["tasks"]), cheat
    assert "forged into" not in json.dumps(forges) and "stopped" not in json.dumps(forges), forges["student_output"]
