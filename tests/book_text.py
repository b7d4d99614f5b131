"""The visible prose of the book's pages, as paragraphs: what the claims test and the prose
budget read. Code cells, code blocks, math blocks and front matter are left out; admonitions,
dropdowns, exercises and glossary entries are read, each paragraph knowing whether it sits in
a folded box (a dropdown, or an admonition with the dropdown class)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ID = r"[a-z0-9]+(?:-[a-z0-9]+)*"  # a claim's id, kebab-case: never "--", which would end the comment
MARKER = re.compile(rf"<!-- claim: ({ID}(?: {ID})*) -->")  # see tests/test_book_claims.py
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
    folded: bool = False  # inside a dropdown: the reader opens it to read it

    def where(self) -> str:
        words = " ".join(MARKER.sub("", self.text).split()[:8])
        return f"{self.page}:{self.line} ({words} ...)"


def paragraphs(path: Path) -> list[Paragraph]:
    """The Markdown prose of a page, as paragraphs: runs of lines between blank lines, a list
    item or a table row each on its own."""
    lines = path.read_text().split("\n")
    out: list[Paragraph] = []
    cur: list[str] = []
    start = 0
    stack: list[tuple[str, bool, bool]] = []  # open fences: (fence, holds prose, folded)

    def flush():
        nonlocal cur
        if cur:
            out.append(Paragraph(path.name, start, "\n".join(cur), any(f for *_, f in stack)))
        cur = []

    i = 0
    if lines and lines[0].strip() == "---":  # jupytext front matter
        i = lines.index("---", 1) + 1
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        prose = all(p for _, p, _ in stack)
        if fence and stack and line.strip() == stack[-1][0]:
            flush()
            stack.pop()
        elif fence and prose:
            rest = fence["rest"].strip()
            is_prose = rest.startswith("{") and not rest.startswith(NOT_PROSE)
            flush()
            folded = rest.startswith("{dropdown}")
            while is_prose and i + 1 < len(lines) and OPTION.match(lines[i + 1]):
                i += 1
                folded = folded or bool(re.match(r"\s*:class:.*\bdropdown\b", lines[i]))
            stack.append((fence["fence"], is_prose, folded))
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
