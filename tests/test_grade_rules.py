"""The rules a solution cell must keep (pagedlab_course.grade.rules): every reference solution keeps
them, and each way around the grader of issue 25 breaks one, named with its line."""

import pytest

import grade_cheats as cheats
from pagedlab_course.grade import rules
from pagedlab_course.grade.notebook import SOLUTIONS, load


@pytest.mark.parametrize("path", sorted(SOLUTIONS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_reference_solution_cell_keeps_the_rules(path):
    assignment = load(path)
    for cell in assignment.cells:
        if cell.kind == "solution":
            assert rules.check(cell.source, forbid=assignment.forbid, protected=assignment.protected) == [], cell.task


A2 = load(next(SOLUTIONS.glob("A2_*.ipynb")))


def breaches(source: str) -> list[rules.Breach]:
    return rules.check(source, forbid=A2.forbid, protected=A2.protected)


@pytest.mark.parametrize("source, line, what, rule", [
    (cheats.RUNNER, 3, "`sys`", rules.RULE_INTROSPECT),
    (cheats.RUNNER, 3, "`.__globals__`", rules.RULE_INTROSPECT),
    (cheats.EMPTY, 2, "imports sys", rules.RULE_IMPORT),
    (cheats.KILL_PARENT, 2, "imports os", rules.RULE_IMPORT),
    (cheats.TAMPER, 4, "`.f_locals`", rules.RULE_INTROSPECT),
    (cheats.TAMPER, 10, "`open`", rules.RULE_INTROSPECT),
    (cheats.REFERENCE, 3, "imports pagedlab", rules.RULE_IMPORT),
    (cheats.REFERENCE, 6, "`exec`", rules.RULE_INTROSPECT),
    (cheats.WRAPPED, 4, "`.__new__`", rules.RULE_INTROSPECT),
    (cheats.WRAPPED, 5, "`.__wrapped__`", rules.RULE_INTROSPECT),
    (cheats.SETUP_NAME, 2, "`compile`", rules.RULE_INTROSPECT),
    (cheats.UNATTRIBUTED, 3, "`.__globals__`", rules.RULE_INTROSPECT),
    (cheats.PATCHED_LIBRARY, 3, "assigns to torch.equal", rules.RULE_MODULE),
    (cheats.SHADOWED_PRINT, 2, "rebinds `print`", rules.RULE_NAME),
    ("import inspect\nsrc = inspect.getsource(BlockAllocator)\n", 1, "imports inspect", rules.RULE_IMPORT),
    ("import subprocess\n", 1, "imports subprocess", rules.RULE_IMPORT),
    ("from pagedlab.memory import BlockAllocator as Allocator\n", 1, "imports pagedlab.memory.BlockAllocator",
     rules.RULE_FORBIDDEN),
    ("def error(call):\n    return 'what the check expects'\n", 1, "rebinds `error`", rules.RULE_NAME),
    ("def f():\n    global KVCacheManager\n    KVCacheManager = dict\n", 2, "`global KVCacheManager`", rules.RULE_NAME),
    ("import math as random\n", 1, "rebinds `random`", rules.RULE_NAME),
    ("KVCacheManager.allocate = lambda *args: []\n", 1, "assigns to KVCacheManager.allocate", rules.RULE_MODULE),
    ("t = getattr(BlockAllocator, 'allocate')\n", 1, "`getattr`", rules.RULE_INTROSPECT),
    ("x = (lambda: 0).__globals__\n", 1, "`.__globals__`", rules.RULE_INTROSPECT),
])
def test_each_way_around_the_grader_breaks_a_rule_named_with_its_line(source, line, what, rule):
    assert rules.Breach(line, what, rule) in breaches(source), [b.text() for b in breaches(source)]


def test_what_a_solution_may_do_is_not_refused():
    source = (
        "import torch\nimport math\nfrom collections import Counter, deque\nimport numpy as np\n"
        "class Allocator:\n    def __init__(self, n):\n        super().__init__()\n        self._free = deque(range(n))\n"
        "        self.count = 0\n        self.count += 1\n"
        "TOLERANCE = 1e-4\n"
    )
    assert breaches(source) == []


def test_a_refusal_names_the_line_and_the_rule():
    (breach,) = breaches("my_scratch = 1\n\nimport gc\n")
    assert breach.text() == f"line 3: imports gc ({rules.RULE_IMPORT})"


def test_the_checks_tolerance_cannot_be_rebound():
    """Finding 6: A4's checks compared with a TOL the student's cell defined (inf passed a
    kernel that computes nothing); it is the setup's now, and rebinding it is refused."""
    a4 = load(next(SOLUTIONS.glob("A4_*.ipynb")))
    assert rules.Breach(1, "rebinds `TOL`", rules.RULE_NAME) in rules.check(
        "TOL = float('inf')\n", forbid=a4.forbid, protected=a4.protected)


@pytest.mark.parametrize("source, line, what, rule", [
    ("class Blocks(list):\n    def __eq__(self, other):\n        return True\n", 2, "defines __eq__", rules.RULE_SPECIAL),
    ("class T:\n    def __repr__(self):\n        return '[0, 1] free: 0'\n", 2, "defines __repr__", rules.RULE_SPECIAL),
    ("Any = type('Any', (), {'__eq__': lambda s, o: True})\n", 1, "the string '__eq__'", rules.RULE_INTROSPECT),
    ("class T:\n    __eq__ = lambda s, o: True\n", 2, "`__eq__`", rules.RULE_INTROSPECT),
])
def test_results_that_fool_a_comparison_are_refused(source, line, what, rule):
    """A check cell prints `mine == expected` or a result's repr: an object that always
    compares equal, or prints what the check expects, must not get that far."""
    assert rules.Breach(line, what, rule) in breaches(source), [b.text() for b in breaches(source)]


def test_a_name_one_check_leaves_for_the_next_is_protected_a_checks_scratch_name_is_not():
    """A2.2's checks build `t` and `pool` in one cell and read them in the next: a later
    solution cell that rebound them would change what the next check sees. `rng`, which every
    check that uses it binds first, is the student's to use too."""
    assert rules.Breach(1, "rebinds `pool`", rules.RULE_NAME) in breaches("pool = None\n")
    assert breaches("rng = None\n") == []


def test_a_comprehension_variable_is_not_a_rebinding_a_walrus_in_one_is():
    """Issue 46, item 6 (the review): `[f"r{i}" for i in range(12)]` in an A5 cell was refused as
    rebinding A5's `i`, but Python 3 binds a comprehension's variable in the comprehension only;
    an assignment expression inside one binds at the cell's top level."""
    a5 = load(next(SOLUTIONS.glob("A5_*.ipynb")))
    assert "state" in a5.protected  # a check cell's helper, which the next one calls

    def found(source):
        return rules.check(source, forbid=a5.forbid, protected=a5.protected)

    assert found('RIDS = [f"r{i}" for i in range(12)]\nSEEN = {state: 1 for state in range(3)}\n') == []
    assert rules.Breach(1, "rebinds `state`", rules.RULE_NAME) in found("LAST = [(state := n) for n in range(3)]\n")
    assert rules.Breach(1, "rebinds `state`", rules.RULE_NAME) in found("for state in range(3):\n    pass\n")


@pytest.mark.parametrize("source, line, what, rule", [
    # C27: modules reached as attributes of allowed ones, or imported through them
    ("from dataclasses import sys as S\n", 1, "imports dataclasses.sys", rules.RULE_IMPORT),
    ("import dataclasses\nf = dataclasses.sys._getframe()\n", 2, "`.sys`", rules.RULE_INTROSPECT),
    ("import torch\ntorch.os.system('true')\n", 2, "`.os`", rules.RULE_INTROSPECT),
    ("import torch\nm = torch.importlib.import_module('pagedlab.memory')\n", 2, "`.importlib`", rules.RULE_INTROSPECT),
    ("import torch\nm = torch.sys.modules['pagedlab.memory']\n", 2, "`.sys`", rules.RULE_INTROSPECT),
    ("from numpy.ctypeslib import ctypes as C\n", 1, "imports numpy.ctypeslib.ctypes", rules.RULE_IMPORT),
    ("from torch.utils import cpp_extension as CE\nCE.load('x', [])\n", 1, "imports torch.utils.cpp_extension",
     rules.RULE_IMPORT),
    ("import dataclasses\ndataclasses.builtins.exec('x = 1')\n", 2, "`.builtins`", rules.RULE_INTROSPECT),
    ("import dataclasses\nv = dataclasses.builtins.vars(Allocator)\n", 2, "`.builtins`", rules.RULE_INTROSPECT),
    ("import random\nrandom._os.kill(random._os.getppid(), 9)\n", 2, "`._os`", rules.RULE_INTROSPECT),
    ("import torch\nt = torch.threading.Thread\n", 2, "`.threading`", rules.RULE_INTROSPECT),
    ("import torch\nb = torch.serialization.pickle.loads(b'')\n", 2, "`.pickle`", rules.RULE_INTROSPECT),
    ("S = None\ntb = S.exc_info()[2]\n", 2, "`.exc_info`", rules.RULE_INTROSPECT),
    # C28: format strings that walk attributes, a star import, a handler's name
    ("s = '{0.__class__}'.format(x)\n", 1, "the format field '0.__class__'", rules.RULE_INTROSPECT),
    ("s = '{x.gi_frame.f_back}'.format(x=g)\n", 1, "the format field 'x.gi_frame.f_back'", rules.RULE_INTROSPECT),
    ("from numpy import *\n", 1, "imports * from numpy", rules.RULE_NAME),
    ("try:\n    pass\nexcept Exception as error:\n    pass\n", 3, "rebinds `error`", rules.RULE_NAME),
    # the review's C23, C24 and C05 spellings, which reach only the submission's process since
    # issue 46, item 1, refused here too
    ("match g:\n    case object(gi_frame=f):\n        pass\n", 2, "`gi_frame=`", rules.RULE_INTROSPECT),
    ("match f:\n    case error:\n        pass\n", 2, "rebinds `error`", rules.RULE_NAME),
    ("match f:\n    case [*error]:\n        pass\n", 2, "rebinds `error`", rules.RULE_NAME),
    ("A = type('A', (), dict(__eq__=lambda s, o: True))\n", 1, "`__eq__=`", rules.RULE_SPECIAL),
])
def test_the_reviews_static_gaps_are_refused_naming_the_rule(source, line, what, rule):
    """Issue 46's review, C27 and C28: spellings the rules accepted. Each reaches only the
    submission's own process since the judge moved out of it (issue 46, item 1), so none changes
    a grade (test_grade_trust.py grades C01, C02, C23, C24 and C25 through them); refused here,
    before they run, so that the first line names them too."""
    assert rules.Breach(line, what, rule) in breaches(source), [b.text() for b in breaches(source)]


def test_a_modules_allowed_attributes_and_a_plain_format_string_are_not_refused():
    """What the new refusals must leave alone: attributes of allowed modules that are not modules
    outside the list (torch.nn.functional, numpy.random, collections.abc), a format string's
    index and spec, a handler's own name, and names like `.copy` or `.queue` on other objects."""
    source = ("import torch\nimport numpy\nimport collections\nf = torch.nn.functional.softmax\n"
              "r = numpy.random.default_rng(0)\nA = collections.abc.Mapping\ns = '{0[1]:>4} {name}'.format(x, name=1)\n"
              "try:\n    pass\nexcept Exception as err:\n    pass\nq = self_queue = r.copy\n")
    assert breaches(source) == [], [b.text() for b in breaches(source)]
