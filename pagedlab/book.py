"""Helpers the chapters share: numbers computed in a cell and quoted in the prose.

In the book build, :func:`glue` hands a value to MyST-NB so the prose can quote it with
``{glue}`name```; in Colab or plain Jupyter (no MyST-NB) it just returns the value. The
formatters below are the one way prose quotes a number, so that a bound in the text is never
below the value a cell prints beside it and no phrase degenerates ("16 to 16", "+0%", "0e+00").
"""

from __future__ import annotations

import math
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


def excerpt(fn, first: str, last: str) -> None:
    """Show the lines of ``fn``'s source from the first one containing ``first`` to the next
    containing ``last``, dedented (a kernel is read a piece at a time)."""
    import inspect
    import textwrap

    from IPython.display import display

    lines = inspect.getsource(getattr(fn, "fn", fn)).splitlines()  # a JIT function wraps .fn
    i = next((n for n, line in enumerate(lines) if first in line), None)
    if i is None:
        raise ValueError(f"no line of {fn.__name__}'s source contains {first!r}")
    j = next((n for n in range(i, len(lines)) if last in lines[n]), None)
    if j is None:
        raise ValueError(f"no line of {fn.__name__}'s source after {first!r} contains {last!r}")
    display(Source(textwrap.dedent("\n".join(lines[i : j + 1]))))


RESULTS_URL = "https://raw.githubusercontent.com/pagedlab/pagedlab/main/benchmarks/results"


def gpu_results(name: str) -> dict:
    """A GPU measurement committed in ``benchmarks/results/<name>.json``, with its machine and
    date, for a chapter run without a GPU: from the repository beside the book, or (a pip
    install on Colab) from the repository online."""
    import json
    import urllib.request
    from pathlib import Path

    for root in (Path.cwd().parent, Path(__file__).resolve().parents[1]):  # book/ runs chapters
        path = root / "benchmarks" / "results" / f"{name}.json"
        if path.exists():
            return json.loads(path.read_text())
    try:
        with urllib.request.urlopen(f"{RESULTS_URL}/{name}.json", timeout=20) as response:
            return json.loads(response.read())
    except OSError as err:
        raise FileNotFoundError(f"benchmarks/results/{name}.json is neither beside the book "
                                f"nor reachable at {RESULTS_URL}: {err}") from err
