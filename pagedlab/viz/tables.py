"""A table that shows as HTML in the book and as aligned text in a terminal or under nbval.

The HTML carries its own inline style (the book's theme, Jupyter and Colab all keep it): padded
cells, numeric columns right-aligned and never wrapped, and a box that scrolls sideways when the
table is wider than the page, so a wide table is never cut off.
"""

from __future__ import annotations

import html
import re

NUMBER = re.compile(r"^[+\-\u2212~<>\u2248]?\s*\$?[\d.,]+")  # "1,663", "-4%", "0.81x", "~2 GiB"
CELL = "padding:0.25em 0.75em;border-bottom:1px solid #ddd;"
SHORT = "white-space:nowrap;"


class Table:
    """Rows of cells under a header; numbers should arrive already formatted as strings."""

    def __init__(self, header: list[str], rows: list[list]):
        self.header = [str(h) for h in header]
        self.rows = [[str(c) for c in row] for row in rows]
        bad = [i for i, row in enumerate(self.rows) if len(row) != len(self.header)]
        if bad:
            raise ValueError(f"table rows {bad} do not have the header's {len(self.header)} cells")

    def numeric(self) -> list[bool]:
        """Whether each column holds numbers (every non-empty body cell starts with one)."""
        columns = zip(*self.rows) if self.rows else [()] * len(self.header)
        return [any(c for c in col) and all(NUMBER.match(c) for c in col if c) for col in columns]

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
        align = ["text-align:right;white-space:nowrap;" if num else "text-align:left;"
                 for num in self.numeric()]

        def row(cells, tag):  # short text stays on one line: no "Llama-2-" above "7B"
            return "<tr>" + "".join(
                f'<{tag} style="{CELL}{a}{SHORT if tag == "td" and len(c) <= 24 else ""}">'
                f"{html.escape(c)}</{tag}>" for c, a in zip(cells, align)) + "</tr>"

        body = "".join(row(r, "td") for r in self.rows)
        return (f'<div class="pagedlab-table" style="overflow-x:auto;max-width:100%;">'
                f'<table style="border-collapse:collapse;margin:0;">'
                f"<thead>{row(self.header, 'th')}</thead><tbody>{body}</tbody></table></div>")
