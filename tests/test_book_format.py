"""The number formatter the prose quotes through, and every glued value the chapters quote."""

import math
import re
from pathlib import Path

import nbformat
import pytest
from hypothesis import given, strategies as st

from pagedlab.book import bound, excerpt, show_source, signed_pct, span

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("x, text", [
    (1.5e-08, "2e-08"), (1e-08, "1e-08"), (1.01e-07, "2e-07"), (9.6e-05, "1e-04"),
    (0.0, "0"), (0.25, "0.3"), (3.2, "4"), (1234.0, "2,000"), (7e-09, "7e-09"),
])
def test_bound_rounds_up_to_the_digits_asked(x, text):
    assert bound(x) == text


@given(st.floats(min_value=1e-30, max_value=1e30), st.integers(1, 3))
def test_bound_is_never_below_the_value(x, digits):
    assert float(bound(x, digits).replace(",", "")) >= x
    assert float(bound(x, digits).replace(",", "")) <= x * (1 + 10 ** (1 - digits)) * (1 + 1e-12)


def test_bound_refuses_what_is_not_a_bound():
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="bound"):
            bound(bad)


def test_span_and_signed_pct_never_degenerate():
    assert span(16, 16.2, unit=" KiB") == "16 KiB" and span(16, 64) == "16 to 64"
    assert signed_pct(0.0004) == "0%" and signed_pct(-0.0004) == "0%"
    assert signed_pct(0.123) == "+12%" and signed_pct(-0.035, 1) == "-3.5%"


DEGENERATE = [
    (re.compile(r"^[+\-]0(\.0+)?%$"), "a signed zero percentage"),
    (re.compile(r"^[+\-]?0(\.0+)?e[+\-]0+$"), "zero in exponent notation"),
    (re.compile(r"^-0(\.0+)?$"), "negative zero"),
    (re.compile(r"^(\S+) to \1\b"), "a range with equal ends"),
]


def glued_values():
    """Every chapter's glued values, as its Colab copy stores them from the last book build."""
    for path in sorted((ROOT / "book").glob("ch*.ipynb")):
        glue = nbformat.read(path, as_version=4).metadata.get("pagedlab", {}).get("glue", {})
        yield from ((path.stem, name, value) for name, value in glue.items())


def test_no_glued_value_degenerates():
    values = list(glued_values())
    assert values, "no glued values stored: `make book notebooks`"
    bad = [(stem, name, value, why) for stem, name, value in values
           for pattern, why in DEGENERATE if pattern.search(value)]
    assert not bad, bad


def test_source_is_highlighted_in_html_and_plain_in_text():
    src = show_source(bound)
    assert repr(src).startswith("def bound(x: float, digits: int = 1) -> str:")
    html = src._repr_html_()
    assert 'style="color:' in html and ">def</span>" in html, "colours inline, not by class"
    assert "&quot;&quot;&quot;An upper bound" in html or "An upper bound" in html


def test_excerpt_displays_a_marked_section_highlighted(monkeypatch):
    from pagedlab.book import Source
    from pagedlab.kernels import decode

    shown = []
    monkeypatch.setattr("IPython.display.display", shown.append)
    excerpt(decode._paged_attention_kernel, "masks")
    (source,) = shown
    assert isinstance(source, Source) and "# >>>" not in repr(source) and "# <<<" not in repr(source)
    assert "<span" in source._repr_html_()  # colours inlined: the book, Jupyter and Colab show them


def test_bound_takes_a_tensor_as_the_chapters_compute_it():
    import torch

    assert bound(torch.tensor([1e-9, 1.5e-8], dtype=torch.float64).max()) == "2e-08"


@pytest.mark.parametrize("name", ["swap-gpu", "split-kv-gpu", "decode-gpu"])
def test_committed_gpu_results_name_their_machine_and_date(name):
    from pagedlab.book import gpu_results

    run = gpu_results(name)
    assert run["device"].startswith("NVIDIA") or "H200" in run["device"]
    if "rows" in run:
        assert run["date"] and all(len(r) == len(run["columns"]) for r in run["rows"])
