"""The process that runs submissions, each as if in a fresh process of its own.

It reads a request on stdin (jobs, modules to import once, how many children at a time) and
writes a JSON list of results on stdout. Each job's cells run in order in one namespace, as a
kernel would run them, then its hidden checks; per cell it reports what the check code printed
(the student's own prints are set aside), the error if any, and every use of forbidden library
code from the student's code. Children are forked from a process that has imported torch and
the library, and jobs that begin with the same cells share one child up to where they differ
(see _run_group). Nothing here compares or scores.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import io
import json
import os
import pkgutil
import signal
import sys
import traceback
import types
from pathlib import Path

CELL_PREFIX = "<cell "  # filename of a notebook cell's code: "<cell 7: A2.1>" or "<cell 8>"


class ForbiddenUse(RuntimeError):
    """The student's code called a library function the assignment forbids."""


class Notebook(types.SimpleNamespace):
    """The notebook's names, as a hidden check sees them (``nb.Allocator``)."""

    def __repr__(self):
        return "nb"


class CellTimeout(Exception):
    """A cell or hidden check ran past its time limit (an infinite loop, usually)."""


class Run:
    """One submission's state in the child: which code is the student's, and what it did."""

    def __init__(self):
        self.solution_files: dict[str, str] = {}  # cell filename -> task, student code only
        self.check_files: set[str] = set()  # check cells and hidden-check files
        self.violations: list[dict] = []
        self.out = io.StringIO()  # what check code prints: compared with the reference
        self.student_out = io.StringIO()  # what the student's code prints: shown, never compared
        self.namespace: dict = {}  # the notebook's names
        self.classes: set = set()  # library classes the assignment forbids

    def student_task(self, frame) -> str | None:
        """The task of the nearest notebook code on the stack, if that code is the student's."""
        while frame is not None:
            name = frame.f_code.co_filename
            if name in self.solution_files:
                return self.solution_files[name]
            if name in self.check_files:
                return None
            frame = frame.f_back
        return None


RUN = Run()


class _Stdout(io.TextIOBase):
    """sys.stdout that sends a print to the student's buffer when the student's code made it."""

    def writable(self):
        return True

    def write(self, text):
        task = RUN.student_task(sys._getframe(1))
        (RUN.out if task is None else RUN.student_out).write(text)
        return len(text)


# -- forbidden library code ------------------------------------------------------------------


def _guard(fn, qualname: str):
    """fn, refusing calls made (directly or through helpers) by the student's code."""

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        task = RUN.student_task(sys._getframe(1))
        if task is not None:
            where = traceback.extract_stack(sys._getframe(1), limit=8)
            line = next((f"line {f.lineno}" for f in reversed(where) if f.filename in RUN.solution_files), "")
            RUN.violations.append({"task": task, "what": f"calls {qualname}", "where": line})
            raise ForbiddenUse(f"{task} may not use {qualname}: it is the reference the checks compare with")
        return fn(*args, **kwargs)

    guarded.__pagedlab_forbidden__ = qualname
    return guarded


def _guard_class(cls, forbidden_classes: set) -> None:
    forbidden_classes.add(cls)
    for name, value in list(vars(cls).items()):
        qual = f"{cls.__module__}.{cls.__qualname__}.{name}"
        if isinstance(value, types.FunctionType):
            setattr(cls, name, _guard(value, qual))
        elif isinstance(value, (staticmethod, classmethod)):
            setattr(cls, name, type(value)(_guard(value.__func__, qual)))
        elif isinstance(value, property) and value.fget is not None:
            setattr(cls, name, property(_guard(value.fget, qual), value.fset, value.fdel, value.__doc__))


def _modules(names: list[str]) -> list:
    """The named modules and all their submodules, imported; names of callables are skipped."""
    modules = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        modules.append(module)
        if hasattr(module, "__path__"):
            walk = pkgutil.walk_packages(module.__path__, prefix=name + ".")
            modules += [importlib.import_module(info.name) for info in walk]
    return modules


def forbid(names: list[str]) -> set:
    """Trap every function and class method of the named modules (and their submodules), and
    the named single callables (``torch.softmax``). Return the trapped classes."""
    classes: set = set()
    guarded: dict[int, object] = {}
    modules = _modules(names)
    for name in set(names) - {m.__name__ for m in modules}:
        owner_name, _, attr = name.rpartition(".")
        owner = _resolve(owner_name)
        setattr(owner, attr, _guard(getattr(owner, attr), name))
    for module in modules:
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != module.__name__:
                continue
            if isinstance(value, type) and value not in classes:
                _guard_class(value, classes)
            elif isinstance(value, types.FunctionType):
                guarded[id(value)] = _guard(value, f"{module.__name__}.{value.__qualname__}")
    # Re-exports (``from .allocator import ...`` in a package) must see the guarded function too.
    for module in modules:
        for attr, value in list(vars(module).items()):
            if id(value) in guarded:
                setattr(module, attr, guarded[id(value)])
    return classes


