"""Helpers the chapters share: numbers quoted in the prose, source excerpts, differences.

In the book build, :func:`glue` hands a value to MyST-NB so the prose can quote it with
``{glue}`name```; in Colab or plain Jupyter (no MyST-NB) it just returns the value.
:func:`excerpt` prints a marked section of a function's source; :func:`max_diff` measures how
far two tensors are apart.
"""

from __future__ import annotations

import inspect
import re
import textwrap

try:
    from myst_nb import glue as _myst_glue
except ImportError:  # Colab, plain Jupyter
    _myst_glue = None


def glue(name: str, value, display: bool = False):
    """Register ``value`` under ``name`` for the prose; return it unchanged."""
    if _myst_glue is not None:
        _myst_glue(name, value, display=display)
    return value


# "# >>> name" opens a section of a source, "# <<< name" closes it
_MARKER = re.compile(r"^\s*# (>>>|<<<) (\w+)\s*$")


def excerpt(fn, section: str | None = None) -> None:
    """Print ``fn``'s source, or the lines between its markers ``# >>> section`` and
    ``# <<< section``, without any marker line.

    Sections are named by markers rather than found by the text of a comment, so that
    rewording a comment in the source cannot move or break an excerpt in the book.
    """
    fn = getattr(fn, "fn", fn)  # a Triton JIT function wraps the Python function as .fn
    lines = inspect.getsource(fn).splitlines()
    if section is not None:
        marks = {m.groups(): i for i, m in enumerate(map(_MARKER.match, lines)) if m}
        try:
            lines = lines[marks[">>>", section] + 1 : marks["<<<", section]]
        except KeyError:
            found = sorted({name for _, name in marks})
            raise ValueError(
                f"{fn.__qualname__} has no section {section!r} (# >>> {section} ... "
                f"# <<< {section}); its sections: {found}"
            ) from None
    print(textwrap.dedent("\n".join(line for line in lines if not _MARKER.match(line))))


def max_diff(a, b) -> float:
    """The largest absolute elementwise difference of two tensors, computed in float64."""
    return (a.double() - b.double()).abs().max().item()
