"""What a solution cell may do, checked on its text before it runs.

A first line of defence: the check cells and hidden checks run in the judge, a process where no
student code runs (``pagedlab_course.grade.judge``), so code that gets past these rules reaches only
the submission's own process. They keep a student's code to what the assignments need: no
introspection (frames, globals, ``sys``, ``gc``, ``inspect``, dunder attributes such as
``__globals__`` and ``__wrapped__``), no code the rules have not seen (``exec``, ``eval``,
``compile``, ``open``, imports outside the assignments' list), and no changes to what the
notebook's other cells rely on (attributes of imported modules, the builtins and names the setup
cells define). A cell that breaks one is not run; its tasks get the refusal, which names the line and
the rule. RestrictedPython was evaluated for this and not used: it rejects 4 of the 25 reference
solution cells (``self.x += 1``) and rewrites every attribute access through a guard function,
which Triton's ``@triton.jit`` (it re-reads the source) and the interpreter's speed cannot take.
"""

from __future__ import annotations

import _string
import ast
import builtins
import string
from dataclasses import dataclass

IMPORTS = ("torch", "triton", "math", "collections", "dataclasses", "itertools", "heapq", "typing",
           "numpy", "functools", "bisect", "random", "enum", "abc")
INTROSPECTION = {"sys", "gc", "inspect", "ctypes", "importlib", "builtins", "os", "subprocess",
                 "exec", "eval", "compile", "open", "globals", "locals", "vars", "getattr", "setattr",
                 "delattr", "breakpoint", "input", "memoryview", "exit", "quit"}
# Attributes that lead from a value to frames, code, or native code and files.
ESCAPES = {"f_back", "f_globals", "f_locals", "f_builtins", "f_code", "gi_frame", "gi_code", "cr_frame",
           "cr_code", "ag_frame", "ag_code", "tb_frame", "tb_next", "co_code", "ctypes", "ctypeslib",
           "cpp_extension", "load_inline", "library", "from_file", "fromfile", "tofile", "_getframe", "exc_info",
           "_current_frames", "settrace", "setprofile"}
# Modules outside the list that an allowed module holds as an attribute (``dataclasses.sys``,
# ``random._os``, ``torch.serialization.pickle``): refused after an imported name or in an import's
# path, with or without leading underscores (the review of issue 46, C27).
MODULES_OUTSIDE = {"sys", "os", "posix", "builtins", "importlib", "inspect", "ctypes", "ctypeslib", "gc", "subprocess",
                   "threading", "thread", "multiprocessing", "pickle", "marshal", "shelve", "copyreg", "signal",
                   "socket", "shutil", "io", "pathlib", "tempfile", "glob", "runpy", "pkgutil", "code", "codeop",
                   "traceback", "types", "weakref", "atexit", "faulthandler", "tracemalloc", "resource", "mmap", "pty",
                   "fcntl", "asyncio", "concurrent", "sysconfig", "site", "linecache", "tokenize", "dis", "pdb",
                   "zipimport", "urllib", "http", "cpp_extension", "serialization"}
ALLOWED_DUNDERS = {"__init__"}

RULE_IMPORT = "imports only " + ", ".join(IMPORTS)
RULE_INTROSPECT = "no introspection of frames, globals or the grader, no exec, eval, compile or open"
RULE_MODULE = "no assignment to attributes of imported modules or of the names imported from them"
RULE_NAME = "no rebinding of builtins, of names the setup cells define or of names one check cell leaves for another"
RULE_SPECIAL = ("no special methods but __init__ and __post_init__: the checks compare, print, count and "
                "convert your results with Python's own")
SPECIAL_ALLOWED = {"__init__", "__post_init__"}
RULE_FORBIDDEN = "the assignment forbids this library"


@dataclass(frozen=True)
class Breach:
    line: int
    what: str
    rule: str

    def text(self) -> str:
        return f"line {self.line}: {self.what} ({self.rule})"