def _resolve(dotted: str):
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def _is_forbidden(value, classes: set) -> str | None:
    if hasattr(value, "__pagedlab_forbidden__"):
        return value.__pagedlab_forbidden__
    if isinstance(value, type):
        base = next((c for c in value.__mro__ if c in classes), None)
        if base is not None:
            return f"{base.__module__}.{base.__qualname__}"
    elif type(value) in classes:
        return f"an instance of {type(value).__module__}.{type(value).__qualname__}"
    return None


def bindings(namespace: dict, classes: set) -> dict[str, str]:
    """Names (and methods of notebook classes) bound to forbidden library code."""
    found = {}
    for name, value in list(namespace.items()):
        what = _is_forbidden(value, classes)
        if what:
            found[name] = what
        if isinstance(value, type) and value.__module__ == "__main__":
            for attr, member in vars(value).items():
                member = getattr(member, "__func__", member)
                what = _is_forbidden(member, classes)
                if what:
                    found[f"{name}.{attr}"] = what
    return found


def imports_of(source: str, names: list[str]) -> list[str]:
    """Forbidden modules the source imports (by name, statically)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [m for m in mods if any(m == n or m.startswith(n + ".") for n in names)]
    return found


# -- running one job ---------------------------------------------------------------------------


def _alarm(seconds: float):
    def handler(signum, frame):
        raise CellTimeout(f"ran for more than {seconds:g} s")

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _error(exc: BaseException, filenames) -> dict:
    """The exception, with the deepest notebook or hidden-check line it passed through."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f.filename in filenames]
    where = f"{ours[-1].filename} line {ours[-1].lineno}" if ours else ""
    notes = "".join(f"\n{n}" for n in getattr(exc, "__notes__", []))
    message = f"{exc}{notes}"
    if len(message) > 2000:
        message = message[:2000] + " [...]"
    return {"type": type(exc).__name__, "message": message, "where": where}


def hidden_checks(assignment: str, dirs: list[str]) -> tuple[list, list[dict]]:
    """(file, function) of every hidden check for the assignment in the directories, in order,
    and an error entry for each file that failed to load (so that it fails the grade)."""
    found, broken = [], []
    for d in dirs:
        for path in sorted(Path(d).glob(f"{assignment}*.py")):
            if path.stem[len(assignment) :][:1].isdigit():  # A1 must not take A10's files
                continue
            spec = importlib.util.spec_from_file_location(f"hidden_{path.stem}_{len(found)}", path)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001 - an instructor's broken file is reported
                broken.append({"name": f"loading {path}", "task": assignment, "doc": "", "error": _error(exc, set())})
                continue
            found += [(str(path), fn) for fn in vars(module).values() if hasattr(fn, "__grade_task__")]
    return found, broken


def _start(forbidden: list[str]) -> None:
    """Prepare a fresh child: stdout split by author, an empty notebook namespace, traps."""
    sys.stdout = _Stdout()
    RUN.classes = forbid(forbidden) if forbidden else set()
    main = types.ModuleType("__main__")  # the notebook's namespace; dataclasses look it up here
    sys.modules["__main__"] = main
    RUN.namespace = main.__dict__


def _run_cell(cell: dict, job: dict) -> dict:
    """Execute one cell in the notebook's namespace; what it printed, and its error."""
    namespace, classes = RUN.namespace, RUN.classes
    filename = f"{CELL_PREFIX}{cell['index']}{': ' + cell['task'] if cell['kind'] == 'solution' else ''}>"
    if cell["kind"] == "solution":
        RUN.solution_files[filename] = cell["task"]
        for module in imports_of(cell["source"], job["forbid"]):
            RUN.violations.append({"task": cell["task"], "what": f"imports {module}", "where": ""})
    else:
        RUN.check_files.add(filename)
    before = bindings(namespace, classes) if cell["kind"] == "solution" and classes else {}
    RUN.out, RUN.student_out = io.StringIO(), io.StringIO()
    result = {"index": cell["index"], "error": None}
    try:
        code = compile(cell["source"], filename, "exec")
        _alarm(job["cell_timeout"])
        try:
            exec(code, namespace)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a student's error (even exit()) is a result
        result["error"] = _error(exc, set(RUN.solution_files) | RUN.check_files)
    if cell["kind"] == "solution" and classes:
        for name, what in bindings(namespace, classes).items():
            if before.get(name) != what:
                RUN.violations.append({"task": cell["task"], "what": f"binds {name} to {what}", "where": ""})
    result["stdout"] = RUN.out.getvalue()
    result["student_stdout"] = RUN.student_out.getvalue()
    return result


