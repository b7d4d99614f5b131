"""The submission's process: ``python -m pagedlab_course.grade.worker FORBIDDEN_JSON`` (sealed by
pagedlab_course.grade.sandbox) runs the notebook's setup and solution cells when the judge asks
(pagedlab_course.grade.judge), and answers the judge's requests on its objects over the channel on
its stdin and stdout (pagedlab_course.grade.channel). No check runs here, no check's source is
here, and nothing here decides a grade: what this process answers is the student's code's word,
which the judge takes as plain data and compares with its own (issue 46, item 1). Code that
rewrites this module, forges an answer or patches a comparison here changes only what the
student's own functions answer.

The assignment's forbidden library is not here to use: each forbidden module imports as a stub
whose every name refuses to be used (a setup cell imports the library for the checks, which run
in the judge), each forbidden callable (``torch.softmax``) is replaced likewise before any cell
runs, and under bubblewrap the modules' files are not in the sandbox at all
(``sandbox.bwrap_command``), so that no spelling, thread or helper brings them back.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import io
import json
import operator
import os
import pickle
import signal
import sys
import traceback
import types
from collections import deque

from pagedlab_course.grade.channel import CellTimeout, Channel
from pagedlab_course.grade.copyout import Encoder, data_descriptor
from pagedlab_course.grade.seal import undumpable

CELL_PREFIX = "<cell "  # filename of a notebook cell's code: "<cell 7: A2.1>" or "<cell 8>"
STUDENT_OUTPUT = 20_000  # characters of the student's prints kept per cell or hidden check
INPLACE = {"+=": operator.iadd, "-=": operator.isub, "|=": operator.ior}


class ForbiddenUse(RuntimeError):
    """The student's code used library code the assignment forbids."""


USED: list[dict] = []  # each use of a forbidden name since the judge last asked: {"what", "where"}


class Forbidden:
    """A forbidden module's name as this process has it: importing it works, any use raises and
    is recorded (on any thread, through any helper), for the judge to charge to a task."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def _refuse(self, *args, **kwargs):
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(CELL_PREFIX) and ": " in f.filename]
        USED.append({"what": f"uses {self._name}", "where": f"{frames[-1].filename} line {frames[-1].lineno}" if frames else ""})
        raise ForbiddenUse(f"{self._name} is not available to your code: the assignment forbids it")

    __call__ = _refuse

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()

    def __mro_entries__(self, bases):
        self._refuse()

    def __repr__(self):
        return f"<forbidden {self._name}>"


class _Stub(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Forbidden(f"{self.__name__}.{name}")


class _Blocker(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports each forbidden module, and every module below it, as a stub."""

    def __init__(self, modules: list[str]):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == m or fullname.startswith(m + ".") for m in self.modules):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def block(modules: list[str], callables: list[str]) -> None:
    """Make the forbidden modules and callables unusable here, before any cell runs."""
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in modules):
            del sys.modules[name]
    sys.meta_path.insert(0, _Blocker(modules))
    for name in callables:
        owner_name, _, attr = name.rpartition(".")
        setattr(_resolve(owner_name), attr, Forbidden(name))


def _resolve(dotted: str):
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


class Capped(io.StringIO):
    """The student's prints, kept up to ``limit`` characters; the rest counted and cut with a note."""

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


class Callback:
    """A function of the judge's (a check's ``key_fn``), called there."""

    def __init__(self, submission: Submission, key: int):
        self.submission, self.key = submission, key

    def __call__(self, *args, **kwargs):
        sub = self.submission
        encoder = Encoder(sub.export)
        header = {"op": "callback", "cb": self.key, "args": encoder.value(list(args)),
                  "kwargs": {"t": "dict", "v": [[k, encoder.value(v)] for k, v in kwargs.items()]},
                  "blobs": [len(b) for b in encoder.blobs]}
        reply, payload = sub.channel.request(header, b"".join(encoder.blobs))
        if "error" in reply:
            error = reply["error"]
            raise type(str(error.get("type", "Error")), (RuntimeError,), {})(error.get("message", ""))
        return sub.borrow(payload)


