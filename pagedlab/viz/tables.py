"""A table that shows as HTML in the book and as aligned text in a terminal or under nbval."""

from __future__ import annotations

import html


class Table:
    """Rows of cells under a header; numbers should arrive already formatted as strings."""

    def __init__(self, header: list[str], rows: list[list]):
        self.header = [str(h) for h in header]
        self.rows = [[str(c) for c in row] for row in rows]

    def __repr__(self) -> str:
        lines = [self.header, *self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(self.header))]
        text = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(text)

    def _repr_html_(self) -> str:
        def row(cells, tag):
            return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

        body = "".join(row(r, "td") for r in self.rows)
        return f"<table><thead>{row(self.header, 'th')}</thead><tbody>{body}</tbody></table>"