def _finish(job: dict, cells: list[dict]) -> dict:
    """After a job's cells: its hidden checks, and its whole result."""
    found, hidden = hidden_checks(job["assignment"], job["hidden_dirs"])
    found = [(path, fn) for path, fn in found if not job["only"] or fn.__grade_task__ in job["only"]]
    RUN.check_files.update(path for path, _ in found)
    for path, fn in found:
        RUN.out, RUN.student_out = io.StringIO(), io.StringIO()
        entry = {"name": fn.__name__, "task": fn.__grade_task__, "file": path,
                 "doc": " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split()), "error": None}
        try:
            _alarm(job["cell_timeout"])
            try:
                fn(Notebook(**RUN.namespace))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as exc:  # noqa: BLE001
            entry["error"] = _error(exc, set(RUN.solution_files) | RUN.check_files)
        hidden.append(entry)
    return {"cells": cells, "hidden": hidden, "violations": RUN.violations}


def _key(cell: dict) -> tuple:
    return cell["index"], cell["kind"], cell["task"], cell["source"]


def _run_group(ids: list[int], jobs: list[dict], depth: int, cells: list[dict], parallel: int) -> dict:
    """Finish jobs that share their first ``depth`` cells, already run in this process.

    While they all share the next cell too, it runs once, here; where they part, each branch
    continues in a child forked from this state, so submissions that differ in one late cell
    (tests of the grader) do not repeat the expensive cells before it. Each job's hidden
    checks run in a process of its own.
    """
    while True:
        ending = [i for i in ids if len(jobs[i]["cells"]) == depth]
        branches: dict[tuple, list[int]] = {}
        for i in ids:
            if i not in ending:
                branches.setdefault(_key(jobs[i]["cells"][depth]), []).append(i)
        if ids == ending and len(ids) == 1:
            return {ids[0]: _finish(jobs[ids[0]], cells)}
        if ending or len(branches) != 1:
            break
        cells = cells + [_run_cell(jobs[ids[0]]["cells"][depth], jobs[ids[0]])]
        depth += 1
    work = [(lambda i=i: {i: _finish(jobs[i], cells)}, [i]) for i in ending]
    work += [(lambda b=b: _run_group(b, jobs, depth + 1, cells + [_run_cell(jobs[b[0]]["cells"][depth], jobs[b[0]])],
                                     parallel), b) for b in branches.values()]
    return _fork_all(work, jobs, parallel)


def _fork_all(work: list, jobs: list[dict], parallel: int) -> dict:
    """Run each (function, job ids) in a forked child, ``parallel`` at a time; merge results."""
    running, results = [], {}
    for fn, ids in work:
        if len(running) == parallel:
            results.update(_collect(*running.pop(0), jobs))
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: run, send the result, exit without cleanup
            os.close(read)
            try:
                payload = json.dumps({str(k): v for k, v in fn().items()}).encode()
            except BaseException as exc:  # noqa: BLE001
                payload = json.dumps({str(i): {"crash": "".join(traceback.format_exception(exc))} for i in ids}).encode()
            with os.fdopen(write, "wb") as pipe:
                pipe.write(payload)
            os._exit(0)
        os.close(write)
        running.append((pid, read, ids))
    for pid, read, ids in running:
        results.update(_collect(pid, read, ids, jobs))
    return results


def _collect(pid: int, read: int, ids: list[int], jobs: list[dict]) -> dict:
    timeout = sum(jobs[i]["timeout"] for i in ids)

    def expire(signum, frame):
        raise CellTimeout

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        signal.setitimer(signal.ITIMER_REAL, 0)
        _, status = os.waitpid(pid, 0)
    except CellTimeout:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {i: {"crash": f"the submission ran for more than {timeout:g} s and was stopped"} for i in ids}
    if not data:
        return {i: {"crash": f"the submission's process died (status {status}) before reporting"} for i in ids}
    return {int(k): v for k, v in json.loads(data).items()}


def serve(jobs: list[dict], preload: list[str], parallel: int = 1) -> list[dict]:
    """Results of the jobs, each run as if in a fresh process of its own (see _run_group)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in preload:
        importlib.import_module(name)
    for job in jobs:
        _modules(job["forbid"])  # imported once here; trapped in each child
    if parallel > 1 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)  # the children share the cores
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(tuple(job["forbid"]), []).append(i)

    def start(forbidden, ids):
        _start(list(forbidden))
        return _run_group(ids, jobs, 0, [], parallel)

    results = _fork_all([(lambda f=f, ids=ids: start(f, ids), ids) for f, ids in groups.items()], jobs, parallel)
    return [results[i] for i in range(len(jobs))]


def main() -> None:
    request = json.load(sys.stdin)
    report = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # output that bypasses sys.stdout goes nowhere
    report.write(json.dumps(serve(request["jobs"], request["preload"], request["parallel"])))
    report.close()


if __name__ == "__main__":
    main()
