"""Static SVG views of paged KV memory: block tables over the physical pool (ch. 4-5).

Hand-written SVG: crisp at any zoom, a few kilobytes, and shown without JavaScript in the HTML
book, JupyterLab, classic Notebook and Colab. Each sequence is a row of logical blocks, each
naming its physical block and how many of its slots hold tokens; the pool below colours every
physical block by its number of users, marks parked prefix-cache blocks, outlines the blocks
the last event touched and draws a copy-on-write as an arrow from source to copy. The picture
is also said in words (:func:`describe`): the SVG is an image (``role="img"``) named by that
text, in its ``aria-label`` and its ``<title>``, so a screen reader reads the tables and the
pool rather than a list of numbers out of order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from html import escape

from pagedlab._arith import cdiv
from pagedlab.viz.block_replay import Snapshot

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#138d9c",
           "#8a8b10", "#555555"]  # sequence colours: tab10, darkened, without the events' orange
USERS_FILL = ["#ffffff", "#d0e2f3", "#8db6dd", "#3b75af"]  # 0, 1, 2, 3+ users
PARKED_FILL = "#fff1c2"
EVENT = "#e8590c"  # outline of what the event touched, and the copy-on-write arrow
BOX_W, BOX_H, GAP, LABEL_W = 54, 46, 6, 118  # a logical block, the sequence label
MIN_FONT = 9  # px at 1:1; the book shows these SVGs at their own width (tests/test_browser.py)
CELL, CELL_GAP, POOL_COLS = 32, 4, 16  # a physical block in the pool grid
PAD = 10


def seq_colors(snapshots: Sequence[Snapshot]) -> dict[Hashable, str]:
    """A colour per sequence, in order of first appearance, stable across a whole history."""
    colors: dict[Hashable, str] = {}
    for snap in snapshots:
        for seq_id in [*snap.tables, *snap.swapped]:
            colors.setdefault(seq_id, PALETTE[len(colors) % len(PALETTE)])
    return colors


def _text(x, y, s, size=11, anchor="start", fill="#222", weight="normal") -> str:
    return (f'<text x="{x:g}" y="{y:g}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}" font-weight="{weight}">{escape(str(s))}</text>')


def _rect(x, y, w, h, fill, stroke, width=1.0, dash=False) -> str:
    dashes = ' stroke-dasharray="4 2"' if dash else ""
    return (f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" rx="3" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="{width:g}"{dashes}/>')


def _logical_block(x, y, j, block, fill, block_size, color, on_cpu, touched) -> list[str]:
    """Logical block ``j``: its physical block, and its slots, the first ``fill`` of them used."""
    stroke, width = (EVENT, 3) if touched else ("#999" if on_cpu else color, 1.5)
    parts = [_rect(x, y, BOX_W, BOX_H, "#fff", stroke, width, dash=on_cpu),
             _text(x + 3, y + 10, f"L{j}", MIN_FONT, fill="#666"),
             _text(x + BOX_W / 2, y + 24, f"cpu {block}" if on_cpu else block, 12, "middle",
                   weight="bold")]
    slots = min(block_size, 16)  # larger blocks: 16 cells show the fraction used
    w = (BOX_W - 8) / slots
    used = fill if block_size <= 16 else round(fill / block_size * slots)
    for s in range(slots):
        parts.append(f'<rect x="{x + 4 + s * w:g}" y="{y + 28}" width="{max(w - 1, 1):g}" '
                     f'height="6" fill="{color if s < used else "#eee"}"/>')
    parts.append(_text(x + BOX_W / 2, y + 44, f"{fill}/{block_size}", MIN_FONT, "middle", "#555"))
    return parts


def _tables(snap: Snapshot, colors, y: float, max_blocks: int) -> tuple[list[str], float, float]:
    """Rows of logical blocks from height ``y``: (svg parts, bottom, right edge)."""
    parts, right = [], 0.0
    rows = [(s, b, False) for s, b in snap.tables.items()]
    rows += [(s, b, True) for s, b in snap.swapped.items()]
    event_seq = snap.event.seq_id if snap.event is not None else None
    for seq_id, blocks, on_cpu in rows:
        color = colors.get(seq_id, "#555")
        parts.append(_text(PAD, y + 19, f"seq {seq_id}", 12, fill=color, weight="bold"))
        where = "swapped to CPU" if on_cpu else f"{snap.num_tokens[seq_id]} tokens"
        parts.append(_text(PAD, y + 35, where, 10, fill="#666"))
        fills = snap.fills(seq_id)
        for j, (block, fill) in enumerate(zip(blocks[:max_blocks], fills)):
            x = PAD + LABEL_W + j * (BOX_W + GAP)
            touched = seq_id == event_seq and not on_cpu and block in snap.touched
            parts += _logical_block(x, y, j, block, fill, snap.block_size, color, on_cpu, touched)
        x = PAD + LABEL_W + min(len(blocks), max_blocks) * (BOX_W + GAP)
        if len(blocks) > max_blocks:
            parts.append(_text(x, y + 27, f"+{len(blocks) - max_blocks} more", 10, fill="#666"))
            x += 60
        right = max(right, x)
        y += BOX_H + 10
    if not rows:
        parts.append(_text(PAD, y + 14, "(no sequences)", 11, fill="#888"))
        y += 24
    return parts, y, right


def _pool(snap: Snapshot, colors, y: float) -> tuple[list[str], float, float]:
    """The GPU pool as a grid from height ``y``: (svg parts, bottom, right edge)."""
    users: dict[int, list[Hashable]] = {}
    for seq_id, blocks in snap.tables.items():
        for b in blocks:
            users.setdefault(b, []).append(seq_id)
    refs = snap.refcounts
    cols = min(snap.num_blocks, POOL_COLS)
    parts = []

    def corner(b):
        return (PAD + b % cols * (CELL + CELL_GAP), y + b // cols * (CELL + CELL_GAP))

    for b in range(snap.num_blocks):
        x, top = corner(b)
        parked, n = b in snap.parked, refs[b]
        fill = PARKED_FILL if parked else USERS_FILL[min(n, 3)]
        stroke, width = (EVENT, 3) if b in snap.touched else ("#888", 1)
        who = ", ".join(map(str, users.get(b, []))) or ("cached, free" if parked else "free")
        parts.append(f'<g><title>block {b}: {n} user{"s" * (n != 1)} ({escape(who)})</title>')
        parts.append(_rect(x, top, CELL, CELL, fill, stroke, width, dash=parked))
        parts.append(_text(x + CELL / 2, top + 14, b, 11, "middle", "#fff" if n >= 3 else "#222"))
        if n > 4:
            parts.append(_text(x + CELL / 2, top + 27, f"x{n}", MIN_FONT, "middle", "#fff"))
        for k, seq_id in enumerate(users.get(b, [])[:4]):  # one dot per user
            cx = x + CELL / 2 + (k - (min(n, 4) - 1) / 2) * 7
            parts.append(f'<circle cx="{cx:g}" cy="{top + 24}" r="2.6" '
                         f'fill="{colors.get(seq_id, "#555")}" stroke="#fff" stroke-width="0.6"/>')
        parts.append("</g>")
    if snap.event is not None and snap.event.kind == "cow":
        parts += _copy_arrow(*(corner(b) for b in snap.event.pairs[0]))
    rows = cdiv(snap.num_blocks, cols)
    return parts, y + rows * (CELL + CELL_GAP), PAD + cols * (CELL + CELL_GAP)


def _copy_arrow(src, dst) -> list[str]:
    """An arched arrow from the source block's top to its copy's, labelled "copy"."""
    (x0, y0), (x1, y1) = [(x + CELL / 2, y) for x, y in (src, dst)]
    cx, cy = (x0 + x1) / 2, min(y0, y1) - 16
    return [f'<path d="M{x0:g},{y0:g} Q{cx:g},{cy:g} {x1:g},{y1:g}" fill="none" '
            f'stroke="{EVENT}" stroke-width="2" marker-end="url(#arrow)"/>',
            _text(cx, cy + 6, "copy", 10, "middle", EVENT, "bold")]


def _legend(y: float) -> tuple[list[str], float]:
    items = [("free", USERS_FILL[0], False), ("1 user", USERS_FILL[1], False),
             ("2 users", USERS_FILL[2], False), ("3+ users", USERS_FILL[3], False),
             ("cached, free", PARKED_FILL, True)]
    parts, x = [], PAD
    for label, fill, dash in items:
        parts += [_rect(x, y, 14, 14, fill, "#888", dash=dash), _text(x + 18, y + 11, label, 10)]
        x += 26 + 6 * len(label)
    parts += [_rect(x, y, 14, 14, "#fff", EVENT, 3), _text(x + 18, y + 11, "touched by event", 10)]
    return parts, x + 120


def _block_list(blocks: Sequence[int], max_blocks: int) -> str:
    shown = ", ".join(map(str, blocks[:max_blocks]))
    more = len(blocks) - max_blocks
    return f"block{'s' * (len(blocks) != 1)} {shown}" + (f" and {more} more" if more > 0 else "")


def describe(snap: Snapshot, title: str | None = None, max_blocks: int = 16) -> str:
    """What the picture of ``snap`` shows, in words: its title, each sequence's blocks (as many
    as its row draws), and the pool's counts. The SVG's accessible name (see :func:`block_svg`)."""
    title = snap.caption if title is None else title
    words = [f"Paged KV cache, {title}."]
    for seq_id, blocks in snap.tables.items():
        n = snap.num_tokens[seq_id]
        words.append(f"seq {seq_id}: {n} token{'s' * (n != 1)} in "
                     f"{_block_list(blocks, max_blocks)}.")
    for seq_id, blocks in snap.swapped.items():
        words.append(f"seq {seq_id}: swapped out to CPU {_block_list(blocks, max_blocks)}.")
    if not snap.tables and not snap.swapped:
        words.append("No sequences.")
    refs = snap.refcounts
    used, shared = sum(r > 0 for r in refs), sum(r > 1 for r in refs)
    free = snap.num_blocks - used - len(snap.parked)
    pool = (f"GPU pool of {snap.num_blocks} blocks of {snap.block_size} tokens: {used} in use"
            + (f" ({shared} shared)" if shared else ""))
    if snap.parked:
        pool += f", {len(snap.parked)} cached and free"
    words.append(f"{pool}, {free} free.")
    if snap.touched:
        words.append(f"The event touched {_block_list(sorted(snap.touched), max_blocks)}.")
    return " ".join(words)


def block_svg(snap: Snapshot, title: str | None = None, *,
              colors: dict[Hashable, str] | None = None, max_blocks: int = 16) -> str:
    """The SVG markup of ``snap``: block tables, the pool, a legend; titled by its caption.

    ``colors`` maps sequences to colours (default: :func:`seq_colors` of this snapshot);
    rows show at most ``max_blocks`` logical blocks. The SVG is an image (``role="img"``)
    whose ``aria-label`` and ``<title>`` say what it shows (:func:`describe`).
    """
    colors = seq_colors([snap]) if colors is None else colors
    title = snap.caption if title is None else title
    parts = [_text(PAD, 18, title, 13, weight="bold"),
             _text(PAD, 40, "block tables: logical block -> physical block, tokens in it", 11,
                   fill="#555")]
    table_parts, y, table_right = _tables(snap, colors, 48, max_blocks)
    parts += table_parts
    parts.append(_text(PAD, y + 14, f"GPU block pool ({snap.num_blocks} blocks of "
                                    f"{snap.block_size} tokens): colour = users", 11, fill="#555"))
    is_copy = snap.event is not None and snap.event.kind == "cow"
    pool_parts, y, pool_right = _pool(snap, colors, y + (40 if is_copy else 24))  # arrow room
    legend_parts, legend_right = _legend(y + 4)
    parts += pool_parts + legend_parts
    width = max(table_right, pool_right, legend_right, PAD + 7 * len(title)) + PAD
    height = y + 28
    defs = (f'<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
            f'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="{EVENT}"/>'
            f'</marker></defs>')
    label = describe(snap, title, max_blocks)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{height:g}" '
            f'viewBox="0 0 {width:g} {height:g}" font-family="sans-serif" role="img" '
            f'aria-label="{escape(label)}"><title>{escape(label)}</title>'
            f'<rect width="100%" height="100%" fill="#fff"/>{defs}{"".join(parts)}</svg>')


def scroll_box(svg: str, cls: str) -> str:
    """``svg`` inline at its own size in a box that scrolls sideways where the page is narrower
    (a phone): its 9-px text stays 9 px, where an image would shrink with the column."""
    return f'<div class="{cls}" style="max-width:100%;overflow-x:auto">{svg}</div>'


class BlockView:
    """A snapshot as a figure: inline SVG in HTML (the book, Jupyter, Colab), the SVG alone
    where only images show, its text summary otherwise (a terminal, nbval)."""

    def __init__(self, snap: Snapshot, title: str | None = None, **options):
        self.snap, self.title, self.options = snap, title, options

    def _repr_svg_(self) -> str:
        return block_svg(self.snap, self.title, **self.options)

    def _repr_html_(self) -> str:
        return scroll_box(self._repr_svg_(), "pagedlab-blockview")

    def __repr__(self) -> str:
        return self.snap.summary()
