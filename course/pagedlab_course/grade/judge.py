"""The judge: ``python -m pagedlab_course.grade.judge REQUEST_FD ANSWER_FD`` (sealed by
pagedlab_course.grade.sandbox, in a process of its own) reads a job on stdin and runs it beside the
submission's process (pagedlab_course.grade.worker), to which it talks over the channel on the two
file descriptors (issue 46, item 1).

The setup cells run here and there; the solution cells only there; the check cells and hidden
checks only here, where no student code runs. A check reaches the student's functions and objects
through proxies (pagedlab_course.grade.proxy): the names the reference's solution cells bind and the
classes the setup cells define (which the student's code extends, ``MiniScheduler.admit = ...``)
are the student's; every other name (``error``, ``TOL``, the library the checks compare with) is
the judge's own. What a check prints is captured here and what the student's code prints there.
Results go to the grader as before, a JSON line as each cell and hidden check begins and ends
(read by pagedlab_course.grade.supervise).
"""

from __future__ import annotations

import builtins
import json
import os
import re
import signal
import sys
import time
import traceback
import types

from pagedlab_course.grade.channel import CellTimeout, Channel
from pagedlab_course.grade.proxy import Peer
from pagedlab_course.grade.rules import bound_names
from pagedlab_course.grade.seal import undumpable
from pagedlab_course.grade.worker import Capped

CELL_TASK = re.compile(r"<cell \d+: ([A-Z]\d+[.\w/]*)>")  # a solution cell's filename, naming its task
CHECK_OUTPUT = 1_000_000  # characters of a check's printed output kept per cell
GRACE = 2.0  # seconds past a cell's limit the judge waits for the submission's own alarm


class Notebook(types.SimpleNamespace):
    """The notebook's names, as a hidden check sees them (``nb.Allocator``)."""

    def __repr__(self):
        return "nb"


