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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
VERSIONS = BOOK / "versions.md"
PAGES = [*sorted(BOOK.glob("ch*.md")), BOOK / "preface.md", BOOK / "glossary.md"]

ID = r"[a-z0-9]+(?:-[a-z0-9]+)*"  # kebab-case: never "--", which would end the comment
MARKER = re.compile(rf"<!-- claim: ({ID}(?: {ID})*) -->")
ANY_MARKER = re.compile(r"<!--\s*claims?\b[^>]*-->|<!--\s*claims?\b")
# what makes a paragraph need a marker (case-sensitive: "v1" and "vllm" in ids and paths do not)
TRIGGER = re.compile(r"vLLM|\bV[01]\b|SGLang|generate_batch|ContinuousBatchingManager")
NANO = re.compile(r"nano-vllm", re.IGNORECASE)
CONTINUOUS = re.compile(r"continuous\s+batching", re.IGNORECASE)
TRANSFORMERS = re.compile(r"\btransformers\b")

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|:{3,})(?P<rest>.*)$")
NOT_PROSE = ("{code-cell}", "{code-block}", "{code}", "{literalinclude}", "{math}")
OPTION = re.compile(r"^\s*:[\w-]+:")
ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")
ROW = re.compile(r"^\s*\|")


@dataclass
class Paragraph:
    page: str
    line: int  # 1-based, of its first line
    text: str

    def where(self) -> str:
        words = " ".join(MARKER.sub("", self.text).split()[:8])
        return f"{self.page}:{self.line} ({words} ...)"


def paragraphs(path: Path) -> list[Paragraph]:
    """The Markdown prose of a page, as paragraphs: runs of lines between blank lines, a list
    item or a table row each on its own, in admonitions, dropdowns, exercises and glossary
    entries too; code cells, code blocks, math blocks and front matter left out."""
    lines = path.read_text().split("\n")
    out: list[Paragraph] = []
    cur: list[str] = []
    start = 0

    def flush():
        nonlocal cur
        if cur:
            out.append(Paragraph(path.name, start, "\n".join(cur)))
        cur = []

    i = 0
    if lines and lines[0].strip() == "---":  # jupytext front matter
        i = lines.index("---", 1) + 1
    stack: list[tuple[str, bool]] = []  # open fences: (fence, holds prose)
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        prose = all(p for _, p in stack)
        if fence and stack and line.strip() == stack[-1][0]:
            stack.pop()
            flush()
        elif fence and prose:
            rest = fence["rest"].strip()
            is_prose = rest.startswith("{") and not rest.startswith(NOT_PROSE)
            stack.append((fence["fence"], is_prose))
            flush()
            while is_prose and i + 1 < len(lines) and OPTION.match(lines[i + 1]):
                i += 1
        elif not prose:
            pass
        elif not line.strip() or line.startswith(("%", "+++", "#")) or re.match(r"^\([\w.:-]+\)=", line):
            flush()  # a blank line, a MyST comment, a cell break, a heading, a target
        else:
            if ITEM.match(line) or ROW.match(line) or not cur:
                flush()
                start = i + 1
            cur.append(line)
        i += 1
    flush()
    return out


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
