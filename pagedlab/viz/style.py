"""Figures sized for the book's page: 7 inches at 100 dpi fill the ~700 px text column at
1:1, so a font of 9 pt or more in the figure reads at 9 pt or more on the page.

Chapters call :func:`use` once; :func:`small_text` lists what would still read smaller.
"""

from __future__ import annotations

import matplotlib as mpl

PAGE_PX = 700  # the text column of the HTML book at a 1280 px window (CSS px)
WIDTH_IN = 7.0  # a full-width figure
MIN_PT = 9.0  # the smallest text a reader should have to read (CSS pt)

RC = {
    "figure.figsize": (WIDTH_IN, 3.4),
    "figure.dpi": PAGE_PX / WIDTH_IN,
    "figure.constrained_layout.use": True,
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "figure.titlesize": 11,
}


def use() -> None:
    """The book's figure style, and sharp (2x) PNGs where IPython shows them."""
    mpl.rcParams.update(RC)
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:
        return
    if get_ipython() is not None:
        set_matplotlib_formats("retina")


def display_pt(fig, fontsize: float) -> float:
    """The size in CSS pt at which a ``fontsize`` pt text of ``fig`` reads on the page: the
    figure shows at its own width in pixels, or shrunk to the page's."""
    width_in = fig.get_figwidth()
    shown_px = min(PAGE_PX, width_in * fig.dpi)
    return fontsize * shown_px / (width_in * 96)  # 96 CSS px per inch


def small_text(fig) -> list[str]:
    """The texts of ``fig`` that read under :data:`MIN_PT` on the page, with their size."""
    fig.canvas.draw()  # tick labels exist only once drawn
    return [f"{t.get_text()!r}: {display_pt(fig, t.get_fontsize()):.1f} pt"
            for t in fig.findobj(mpl.text.Text)
            if t.get_visible() and t.get_text().strip()
            and display_pt(fig, t.get_fontsize()) < MIN_PT]


def overlapping_text(fig, pad_px: float = 1.0) -> list[str]:
    """Pairs of visible texts of ``fig`` whose drawn boxes overlap (tick labels running
    together, a bar's label on its neighbour's, a label past another), and texts that leave
    the figure. A figure a chapter draws should have none."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = fig.bbox
    undrawn = set()  # tick labels past the view limits exist but are not drawn
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            slack = 1e-9 * max(1.0, abs(hi - lo))
            for ticks in (axis.get_major_ticks(), axis.get_minor_ticks()):
                for tick in ticks:
                    if not lo - slack <= tick.get_loc() <= hi + slack:
                        undrawn |= {id(tick.label1), id(tick.label2)}
    boxes = [(t, t.get_window_extent(renderer).padded(-pad_px))
             for t in fig.findobj(mpl.text.Text)
             if t.get_visible() and t.get_text().strip() and id(t) not in undrawn]
    found = [f"{t.get_text()!r} leaves the figure" for t, b in boxes
             if b.x0 < frame.x0 - 1 or b.x1 > frame.x1 + 1 or b.y0 < frame.y0 - 1
             or b.y1 > frame.y1 + 1]
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            if box_a.overlaps(box_b):
                found.append(f"{a.get_text()!r} overlaps {b.get_text()!r}")
    return found