class Judge:
    """One job: the notebook's cells in order, then its hidden checks."""

    def __init__(self, job: dict, channel: Channel, stream):
        self.job, self.stream = job, stream
        self.peer = Peer(channel, self.exception_class)
        main = types.ModuleType("__main__")  # the checks' namespace; dataclasses look it up here
        sys.modules["__main__"] = main
        self.namespace = main.__dict__
        self.files: set[str] = set()  # cell filenames and hidden-check labels, for where an error was
        self.made: dict[tuple, type] = {}
        self.violations: list[dict] = []

    def exception_class(self, name: str, bases: list[str]) -> type:
        """The judge's class for an exception of the student's named ``name``: the setup's class of
        that name (``OutOfBlocks``), a builtin, or a subclass of the nearest one made here. Never a
        BaseException that is not an Exception, but the timeout."""
        if name == "CellTimeout":
            return CellTimeout
        for candidate in (name, *bases):
            found = self.namespace.get(candidate, getattr(builtins, candidate, None))
            if isinstance(found, type) and issubclass(found, Exception):
                break
        else:
            found = Exception
        if found.__name__ == name:
            return found
        return self.made.setdefault((name, found), type(name, (found,), {"__module__": "submission"}))

    def run(self) -> None:
        for cell in self.job["cells"]:
            self.send(begin=f"cell {cell['index']}")
            self.send(cell=self.cell(cell))
        self.hidden()
        self.send(done=True)

    def cell(self, cell: dict) -> dict:
        """Run one cell where it belongs; what the check code printed, the student's prints, the error."""
        kind, task = cell["kind"], cell["task"]
        filename = f"<cell {cell['index']}{': ' + task if kind == 'solution' else ''}>"
        self.files.add(filename)
        result = {"index": cell["index"], "error": None, "stdout": ""}
        if kind in ("setup", "solution"):
            result["error"] = self.timed(lambda: self.peer.ask("exec", name=filename, source=cell["source"]))
        if kind == "solution":
            self.bind(cell.get("names", []))
        else:
            out = sys.stdout = Capped(CHECK_OUTPUT)
            error = self.timed(lambda: exec(compile(cell["source"], filename, "exec"), self.namespace))
            sys.stdout = sys.__stdout__
            result["error"], result["stdout"] = error or result["error"], out.getvalue()
        if kind == "setup":
            self.bind([n for n in bound_names(cell["source"]) if _setup_class(self.namespace.get(n))])
        student = self.peer.output()  # a setup cell's prints there are the judge's here too
        result["student_stdout"] = "" if kind == "setup" else student
        self.blame(task or None)
        return result

    def bind(self, names: list[str]) -> None:
        """Bind the student's values of ``names`` here (what the submission does not bind stays unbound)."""
        try:
            self.namespace.update(self.peer.names(names))
        except Exception:  # noqa: BLE001 - a broken channel, or an answer that is not one:
            pass  # the checks that use the names fail, naming what broke

    def hidden(self) -> None:
        """After the cells: the hidden checks, each sent as it ends."""
        self.send(begin="loading the hidden checks")
        found, broken = hidden_checks(self.job["assignment"], self.job["hidden"])
        for entry in broken:
            self.send(hidden=entry)
        only = self.job["only"]
        found = [(label, fn, args) for label, fn, args in found if not only or fn.__grade_task__ in only]
        self.files.update(label for label, _, _ in found)
        for label, fn, args in found:
            self.send(begin=f"the hidden check {fn.__name__}")
            entry = {"name": fn.__name__, "task": fn.__grade_task__, "file": label,
                     "doc": " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split()), "error": None}
            sys.stdout = Capped(CHECK_OUTPUT)
            entry["error"] = self.timed(lambda: fn(Notebook(**self.namespace), *args))
            sys.stdout = sys.__stdout__
            self.peer.output()  # the student's prints during a hidden check are dropped
            self.blame(fn.__grade_task__)
            self.send(hidden=entry)

    def timed(self, run) -> dict | None:
        """Run ``run`` within the cell time limit: None, or its error. The submission's process gets
        the time left with each request; the judge's own alarm comes ``GRACE`` later."""
        limit = self.peer.limit = self.job["cell_timeout"]
        self.peer.deadline = time.monotonic() + limit

        def handler(signum, frame):
            raise CellTimeout(f"ran for more than {limit:g} s")

        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, limit + GRACE)
        try:
            try:
                run()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                self.peer.deadline = float("inf")
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a check's failure (even the student's exit()) is a result
            return _error(exc, self.files)
        return None

    def blame(self, task: str | None) -> None:
        """Each use of forbidden library code the student's code made, charged to the task of the
        solution cell it was made from, or else to ``task`` (the check that was running)."""
        for use in self.peer.forbidden:
            cell = CELL_TASK.match(use["where"])
            self.violations.append({"task": cell[1] if cell else task or "", "what": use["what"], "where": use["where"]})
        self.peer.forbidden.clear()

    def send(self, **item) -> None:
        """One line of results to the grader, with the library uses found since the last."""
        item["violations"], self.violations = self.violations, []
        self.stream.write(json.dumps(item) + "\n")
        self.stream.flush()


def _setup_class(value) -> bool:
    """A class a setup cell defines that the student's code works with (not an exception, which
    the judge keeps to catch by name)."""
    return isinstance(value, type) and value.__module__ == "__main__" and not issubclass(value, BaseException)


def _error(exc: BaseException, files) -> dict:
    """The exception, with the line of the student's code that raised it, or else the deepest
    notebook or hidden-check line it passed through."""
    ours = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in files]
    where = getattr(exc, "grade_where", "") or (f"{ours[-1].filename} line {ours[-1].lineno}" if ours else "")
    message = str(exc) + "".join(f"\n{n}" for n in getattr(exc, "__notes__", []))
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


def main() -> None:
    # Undumpable: at the process level, the submission's process (the same user, with no
    # capabilities: grade/seal.py) may not read this one's memory or open its pipes through /proc.
    undumpable()
    job = json.load(sys.stdin)
    stream = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # output that bypasses sys.stdout goes nowhere
    Judge(job, Channel(int(sys.argv[2]), int(sys.argv[1]), None), stream).run()


if __name__ == "__main__":
    main()
