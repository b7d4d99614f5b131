"""Where Triton cannot be imported (macOS, Windows): the kernels can be read, and the torch
references run in their place.

Triton publishes Linux wheels only. Chapters 7, 9 and 11 still show each kernel's source and use
its module's constants and plain functions (``decode.TILE_TOKENS``, ``decode.choose_num_splits``).
So there ``pagedlab.kernels.decode`` and its siblings are :func:`source_only`: the module's
own file run with this stand-in for ``triton`` and ``triton.language``. A ``@triton.jit``
function keeps its Python function as ``.fn``, so ``pagedlab.book.excerpt`` and ``show_source``
read it. Launching one runs its torch reference if it has one (:data:`REFERENCES`), and raises
an ImportError that names Triton if not. The module's public kernels are their references
(:func:`reference_for`). Each stand-in says once, when it first runs, what ran instead.

Where Triton imports none of this is used: :func:`pagedlab.kernels.kernel_or_reference` returns
the kernel itself.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import math
import types
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path

from pagedlab.device import has_triton, require_triton
from pagedlab.kernels.catalog import KERNELS, TRITON_MODULES

__all__ = ["triton", "tl", "source_only", "reference_for", "REFERENCES"]

_said: set[str] = set()


def say_once(kernel: str, instead: str) -> None:
    """Print, the first time ``kernel`` runs here, that ``instead`` ran in its place."""
    if kernel not in _said:
        _said.add(kernel)
        print(f"No Triton here (macOS, Windows): {instead} ran in place of the kernel {kernel}.")


class _Absent:
    """Any name of ``triton.language`` (``tl.constexpr``, ``tl.int64``): it can be named,
    called and annotated with, but only the real Triton computes with it."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, name):
        return _Absent(f"{self.name}.{name}")

    def __call__(self, *args, **kwargs):
        return self

    def __repr__(self):
        return f"<{self.name}: needs Triton>"


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")


class JITFunction:
    """What ``@triton.jit`` makes here: the function, readable; launching it runs
    ``REFERENCES[name]`` or raises."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        name = self.fn.__name__
        if name not in REFERENCES:
            require_triton(f"launching {self.fn.__module__}.{name}",
                           "the torch references in pagedlab.kernels")

        def launch(*args, **kwargs):
            say_once(name, f"its torch reference, pagedlab.kernels.stand_in.{name},")
            return REFERENCES[name](grid, *args, **kwargs)

        return launch


def _jit(fn=None, **options):
    return JITFunction(fn) if fn is not None else JITFunction


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


triton = _Module("triton", "A stand-in for Triton: kernels can be defined and read here.")
triton.jit = _jit
triton.cdiv = lambda a, b: -(-a // b)
triton.next_power_of_2 = _next_power_of_2
tl = _Module("triton.language")
triton.language = tl
triton.runtime = _Module("triton.runtime")
triton.runtime.interpreter = _Module("triton.runtime.interpreter")


# --- the book's own small kernels (chapter 7), in torch --------------------------------------


def gather_keys(grid, cache, table, out, seq_len, BLOCK_SIZE, DIM):
    """Chapter 7's ``gather_keys``: each logical block's keys copied out in table order."""
    out[:seq_len] = cache[table.long()].reshape(-1, DIM)[:seq_len]
    print("physical blocks, in program order:", table[:grid[0]].tolist())


def print_slots(grid, block_tables, seq_lens, stride_t, BLOCK_SIZE, TILE):
    """Chapter 7's ``print_slots``: the slots of each tile of each sequence, -1 where masked."""
    for seq in range(grid[0]):
        n = int(seq_lens[seq])
        for start in range(0, n, TILE):
            tokens = [start + i for i in range(TILE)]
            print(f"program {seq}, slots:", [
                int(block_tables[seq, t // BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE
                if t < n else -1 for t in tokens])


REFERENCES = {"gather_keys": gather_keys, "print_slots": print_slots}


# --- pagedlab's kernel modules, readable without Triton --------------------------------------


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    """``__import__`` for a module run by :func:`source_only`: Triton is the stand-in, and
    pagedlab's other Triton modules are source-only too."""
    if name == "triton" or name.startswith("triton."):
        module = triton
        for part in name.split(".")[1:] if fromlist else ():
            module = getattr(module, part)
        return module
    if fromlist and name.startswith("pagedlab.kernels."):
        short = name.removeprefix("pagedlab.kernels.")
        if short in TRITON_MODULES:
            return source_only(short)
    return builtins.__import__(name, globals, locals, fromlist, level)


@functools.cache
def source_only(name: str) -> types.ModuleType:
    """``pagedlab.kernels.<name>`` run from its file with the stand-in Triton: constants, plain
    functions and the kernels' source are there, and its public kernels are their references.
    Not put in ``sys.modules``: ``import pagedlab.kernels.<name>`` still fails without Triton."""
    path = Path(find_spec(f"pagedlab.kernels.{name}").origin)  # found, not imported
    module = types.ModuleType(f"pagedlab.kernels.{name}")
    module.__file__ = str(path)
    module.__dict__["__builtins__"] = {**vars(builtins), "__import__": _import}
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    for kernel, (home, _) in KERNELS.items():
        if home == name:
            setattr(module, kernel, _standing_in(kernel, getattr(module, kernel)))
    return module


def reference_for(kernel: str):
    """The torch reference that runs in place of ``pagedlab.kernels.<kernel>``: it takes the
    kernel's arguments, ignores those that only tune the launch (``num_splits``, ``logits``,
    ...), and says once that it ran instead."""
    home = KERNELS[kernel][0]
    if not has_triton():
        return getattr(source_only(home), kernel)
    return _standing_in(kernel, getattr(import_module(f"pagedlab.kernels.{home}"), kernel))


def _standing_in(kernel: str, kernel_function):
    """``kernel``'s reference, taking ``kernel_function``'s arguments."""
    where = KERNELS[kernel][1]
    module, function = where.rsplit(".", 1)
    reference = getattr(import_module(f"pagedlab.kernels.{module}"), function)
    takes = set(inspect.signature(reference).parameters)
    launch_only = set(inspect.signature(kernel_function).parameters) - takes

    @functools.wraps(reference)
    def run(*args, **kwargs):
        say_once(kernel, f"its torch reference, pagedlab.kernels.{where},")
        return reference(*args, **{k: v for k, v in kwargs.items() if k not in launch_only})

    run.launch_only = frozenset(launch_only)
    return run
