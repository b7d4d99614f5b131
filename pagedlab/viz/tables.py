"""A table that shows as HTML in the book and as aligned text in a terminal or under nbval.

The HTML carries its own inline style (the book's theme, Jupyter and Colab all keep it): padded
cells, numeric columns right-aligned and never wrapped, other cells and every header wrapped at
spaces only (never inside "Llama-2-7B"), so that a table fits the book's 688-px column as long
as its numbers do; a box that scrolls sideways is the last resort, never the layout.
"""

from __future__ import annotations

import html
import re

NUMBER = re.compile(r"^[+\-\u2212~<>\u2248]?\s*\$?[\d.,]+")  # "1,663", "-4%", "0.81x", "~2 GiB"
NOT_APPLICABLE = "\u2013"  # an en dash: a cell with no value, in a column of numbers
CELL = "padding:0.25em 0.75em;border-bottom:1px solid #ddd;"
NOWRAP = "white-space:nowrap;"


def _wrap_at_spaces(text: str, slash: bool = False) -> str:
    """HTML of ``text`` that may break at its spaces (and after a slash if ``slash``: a header
    "values/token/layer") but not at a hyphen ("A100-40GB")."""
    def word(w):
        w = html.escape(w).replace("/", "/<wbr/>") if slash else html.escape(w)
        return f'<span style="{NOWRAP}">{w}</span>' if "-" in w else w

    return " ".join(map(word, text.split(" ")))


class Table:
    """Rows of cells under a header; numbers should arrive already formatted as strings."""

    def __init__(self, header: list[str], rows: list[list]):
        self.header = [str(h) for h in header]
        self.rows = [[str(c) for c in row] for row in rows]
        bad = [i for i, row in enumerate(self.rows) if len(row) != len(self.header)]
        if bad:
            raise ValueError(f"table rows {bad} do not have the header's {len(self.header)} cells")

    def numeric(self) -> list[bool]:
        """Whether each column holds numbers (every body cell with a value starts with one)."""
        columns = zip(*self.rows) if self.rows else [()] * len(self.header)
        return [any(c for c in col) and all(NUMBER.match(c) for c in col
                                            if c and c != NOT_APPLICABLE) for col in columns]

    def transposed(self) -> Table:
        """Columns as rows: a table with many columns and few rows reads better this way."""
        return Table([self.header[0], *(r[0] for r in self.rows)],
                     [[h, *(r[i] for r in self.rows)] for i, h in enumerate(self.header) if i])

    def __repr__(self) -> str:
        lines = [self.header, *self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(self.header))]
        just = [str.rjust if num else str.ljust for num in self.numeric()]
        text = ["  ".join(j(c, w) for c, w, j in zip(line, widths, just)).rstrip()
                for line in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(text)

    def _repr_html_(self) -> str:
        numeric = self.numeric()

        def cell(text, tag, num):  # a number never breaks; words break at spaces only
            align = "text-align:right;" if num else "text-align:left;"
            if tag == "td" and num:
                return f'<td style="{CELL}{align}{NOWRAP}">{html.escape(text)}</td>'
            return f'<{tag} style="{CELL}{align}">{_wrap_at_spaces(text, tag == "th")}</{tag}>'

        def row(cells, tag):
            return "<tr>" + "".join(cell(c, tag, n) for c, n in zip(cells, numeric)) + "</tr>"

        body = "".join(row(r, "td") for r in self.rows)
        return (f'<div class="pagedlab-table" style="overflow-x:auto;max-width:100%;">'
                f'<table style="border-collapse:collapse;margin:0;">'
                f"<thead>{row(self.header, 'th')}</thead><tbody>{body}</tbody></table></div>")
