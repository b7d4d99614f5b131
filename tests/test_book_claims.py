"""Every claim the prose makes about another system has a row on book/versions.md.

A paragraph of the chapters, the preface or the glossary that mentions vLLM (V0 or V1), SGLang,
nano-vllm or transformers' continuous batching carries a marker, ``<!-- claim: ID -->`` (several ids: ``<!-- claim: ID1 ID2 -->``),
at the end of the sentence that makes the claim. MyST renders an inline HTML comment as raw
HTML, which the browser does not show, and the Colab copies pass it through as it is. The
marker names a row of the table on book/versions.md, which says what the claim rests on and
when it was checked. Here: every such paragraph has a marker, every marker names a row, every
row is named by some marker, and each row lists the pages that name it.
"""

from __future__ import annotations

import re
from pathlib import Path

from book_text import ID, MARKER, Paragraph, paragraphs

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
VERSIONS = BOOK / "versions.md"
PAGES = [*sorted(BOOK.glob("ch*.md")), BOOK / "preface.md", BOOK / "glossary.md"]

ANY_MARKER = re.compile(r"<!--\s*claims?\b[^>]*-->|<!--\s*claims?\b")
# what makes a paragraph need a marker (case-sensitive: "v1" and "vllm" in ids and paths do not)
TRIGGER = re.compile(r"vLLM|\bV[01]\b|SGLang|generate_batch|ContinuousBatchingManager")
NANO = re.compile(r"nano-vllm", re.IGNORECASE)
CONTINUOUS = re.compile(r"continuous\s+batching", re.IGNORECASE)
TRANSFORMERS = re.compile(r"\btransformers\b")


def needs_a_marker(text: str) -> bool:
    text = MARKER.sub("", text)
    return bool(TRIGGER.search(text) or NANO.search(text)
                or (CONTINUOUS.search(text) and TRANSFORMERS.search(text)))


def table_rows() -> list[tuple[str, list[str]]]:
    """The rows of the claims tables on book/versions.md: the id in the first column and the
    cells after it."""
    rows = []
    for line in VERSIONS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and (m := re.search(rf"`({ID})`", cells[0])):
            rows.append((m[1], cells[1:]))
    return rows


def table_ids() -> list[str]:
    return [i for i, _ in table_rows()]


def markers() -> list[tuple[Paragraph, list[str]]]:
    return [(p, m.split()) for page in PAGES for p in paragraphs(page)
            for m in MARKER.findall(p.text)]


def test_the_table_has_rows_with_distinct_ids():
    ids = table_ids()
    assert len(ids) >= 20, f"{VERSIONS.name}: no claims table found ({len(ids)} rows)"
    doubled = sorted({i for i in ids if ids.count(i) > 1})
    assert not doubled, f"{VERSIONS.name}: ids used by more than one row: {doubled}"


def test_every_paragraph_about_another_system_names_its_claims():
    missing = [p.where() for page in PAGES for p in paragraphs(page)
               if needs_a_marker(p.text) and not MARKER.search(p.text)]
    assert not missing, ("paragraphs about vLLM, SGLang, nano-vllm or transformers' continuous "
                         "batching with no <!-- claim: ID --> marker:\n  " + "\n  ".join(missing))


CHECKED = re.compile(r"(\d{4}-\d{2}-\d{2})(?: \(as cited\))?")
SOURCE = re.compile(r"\{cite:p\}`[^`]+`|`[^`]+` in transformers [\d.]+")


def test_every_row_names_a_source_and_the_date_it_was_checked():
    """A claim about a moving system holds at a version: the row names what was read (a
    citation, or a command run at a version) and the day it was checked against it."""
    import datetime

    bad = []
    for i, (_, _, source, checked) in table_rows():
        if not SOURCE.search(source) or re.search(r"\bnone cited\b", source):
            bad.append(f"{i}: no source ({source!r})")
        m = CHECKED.fullmatch(checked)
        if not m:
            bad.append(f"{i}: no date checked ({checked!r})")
        elif datetime.date.fromisoformat(m[1]) > datetime.date.today():
            bad.append(f"{i}: checked in the future ({checked!r})")
    assert not bad, f"{VERSIONS.name}:\n  " + "\n  ".join(bad)


def test_every_marker_names_a_row():
    ids = set(table_ids())
    unknown = [f"{p.where()}: {i}" for p, found in markers() for i in found if i not in ids]
    assert not unknown, f"markers naming no row of {VERSIONS.name}:\n  " + "\n  ".join(unknown)


def test_every_row_is_named_by_a_marker():
    used = {i for _, found in markers() for i in found}
    dead = [i for i in table_ids() if i not in used]
    assert not dead, f"rows of {VERSIONS.name} that no chapter names: {dead}"


def test_every_row_lists_the_pages_that_name_it():
    """The chapters column holds one {ref} per page whose markers name the row."""
    labels = {re.search(r"^\(([\w.:-]+)\)=", p.read_text(), re.M)[1]: p.name for p in PAGES}
    named: dict[str, set[str]] = {}
    for p, found in markers():
        for i in found:
            named.setdefault(i, set()).add(p.page)
    wrong = []
    for i, cells in table_rows():
        listed = {labels.get(label, label) for label in re.findall(r"<([\w.:-]+)>`", cells[1])}
        if listed != named.get(i, set()):
            wrong.append(f"{i}: lists {sorted(listed)}, named on {sorted(named.get(i, set()))}")
    assert not wrong, f"{VERSIONS.name}: chapters column out of date:\n  " + "\n  ".join(wrong)


def test_markers_are_well_formed_and_inline():
    """A marker that starts a line would start an HTML block, which swallows the rest of the
    line and can break the paragraph; a misspelt one would be skipped silently."""
    bad = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for m in ANY_MARKER.finditer(line):
                if not MARKER.fullmatch(m.group(0)):
                    bad.append(f"{page.name}:{n}: malformed {m.group(0)!r}")
            if line.lstrip(" >").startswith("<!--"):
                bad.append(f"{page.name}:{n}: a marker must not start a line")
    assert not bad, "\n  ".join(bad)


def test_the_splitter_sees_prose_and_skips_code(tmp_path):
    page = tmp_path / "ch99_x.md"
    page.write_text("\n".join([
        "---", "jupytext: {}", "---", "", "Intro on vLLM V1. <!-- claim: a -->", "",
        "```{code-cell} ipython3", "# vLLM V1 in code", "```", "",
        "```{admonition} Then and now", ":class: tip", "", "SGLang does this.", "```", "",
        "- transformers' continuous", "  batching pages.", "- nothing here", "",
        "| SGLang | x |", "", "Plain prose.",
    ]))
    found = [(p.line, needs_a_marker(p.text), bool(MARKER.search(p.text)))
             for p in paragraphs(page)]
    assert found == [(5, True, True), (14, True, False), (17, True, False), (19, False, False),
                     (21, True, False), (23, False, False)]
