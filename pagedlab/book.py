"""Helpers the chapters share: numbers quoted in the prose, source excerpts, differences.

In the book build, :func:`glue` hands a value to MyST-NB so the prose can quote it with
``{glue}`name```; in Colab or plain Jupyter (no MyST-NB) it just returns the value. The
formatters below are the one way prose quotes a number, so that a bound in the text is never
below the value a cell prints beside it and no phrase degenerates ("16 to 16", "+0%", "0e+00").
:func:`excerpt` shows a marked section of a function's source, highlighted; :func:`max_diff`
measures how far two tensors are apart.
"""

from __future__ import annotations

import inspect
import math
import re
import textwrap
from decimal import ROUND_CEILING, Decimal

try:
    from myst_nb import glue as _myst_glue
except ImportError:  # Colab, plain Jupyter
    _myst_glue = None


def glue(name: str, value, display: bool = False):
    """Register ``value`` under ``name`` for the prose; return it unchanged."""
    if _myst_glue is not None:
        _myst_glue(name, value, display=display)
    return value


def bound(x: float, digits: int = 1) -> str:
    """An upper bound as prose quotes it: ``x`` rounded *up* to ``digits`` significant
    digits (1.5e-08 gives "2e-08", never "1e-08"); exactly zero gives "0"."""
    x = float(x)  # a 0-d tensor or numpy scalar too
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"a bound must be finite and >= 0, got {x!r}")
    if x == 0:
        return "0"
    exp = math.floor(math.log10(x))
    step = Decimal(1).scaleb(1 - digits)
    mantissa = Decimal(repr(x)).scaleb(-exp).quantize(step, rounding=ROUND_CEILING)
    if mantissa >= 10:  # 9.6 rounded up is 10: one more digit of exponent
        mantissa, exp = (mantissa / 10).quantize(step, rounding=ROUND_CEILING), exp + 1
    if -3 <= exp < 4:
        return f"{float(mantissa.scaleb(exp)):,.{max(0, digits - 1 - exp)}f}"
    return f"{mantissa:.{digits - 1}f}e{exp:+03d}"


def span(lo: float, hi: float, fmt: str = ",.0f", unit: str = "") -> str:
    """A range as prose quotes it, "16 to 64 KiB"; one value when both ends print alike."""
    a, b = format(lo, fmt), format(hi, fmt)
    return f"{a}{unit}" if a == b else f"{a} to {b}{unit}"


def signed_pct(x: float, digits: int = 0) -> str:
    """A relative change as a signed percentage, "+12%" or "-3.5%"; "0%" where it rounds
    to nothing (never "+0%" or "-0%")."""
    text = f"{x:+.{digits}%}"
    return "0%" if float(text[:-1]) == 0 else text


class Source:
    """Python source shown with highlighting: colours inlined in the HTML, so the book,
    Jupyter and Colab all show them; plain text in a terminal or under nbval."""

    def __init__(self, code: str):
        self.code = code

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        html = highlight(self.code, PythonLexer(), HtmlFormatter(noclasses=True, nobackground=True))
        return f'<div class="pagedlab-source" style="overflow-x:auto">{html}</div>'

    def __repr__(self) -> str:
        return self.code


def show_source(*objects) -> Source:
    """The source of functions, methods or classes (a Triton kernel's too), one after another."""
    import inspect

    return Source("\n\n".join(inspect.getsource(getattr(o, "fn", o)).rstrip("\n")
                              for o in objects))


RESULTS_URL = "https://raw.githubusercontent.com/pagedlab/pagedlab/main/benchmarks/results"


def gpu_results(name: str) -> dict:
    """A measurement committed in ``benchmarks/results/<name>.json``, with its machine and
    date, for a chapter run where it was not measured: from the repository beside the book,
    or (a pip install on Colab) from the repository online, downloaded once into
    ``$PAGEDLAB_CACHE/results`` as the traces are."""
    import json
    from pathlib import Path

    from pagedlab.checkpoints import cache_dir, download_to_cache

    cached = cache_dir() / "results" / f"{name}.json"
    for path in (Path.cwd().parent / "benchmarks" / "results" / f"{name}.json",  # from book/
                 Path.cwd() / "benchmarks" / "results" / f"{name}.json",  # from the root
                 cached):
        if path.exists():
            return json.loads(path.read_text())
    try:
        return json.loads(download_to_cache(f"{RESULTS_URL}/{name}.json", cached).read_text())
    except OSError as err:
        raise FileNotFoundError(f"benchmarks/results/{name}.json is neither beside the book "
                                f"nor in {cached.parent} nor reachable at {RESULTS_URL}: "
                                f"{err}") from err


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
    from IPython.display import display

    display(Source(textwrap.dedent("\n".join(s for s in lines if not _MARKER.match(s)))))


def max_diff(a, b) -> float:
    """The largest absolute elementwise difference of two tensors, computed in float64."""
    return (a.double() - b.double()).abs().max().item()
