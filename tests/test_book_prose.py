"""The prose budget of CONTRIBUTING.md, measured on what a reader sees of each chapter and the
preface: no sentence over 60 words, at most 3% of a chapter's sentences over 40, no paragraph
over 150 words, and a paragraph with more than 8 numbers is a table or sits in a dropdown.

Words are counted as rendered: an inline formula, an inline code span or a glued value is one
word; a role shows its text ({term}`a block <block>` is two words); a citation's bracket is
left out, as it is no part of the sentence's grammar."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from book_text import MARKER, Paragraph, paragraphs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "book").glob("ch*.md")), ROOT / "book" / "preface.md"]

MAX_SENTENCE, LONG_SENTENCE, MAX_LONG_SHARE = 60, 40, 0.03
MAX_PARAGRAPH, MAX_NUMBERS = 150, 8

CITE = re.compile(r"\s*\{cite(?::[pt])?\}`[^`]*`")
ROLE = re.compile(r"\{[\w:-]+\}`([^`]*)`")
GLUE = re.compile(r"\{glue(?::\w+)?\}`[^`]*`")
MATH = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.S)
CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
# Abbreviations whose full stop ends no sentence.
ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|et al|Fig|Figs|Eq|Sec|vs|cf|etc|No|approx)\.", re.I)
# A full stop, ? or ! then a space ends a sentence, whatever the next word (vLLM, pagedlab and
# e4m3 start with a small letter); the abbreviations above are protected first.
SENTENCE_END = re.compile(r"(?<=[.!?])[)\"'*_]*\s+(?=\S)")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?%?(?!\w|\.\d)|\u00a7GLUE\u00a7")


def rendered(text: str) -> str:
    """A paragraph's text as a reader reads it, each formula, code span or glued value a
    single token."""
    text = MARKER.sub("", text)
    text = CITE.sub("", text)
    text = GLUE.sub("\u00a7GLUE\u00a7", text)
    text = ROLE.sub(lambda m: re.sub(r"\s*<[^>]*>$", "", m[1]) or "ref", text)
    text = LINK.sub(r"\1", text)
    text = MATH.sub("\u00a7MATH\u00a7", text)
    text = CODE.sub("\u00a7CODE\u00a7", text)
    text = re.sub(r"^\s*(?:[-*+]|\d+\.)\s+", "", text)  # a list item's bullet or number
    return " ".join(text.split())


def sentences(text: str) -> list[str]:
    protected = ABBREVIATIONS.sub(lambda m: m[0].replace(".", "\u2024"), rendered(text))
    return [s for s in SENTENCE_END.split(protected) if s.strip()]


def words(text: str) -> int:
    return len([w for w in text.split() if re.search(r"\w|\u00a7", w)])


def prose(page: Path) -> list[Paragraph]:
    """The page's paragraphs of running text: table rows are tables already."""
    return [p for p in paragraphs(page) if not p.text.lstrip().startswith("|")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_the_prose_keeps_its_budget(page):
    long_sentences, too_long, numbers = [], [], []
    count = over = 0
    for p in prose(page):
        for s in sentences(p.text):
            n = words(s)
            count += 1
            over += n > LONG_SENTENCE
            if n > MAX_SENTENCE:
                long_sentences.append(f"{p.where()}: a sentence of {n} words: {s[:120]!r}")
        if (n := words(rendered(p.text))) > MAX_PARAGRAPH:
            too_long.append(f"{p.where()}: a paragraph of {n} words")
        if not p.folded and (k := len(NUMBER.findall(rendered(p.text)))) > MAX_NUMBERS:
            numbers.append(f"{p.where()}: {k} numbers: make it a table or a dropdown")
    problems = long_sentences + too_long + numbers
    if count and over / count > MAX_LONG_SHARE:
        problems.append(f"{page.name}: {over} of {count} sentences ({over / count:.1%}) are over "
                        f"{LONG_SENTENCE} words; at most {MAX_LONG_SHARE:.0%} may be")
    assert not problems, "\n  ".join(["prose over budget (CONTRIBUTING.md):", *problems])


def test_the_counter_reads_as_a_reader_does(tmp_path):
    page = tmp_path / "ch99_x.md"
    page.write_text("\n".join([
        "---", "jupytext: {}", "---", "",
        "A {term}`block table <block table>` maps $i$ to `table[i]` {cite:p}`kwon2023`. "
        "See Fig. 2, e.g. its left half: {glue:text}`n` tokens fit. <!-- claim: a-b -->",
        "", "```{dropdown} Answer", "1, 2, 3, 4, 5, 6, 7, 8 and 9.", "```", "",
        "1, 2, 3, 4, 5, 6, 7, 8 and 9.", "",
        "```{code-cell} ipython3", "x = 'A sentence. Another one.'", "```",
    ]))
    found = prose(page)
    assert [sentences(p.text) for p in found][0] == [
        "A block table maps \u00a7MATH\u00a7 to \u00a7CODE\u00a7.",
        "See Fig\u2024 2, e\u2024g\u2024 its left half: \u00a7GLUE\u00a7 tokens fit."]
    assert [words(s) for s in sentences(found[0].text)] == [7, 10]
    assert [(p.folded, len(NUMBER.findall(rendered(p.text)))) for p in found[1:]] == [
        (True, 9), (False, 9)]


def test_version_history_is_folded_off_the_learning_path():
    """Every "Then and now" box (what vLLM and its peers did, by version) is a collapsed
    dropdown, so a newcomer's path runs past it."""
    boxes = [(page.name, line) for page in PAGES for line in page.read_text().split("\n")
             if re.match(r"\s*[`:]{3,}\{admonition\} Then and now", line)]
    assert len(boxes) >= 10
    for name, line in boxes:
        text = (ROOT / "book" / name).read_text()
        option = text[text.index(line) + len(line):].split("\n")[1]
        assert re.match(r"\s*:class:.*\bdropdown\b", option), f"{name}: {line!r} is open"
