"""The book's PDF (`make pdf`, tools/book_pdf.py), read back with pypdf: the file the published
site offers, `pagedlab.pdf` beside the HTML build, printed from that build; every page of
`_toc.yml` in it with an outline entry titled by its h1, at the page whose text shows that
title; chapter 1's glued numbers in chapter 1's pages, so the executed outputs are in it; no
blank page; every page numbered; and every page's download menu links to it.

Like the browser test it reads the build (`make test` builds the book, then the PDF, then runs
both), and skips where the book is not built or Chromium, which prints the PDF, is missing.
`PAGEDLAB_BOOK_HTML` points it at another build's html folder.
"""

from __future__ import annotations

import functools
import html
import os
import re
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from book_browser import CHROMIUM  # noqa: E402
from book_pdf import toc_pages  # noqa: E402

BUILT = Path(os.environ.get("PAGEDLAB_BOOK_HTML", ROOT / "_build" / "html")).resolve()
PDF = BUILT / "pagedlab.pdf"
PAGES = [path for _, path in toc_pages(ROOT / "_toc.yml")]

pytestmark = [
    pytest.mark.skipif(not BUILT.exists(), reason="the book is not built (`make test` builds it)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="no chromium to print the PDF: `apt-get install -y chromium`"),
]


def words(text: str) -> str:
    """``text`` with its whitespace (a line break of the PDF's) made single spaces and its
    ligatures (the PDF's "ﬁ") spelled out."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip()


def h1(path: str) -> str:
    """The title of a page of the build, as its h1 shows it."""
    heading = re.findall(r"<h1>(.*?)</h1>", (BUILT / f"{path}.html").read_text(), re.S)[-1]
    return words(html.unescape(re.sub(r"<a class=\"headerlink\".*?</a>|<[^>]+>", "", heading)))


@functools.cache
def book():
    """The PDF's reader, the text of each of its pages, and its outline as (title, page)."""
    from pypdf import PdfReader

    assert PDF.exists(), f"no {PDF.name} beside the build: `make pdf` prints it"
    stale = [p for p in PAGES if (BUILT / f"{p}.html").stat().st_mtime > PDF.stat().st_mtime]
    assert not stale, f"pages built after the PDF was printed (`make pdf`): {stale}"
    reader = PdfReader(PDF)
    outline = []

    def walk(items):
        for item in items:
            if isinstance(item, list):
                walk(item)
            else:
                outline.append((words(item.title), reader.get_destination_page_number(item)))

    walk(reader.outline)
    return reader, [words(page.extract_text()) for page in reader.pages], outline


def start(path: str) -> int:
    """The number of the PDF page where ``path`` begins, found by its outline entry."""
    _, _, outline = book()
    return next(page for title, page in outline if title == h1(path))


def test_every_page_of_the_contents_has_an_outline_entry_at_its_title():
    _, texts, outline = book()
    titles = {title for title, _ in outline}
    missing = [h1(p) for p in PAGES if h1(p) not in titles]
    assert not missing, f"no outline entry for {missing}"
    starts = [start(p) for p in PAGES]
    assert starts == sorted(starts), "the pages are not in the order of _toc.yml"
    wrong = [h1(p) for p in PAGES if h1(p) not in texts[start(p)]]
    assert not wrong, f"the outline entry's page does not show its title: {wrong}"


def test_chapter_1_holds_its_executed_outputs():
    """Every value chapter 1 glues into its prose (computed when the build ran it) is in the
    text of chapter 1's pages."""
    _, texts, _ = book()
    i = next(i for i, path in enumerate(PAGES) if path.startswith("book/ch01_"))
    chapter = " ".join(texts[start(PAGES[i]):start(PAGES[i + 1])])
    page = (BUILT / f"{PAGES[i]}.html").read_text()
    glued = {words(html.unescape(re.sub(r"<[^>]+>", "", value)))
             for value in re.findall(r'<span class="pasted-text">(.*?)</span>', page, re.S)}
    assert len(glued) > 20, "chapter 1 glues too few values for this test to mean anything"
    assert not [v for v in glued if v not in chapter], "glued values missing from the PDF"


def test_no_page_is_blank():
    """A page with neither text nor an image: a block pushed to the next page, say, leaving
    only its border behind."""
    reader, texts, _ = book()
    blank = [i + 1 for i, (page, text) in enumerate(zip(reader.pages, texts))
             if not text.removesuffix(str(i + 1)).strip() and not page.images]  # its number only
    assert not blank, f"blank pages: {blank}"


@pytest.mark.parametrize("path", PAGES)
def test_the_download_menu_offers_the_book_pdf(path):
    """Every page's download menu links to the PDF (book/_ext/pagedlab_downloads.py)."""
    page = BUILT / f"{path}.html"
    links = re.findall(r'<a href="([^"]+)"[^>]*btn-download-book-pdf-button', page.read_text())
    assert [(page.parent / link).resolve() for link in links] == [PDF]


def test_every_page_shows_its_number_at_its_foot():
    """The pages are printed one HTML page at a time, so their numbers are laid over the merged
    book (tools/book_pdf.py): page i of the PDF ends with the number i, not its page's own."""
    _, texts, _ = book()
    wrong = [i + 1 for i, text in enumerate(texts) if not f" {text}".endswith(f" {i + 1}")]
    assert not wrong, f"pages whose text does not end with their number: {wrong[:20]}"