class Submission:
    """The notebook's namespace and the objects the judge holds handles to."""

    def __init__(self):
        main = types.ModuleType("__main__")  # the notebook's namespace; dataclasses look it up here
        sys.modules["__main__"] = main
        self.namespace = main.__dict__
        self.objects: dict[int, object] = {}  # handle -> object, kept alive while the judge holds it
        self.handles: dict[int, int] = {}  # id(object) -> handle
        self.made = 0  # handles handed out
        self.out = sys.stdout = Capped(STUDENT_OUTPUT)
        self.channel: Channel | None = None
        self.depth = 0  # requests being answered (a callback's nested requests keep the outer alarm)

    def export(self, obj) -> int:
        h = self.handles.get(id(obj))
        if h is None:
            h = self.handles[id(obj)] = self.made
            self.objects[h], self.made = obj, self.made + 1
        return h

    def borrow(self, payload: bytes):
        """The judge's pickled value: its handles back to objects, its functions as callbacks."""
        unpickler = pickle.Unpickler(io.BytesIO(payload))
        unpickler.persistent_load = self._load
        return unpickler.load()

    def _load(self, pid):
        if pid[0] == "h":
            return self.objects[pid[1]]
        if pid[0] == "m":
            return getattr(self.objects[pid[1]], pid[2])
        return Callback(self, pid[1])

    def serve(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """Answer one request of the judge: {"value": ...}, {"method": true} or {"error": ...}."""
        for h in header.get("release") or ():
            self.handles.pop(id(self.objects.pop(h, None)), None)
        encoder = Encoder(self.export)
        self.depth += 1
        try:
            if self.depth == 1 and type(header.get("timeout")) in (int, float):
                _alarm(header["timeout"])
            reply = self._answer(header, payload, encoder)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the student's error (even exit()) is the answer
            encoder = Encoder(self.export)
            reply = {"error": _error(exc, encoder)}
        finally:
            if self.depth == 1:
                signal.setitimer(signal.ITIMER_REAL, 0)
            self.depth -= 1
        reply["blobs"] = [len(b) for b in encoder.blobs]
        return reply, b"".join(encoder.blobs)

    def _answer(self, header: dict, payload: bytes, encoder: Encoder) -> dict:
        op, name = header["op"], header.get("name")
        if op == "exec":
            exec(compile(header["source"], name, "exec"), self.namespace)
            return {"value": None}
        if op == "names":
            return {"value": {"t": "dict", "v": [[n, encoder.value(self.namespace[n], True)]
                                                 for n in name if n in self.namespace]}}
        if op == "output":
            text, self.out = self.out.getvalue(), Capped(STUDENT_OUTPUT)
            sys.stdout = self.out
            used, USED[:] = USED[:100], []
            return {"value": text, "forbidden": used}
        obj = self.objects[header["h"]]
        arg = self.borrow(payload) if payload else None
        if op == "getattr":
            value = getattr(obj, name)
            if isinstance(value, (types.MethodType, types.BuiltinMethodType)) and value.__self__ is obj:
                return {"method": True}
            reply = {"value": encoder.value(value, True)}
            if _has_attrs(obj):
                reply["self"] = encoder.attrs(obj, 0)
            others = [h for h in header.get("also") or () if h in self.objects and _has_attrs(self.objects[h])]
            reply["others"] = {str(h): encoder.attrs(self.objects[h], 0) for h in others[:32]}
            return reply
        if op == "snapshot":  # a container's, whole, whatever the budget
            encoder.budget = 1 << 60
            return {"value": encoder.value(obj, True)}
        results = {
            "call": lambda: encoder.value(obj(*arg[0], **arg[1])),
            "callmethod": lambda: encoder.value(getattr(obj, name)(*arg[0], **arg[1])),
            "setattr": lambda: setattr(obj, name, arg),
            "delattr": lambda: delattr(obj, name),
            "getitem": lambda: encoder.value(obj[arg], True),
            "setitem": lambda: operator.setitem(obj, *arg),
            "delitem": lambda: operator.delitem(obj, arg),
            "len": lambda: len(obj),
            "iter": lambda: {"t": "list", "v": [encoder.value(v, True) for v in obj]},
            "contains": lambda: arg in obj,
            "bool": lambda: bool(obj),
            "repr": lambda: repr(obj),
            "str": lambda: str(obj),
            "format": lambda: format(obj, name),
            "inplace": lambda: encoder.value(INPLACE[name](obj, arg), True),
        }
        if _pure(obj, op, name):  # no code of the student's ran: the judge's other reads stay good
            value = results[op]()
            return {"pure": True, "target": encoder.value(obj, True), "value": value}
        return {"value": results[op]()}


PURE_METHODS = {"append", "extend", "insert", "pop", "clear", "reverse", "appendleft", "popleft", "extendleft"}


def _pure(obj, op: str, name) -> bool:
    """Whether ``op`` on ``obj`` runs no code of the student's: a plain attribute set, or a change
    to a list or deque that compares, hashes or orders nothing."""
    if op == "setattr":
        cls = type(obj)
        return cls.__setattr__ is object.__setattr__ and _has_attrs(obj) and not data_descriptor(cls, name)
    return type(obj) in (list, deque) and (op in ("setitem", "delitem") or op == "inplace" and name == "+="
                                            or op == "callmethod" and name in PURE_METHODS)


def _has_attrs(obj) -> bool:
    return type(getattr(obj, "__dict__", None)) is dict and not isinstance(obj, (types.ModuleType, type))


def _alarm(seconds: float) -> None:
    def handler(signum, frame):
        raise CellTimeout(f"ran past the time left to its cell ({seconds:g} s)")

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))


def _error(exc: BaseException, encoder: Encoder) -> dict:
    """The exception as the judge rebuilds it: its class's names, message, plain arguments and
    attributes, and the deepest line of a notebook cell it passed through."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(CELL_PREFIX)]
    try:
        message = str(exc) + "".join(f"\n{n}" for n in getattr(exc, "__notes__", []))
    except Exception:  # noqa: BLE001 - a __str__ that raises
        message = f"<{type(exc).__name__} whose message could not be made>"
    error = {"type": type(exc).__name__, "bases": [c.__name__ for c in type(exc).__mro__[1:-1]],
             "message": message if len(message) <= 2000 else message[:2000] + " [...]",
             "where": f"{frames[-1].filename} line {frames[-1].lineno}" if frames else ""}
    plain = (type(None), bool, int, float, str)
    if all(type(a) in plain for a in exc.args):
        error["args"] = encoder.value(tuple(exc.args))
    attrs = {k: v for k, v in vars(exc).items() if type(k) is str and type(v) in plain} if hasattr(exc, "__dict__") else {}
    if attrs:
        error["attrs"] = attrs
    return error


def main() -> None:
    undumpable()  # at the process level, a neighbour of the same user may not open its pipes through /proc
    forbidden = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    block(forbidden.get("modules", []), forbidden.get("callables", []))
    out = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # output that bypasses sys.stdout goes nowhere
    submission = Submission()
    submission.channel = Channel(0, out, submission.serve)
    submission.channel.listen()


if __name__ == "__main__":
    main()
