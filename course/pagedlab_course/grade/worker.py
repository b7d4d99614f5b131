"""The process that runs one submission: ``python -m pagedlab_course.grade.worker`` (sealed by
pagedlab_course.grade.sandbox) reads a job on stdin and writes its results on stdout, a JSON line
as each cell and hidden check begins and ends (read by pagedlab_course.grade.supervise).

The job holds everything the run needs (cells, hidden checks' sources, forbidden library
names), so the process needs no file of the grader's. Its cells run in order in one namespace,
as a kernel would run them, then the hidden checks; per cell it reports what the check code
printed (the student's own prints are set aside), the error if any, and every use of forbidden
library code from the student's code. It decides nothing: the grader compares what it reports
with the reference, and counts whatever it did not report as failed.
"""

from __future__ import annotations

import functools
import importlib
import io
import json
import os
import pkgutil
import signal
import sys
import traceback
import types

from pagedlab_course.grade import rules

CELL_PREFIX = "<cell "  # filename of a notebook cell's code: "<cell 7: A2.1>" or "<cell 8>"


class ForbiddenUse(RuntimeError):
    """The student's code called a library function the assignment forbids."""


class Notebook(types.SimpleNamespace):
    """The notebook's names, as a hidden check sees them (``nb.Allocator``)."""

    def __repr__(self):
        return "nb"


class CellTimeout(BaseException):
    """A cell or hidden check ran past its time limit (an infinite loop, usually). Not an
    Exception: the notebooks' ``error()``, the checks' ``outcome()`` and Hypothesis catch those,
    and would run on (the grader stops a run that does anyway)."""


