"""The process a submission runs in (pagedlab_course.grade.sandbox), at each level: what it can see and
change, and the digest check that stands in for the sealed level where bubblewrap cannot run."""

import json
import shutil
import sys

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
    sandbox.level.cache_clear()
    yield sandbox.level()
    sandbox.level.cache_clear()


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


def test_a_library_function_replaced_through_an_alias_is_caught_when_the_cell_has_run():
    """The rules see `torch.equal = ...` but not `lib = torch; lib.equal = ...`: the worker
    compares the libraries' functions before and after each solution cell."""
    cell = {"index": 4, "kind": "solution", "task": "A2.1", "source": "import math\nlib = math\nlib.floor = abs\n"}
    job = {"assignment": "A2", "cells": [cell], "forbid": [], "hidden": [], "only": None, "cell_timeout": 60}
    status, out, err = sandbox.run([sys.executable, "-m", "pagedlab_course.grade.worker"], json.dumps(job), 300)
    assert status == 0, err
    assert json.loads(out)["violations"] == [{"task": "A2.1", "what": "replaces math.floor", "where": ""}]


def test_a_library_class_patched_through_an_alias_is_caught_in_a_cell_and_during_a_hidden_check():
    """Deliver 3: `m = KVCacheManager; m.free = ...` changes what a hidden check's library
    reference does (A5 may use KVCacheManager; its name is not forbidden). The worker compares
    the attributes of pagedlab's classes after each solution cell and each hidden check."""
    cells = [{"index": 2, "kind": "setup", "task": "", "source": "from pagedlab.memory import KVCacheManager\n"},
             {"index": 4, "kind": "solution", "task": "A5.1", "source": "m = KVCacheManager\nm.free = print\n"},
             {"index": 6, "kind": "solution", "task": "A5.2",
              "source": "def later():\n    m = KVCacheManager\n    m.allocate = print\n"}]
    check = "from pagedlab_course.grade import task\n\n@task('A5.2')\ndef check_it(nb):\n    nb.later()\n"
    job = {"assignment": "A5", "cells": cells, "forbid": [], "hidden": [{"label": "<check A5.py>", "source": check}],
           "only": None, "cell_timeout": 60}
    status, out, err = sandbox.run([sys.executable, "-m", "pagedlab_course.grade.worker"], json.dumps(job), 300)
    assert status == 0, err
    assert json.loads(out)["violations"] == [
        {"task": "A5.1", "what": "replaces pagedlab.memory.manager.KVCacheManager.free", "where": ""},
        {"task": "A5.2", "what": "replaces pagedlab.memory.manager.KVCacheManager.allocate during the hidden check "
                                 "check_it", "where": ""}]