def bound_names(source: str) -> dict[str, str | None]:
    """Names a cell binds at its top level, each with the dotted name an import binds it to
    (None for anything else): a solution cell may repeat a setup cell's import, no more."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    found = {}
    for name, what, _ in _bindings(tree):
        found[name] = what if found.get(name, what) == what else None
    return found


def free_names(source: str) -> set[str]:
    """Names a cell reads but binds nowhere in it (not at top level, in a function, as a
    parameter or a comprehension's variable): what it takes from earlier cells."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    loads, stores = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else stores).add(n.id)
        elif isinstance(n, ast.arg):
            stores.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stores.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            stores |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return loads - stores


def _top_level(stmt):
    """The nodes of a statement that bind at module level: not inside a def or class, nor a
    comprehension's own variables (Python 3 binds them in the comprehension), but an assignment
    expression inside a comprehension (it binds outside)."""
    yield stmt
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        return
    if isinstance(stmt, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        yield from (node.target for node in ast.walk(stmt) if isinstance(node, ast.NamedExpr))
        return
    for child in ast.iter_child_nodes(stmt):
        yield from _top_level(child)


def check(source: str, *, forbid=(), protected=None) -> list[Breach]:
    """The rules ``source`` breaks. ``forbid``: the assignment's forbidden modules and callables;
    ``protected``: names a submission may not rebind, each with the dotted name an import
    binds it to (see :func:`bound_names`; ``Assignment.protected``)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # it fails when it runs, with Python's own message
    protected = {**{name: None for name in dir(builtins)}, **dict(protected or {})}
    modules = set(IMPORTS) | {name for name, what in protected.items() if what}  # and what they export
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.level:
                found.append(Breach(line, "a relative import", RULE_IMPORT))
                continue
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                found.append(Breach(line, f"imports * from {node.module}", RULE_NAME))  # binds names unseen
            for name in _imported(node):
                if any(name == f or name.startswith(f + ".") for f in forbid):
                    found.append(Breach(line, f"imports {name}", RULE_FORBIDDEN))
                elif name.split(".")[0] not in IMPORTS or any(_outside(part) for part in name.split(".")[1:]):
                    found.append(Breach(line, f"imports {name}", RULE_IMPORT))
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name):
            if node.id in INTROSPECTION or node.id.startswith("__"):
                found.append(Breach(line, f"`{node.id}`", RULE_INTROSPECT))
        elif isinstance(node, ast.Attribute):
            if _dunder(node.attr) and node.attr not in ALLOWED_DUNDERS or node.attr in ESCAPES or \
                    _outside(node.attr) and getattr(_root(node), "id", None) in modules:
                found.append(Breach(line, f"`.{node.attr}`", RULE_INTROSPECT))
        elif isinstance(node, ast.MatchClass):  # `case object(gi_frame=f)` reads the attribute
            for attr in node.kwd_attrs:
                if _dunder(attr) or attr in ESCAPES:
                    found.append(Breach(line, f"`{attr}=`", RULE_INTROSPECT))
        elif isinstance(node, ast.keyword) and node.arg and _dunder(node.arg) and node.arg not in SPECIAL_ALLOWED:
            found.append(Breach(line, f"`{node.arg}=`", RULE_SPECIAL))  # type(name, bases, dict(__eq__=...))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _dunder(node.name):
            if node.name not in SPECIAL_ALLOWED:
                found.append(Breach(line, f"defines {node.name}", RULE_SPECIAL))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _dunder(node.value.strip()):
            found.append(Breach(line, f"the string {node.value!r}", RULE_INTROSPECT))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "{" in node.value:
            found += [Breach(line, f"the format field {field!r}", RULE_INTROSPECT) for field in _format_walks(node.value)]
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in set(node.names) & set(protected):
                found.append(Breach(line, f"`global {name}`", RULE_NAME))
    found += _module_writes(tree, modules)
    found += [Breach(line, f"rebinds `{name}`", RULE_NAME) for name, what, line in _bindings(tree)
              if name in protected and (what is None or protected[name] != what)]
    return sorted(set(found), key=lambda b: (b.line, b.what))


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _outside(name: str) -> bool:
    """Whether ``name`` is a module outside the list (``_os`` too)."""
    return name.lstrip("_") in MODULES_OUTSIDE


def _format_walks(text: str, depth: int = 0) -> list[str]:
    """The fields of a format string that read a dunder or escape attribute (``'{0.__class__}'``):
    ``str.format`` walks them on whatever it is given (the review of issue 46, C28)."""
    found = []
    try:
        for _, field, spec, _ in string.Formatter().parse(text):
            if field is not None:
                first, rest = _string.formatter_field_name_split(field)
                if any(is_attr and (_dunder(key) or key in ESCAPES) for is_attr, key in rest):
                    found.append(field)
            if spec and depth < 2:
                found += _format_walks(spec, depth + 1)
    except ValueError:  # not a format string
        return found
    return found


def _imported(node) -> list[str]:
    """Dotted names an import statement takes: ``from a import b`` takes ``a.b``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [f"{node.module}.{a.name}" for a in node.names]


def _root(node) -> ast.Name | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node if isinstance(node, ast.Name) else None


def _module_writes(tree, modules: set[str]) -> list[Breach]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            root = _root(node)
            if root is not None and root.id in modules:
                found.append(Breach(node.lineno, f"assigns to {ast.unparse(node)}", RULE_MODULE))
    return found


def _bindings(tree):
    """(name, dotted import or None, line) of every top-level binding (not inside a def or class)."""
    for stmt in tree.body:
        for node in _top_level(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield node.name, None, node.lineno
            elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
                yield node.name, None, node.lineno  # `except E as error`, `case error`, `case [*error]`
            elif isinstance(node, ast.MatchMapping) and node.rest:
                yield node.rest, None, node.lineno
            elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                yield node.id, None, node.lineno
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias, name in zip(node.names, _imported(node)):
                    if isinstance(node, ast.Import) and alias.asname is None:
                        yield name.split(".")[0], name.split(".")[0], node.lineno
                    else:
                        yield alias.asname or alias.name, name, node.lineno