class Capped(io.StringIO):
    """A cell's printed output, kept up to ``limit`` characters; the rest is counted and cut
    with a note (a cell that prints 200 MB costs the grader nothing)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.cut = limit, 0

    def write(self, text):
        room = max(0, self.limit - self.tell())
        self.cut += max(0, len(text) - room)
        return super().write(text[:room]) + max(0, len(text) - room)

    def getvalue(self):
        note = f"\n[... {self.cut} more characters cut: the grader keeps {self.limit} per cell]" if self.cut else ""
        return super().getvalue() + note


CHECK_OUTPUT, STUDENT_OUTPUT = 1_000_000, 20_000  # characters kept per cell


def _buffers() -> tuple[Capped, Capped]:
    return Capped(CHECK_OUTPUT), Capped(STUDENT_OUTPUT)


class Run:
    """One submission's state in the child: which code is the student's, and what it did."""

    def __init__(self):
        self.solution_files: dict[str, str] = {}  # cell filename -> task, student code only
        self.check_files: set[str] = set()  # check cells and hidden-check files
        self.violations: list[dict] = []
        self.out, self.student_out = _buffers()  # what check code prints (compared), the student's (shown)
        self.namespace: dict = {}  # the notebook's names
        self.classes: set = set()  # library classes the assignment forbids
        self.stream = None  # the results, to the grader (a line per cell or hidden check)

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


def library_state() -> dict[tuple[str, str], int]:
    """The identity of every public function, class and module that the libraries a check may
    use expose, and of the attributes of pagedlab's classes and of torch.Tensor (what the
    checks call on the library's objects): student code must leave them as it found them
    (``torch.equal = ...``, ``lib = KVCacheManager; lib.allocate = ...``)."""
    # Not triton: its interpreter replaces triton.language's functions while it runs a kernel,
    # and no check relies on them (a kernel is checked by what it computes).
    roots = set(rules.IMPORTS) - {"triton"} | {"builtins", "pagedlab", "hypothesis"}
    state, classes = {}, set()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in roots or "._" in name or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if not attr.startswith("_") and (callable(value) or isinstance(value, types.ModuleType)):
                state[name, attr] = id(value)
                if isinstance(value, type) and value.__module__.split(".")[0] == "pagedlab":
                    classes.add(value)
    if "torch" in sys.modules:
        classes.add(sys.modules["torch"].Tensor)
    for cls in classes:
        for attr, value in list(vars(cls).items()):
            if not attr.startswith("__") and (callable(value) or hasattr(value, "__get__")):
                state[cls.__module__, f"{cls.__qualname__}.{attr}"] = id(value)
    return state


def _changed(before: dict, task: str, when: str = "") -> None:
    """Record each library attribute that is no longer what it was ``before``."""
    after = library_state()
    for module, attr in sorted(k for k in before if after.get(k, before[k]) != before[k]):
        RUN.violations.append({"task": task, "what": f"replaces {module}.{attr}{when}", "where": ""})


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


def hidden_checks(assignment: str, sources: list[dict]) -> tuple[list, list[dict]]:
    """(label, function, arguments after the notebook) of every hidden check in the sources
    ({"label", "source", "references"}), in order, and an error entry for each source that
    failed to load (so that it fails the grade). A check that names a reference gets the value
    the grader computed in its own process (see ``pagedlab_course.grade.task``)."""
    found, broken = [], []
    for i, item in enumerate(sources):
        module = types.ModuleType(f"hidden_{i}")
        try:
            exec(compile(item["source"], item["label"], "exec"), module.__dict__)
        except Exception as exc:  # noqa: BLE001 - an instructor's broken file is reported
            broken.append({"name": f"loading {item['label']}", "task": assignment, "file": item["label"],
                           "doc": "", "error": _error(exc, set())})
            continue
        references = item.get("references", {})
        found += [(item["label"], fn, [references.get(fn.__name__)] if getattr(fn, "__grade_reference__", None) else [])
                  for fn in vars(module).values() if hasattr(fn, "__grade_task__")]
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
        state = library_state()
    else:
        RUN.check_files.add(filename)
    before = bindings(namespace, classes) if cell["kind"] == "solution" and classes else {}
    RUN.out, RUN.student_out = _buffers()
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
    if cell["kind"] == "solution":
        _changed(state, cell["task"])
    if cell["kind"] == "solution" and classes:
        for name, what in bindings(namespace, classes).items():
            if before.get(name) != what:
                RUN.violations.append({"task": cell["task"], "what": f"binds {name} to {what}", "where": ""})
    result["stdout"] = RUN.out.getvalue()
    result["student_stdout"] = RUN.student_out.getvalue()
    return result


def _hidden(job: dict) -> None:
    """After a job's cells: its hidden checks, each sent as it ends."""
    _send(begin="loading the hidden checks")
    found, broken = hidden_checks(job["assignment"], job["hidden"])
    for entry in broken:
        _send(hidden=entry)
    found = [(path, fn, args) for path, fn, args in found if not job["only"] or fn.__grade_task__ in job["only"]]
    RUN.check_files.update(path for path, _, _ in found)
    for path, fn, args in found:
        _send(begin=f"the hidden check {fn.__name__}")
        RUN.out, RUN.student_out = _buffers()
        entry = {"name": fn.__name__, "task": fn.__grade_task__, "file": path,
                 "doc": " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split()), "error": None}
        state = library_state()
        try:
            _alarm(job["cell_timeout"])
            try:
                fn(Notebook(**RUN.namespace), *args)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as exc:  # noqa: BLE001
            entry["error"] = _error(exc, set(RUN.solution_files) | RUN.check_files)
        _changed(state, fn.__grade_task__, f" during the hidden check {fn.__name__}")
        _send(hidden=entry)


def _send(**item) -> None:
    """One line of results to the grader, with the library uses found since the last."""
    item["violations"], RUN.violations = RUN.violations, []
    RUN.stream.write(json.dumps(item) + "\n")
    RUN.stream.flush()


def main() -> None:
    job = json.load(sys.stdin)
    RUN.stream = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # output that bypasses sys.stdout goes nowhere
    _start(job["forbid"])
    for cell in job["cells"]:
        _send(begin=f"cell {cell['index']}")
        _send(cell=_run_cell(cell, job))
    _hidden(job)
    _send(done=True)


if __name__ == "__main__":
    main()
