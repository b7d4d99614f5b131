"""One way through the modules: the scheduler and the simulator load neither the model nor the
Triton kernels, and every name the engine package exports resolves to its module's object."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import pagedlab
import pagedlab.engine

HEAVY = ("pagedlab.model", "pagedlab.kernels", "pagedlab.engine.runner", "pagedlab.engine.llm",
         "triton", "transformers")


def test_importing_the_scheduler_or_the_simulator_loads_no_model_and_no_kernel():
    code = ("import sys, pagedlab.engine.scheduler, pagedlab.sim.simulator, pagedlab.sim\n"
            f"print(' '.join(m for m in sys.modules if m.startswith({HEAVY!r})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    assert loaded == []


def test_every_engine_export_is_its_modules_object():
    for name, module in pagedlab.engine._EXPORTS.items():
        assert getattr(pagedlab.engine, name) is getattr(
            importlib.import_module(f"pagedlab.engine.{module}"), name)
    assert set(dir(pagedlab.engine)) >= set(pagedlab.engine.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        pagedlab.engine.Nope


def test_the_fp8_dtype_has_one_home():
    """Only pagedlab.dtypes binds FP8 to a torch dtype; every other module imports it. (Any two
    bindings of torch.float8_e4m3fn are the same object, so identity cannot tell: read the
    sources.)"""
    homes = []
    for path in sorted(Path(pagedlab.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == "FP8" for t in targets):
                homes.append(path.name)
    assert homes == ["dtypes.py"]
    from pagedlab import dtypes
    from pagedlab.kernels import fp8, fp8_reference

    assert fp8_reference.FP8 is fp8.FP8 is dtypes.FP8
    assert dtypes.dtype_bytes(dtypes.FP8) == 1


@pytest.mark.slow
def test_what_students_install_holds_no_grader_and_no_book_tooling(tmp_path):
    """The pagedlab wheel: the library alone. The grader with its hidden checks, the student
    notebooks' maker and the Colab copies' maker are pagedlab-course's (course/)."""
    import zipfile

    import wheels

    names = zipfile.ZipFile(wheels.build("pagedlab", tmp_path)).namelist()
    assert "pagedlab/engine/scheduler.py" in names
    tooling = [n for n in names if any(part in n for part in (
        "grade", "hidden", "colab", "assignments", "pagedlab_course"))]
    assert tooling == []
    course = zipfile.ZipFile(wheels.build("pagedlab-course", tmp_path)).namelist()
    assert {"pagedlab_course/grade/hidden/A2.py", "pagedlab_course/colab.py"} <= set(course)
    assert not any(n.startswith("pagedlab/") for n in course)


def _modules(package: str):
    root = Path(importlib.import_module(package).__file__).parent
    return [(path, ast.parse(path.read_text())) for path in sorted(root.rglob("*.py"))]


def test_the_library_never_imports_the_course_and_neither_finds_the_repository_by_file():
    """pagedlab imports nothing of pagedlab_course (the arrow points one way), and no module of
    either locates the repository from where it is installed (``__file__``): paths come from
    the folder a command runs in, or its arguments."""
    for path, tree in _modules("pagedlab"):
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in imported if m.split(".")[0] == "pagedlab_course"}, path
    for path, tree in _modules("pagedlab") + _modules("pagedlab_course"):
        assert not any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(tree)), path


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The pagedlab modules ``name`` (file ``path``) imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                      else node.module for a in node.names}
    return {m for m in found if m in modules and m != name}


def test_no_module_of_the_library_imports_itself_round_a_loop():
    """Every import counted, those inside functions too: a loop is a loop at run time."""
    root = Path(pagedlab.__file__).parent
    files = {".".join(("pagedlab", *p.relative_to(root).with_suffix("").parts))
             .removesuffix(".__init__"): p for p in root.rglob("*.py")}
    graph = {name: _imports(path, name, set(files)) for name, path in files.items()}
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError(" -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for other in sorted(graph[name]):
            visit(other)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_follow_one_step_map_names_what_exists_within_ten_files_and_2000_lines():
    """ARCHITECTURE.md's walk through one step: each stop's names resolve in its file, and
    reading them all takes at most 10 files and 2,000 lines."""
    import re

    text = (Path(pagedlab.__file__).parent.parent / "ARCHITECTURE.md").read_text()
    section = text.split("## Follow one step", 1)[1].split("\n## ", 1)[0]
    stops = re.split(r"\n\d+\. ", section)[1:]
    assert 1 <= len(stops) <= 10
    total = 0
    for stop in stops:
        path, rest = re.match(r"`([^`]+\.py)`: (.*?)\.(?: |$)", " ".join(stop.split())).groups()
        names = re.findall(r"`([A-Za-z_.]+)`", rest)
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        tree = ast.parse(Path(module.__file__).read_text())
        for name in names:
            node, parts = tree, name.split(".")
            for part in parts:
                node = next((n for n in node.body if isinstance(
                    n, (ast.ClassDef, ast.FunctionDef)) and n.name == part), None)
                assert node is not None, f"{path}: no {name}"
            total += node.end_lineno - node.lineno + 1
    assert total <= 2000, total
