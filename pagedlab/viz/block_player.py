"""A step-through player over a manager's history: slider, play, previous and next (ch. 4-5).

Step ``k`` shows the state after the first ``k`` events (step 0: the empty pool), drawn by
:func:`pagedlab.viz.block_view.block_svg`, under a one-line caption of the event. The picture
lives in an HTML widget, so the book's embedded widget state shows the starting step even
where no kernel runs; moving the slider needs one.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

import ipywidgets as widgets

from pagedlab.memory import KVCacheManager
from pagedlab.viz.block_replay import Snapshot, history
from pagedlab.viz.block_view import block_svg, seq_colors


class BlockPlayer(widgets.VBox):
    """Steps through ``snapshots`` (from :func:`~pagedlab.viz.block_replay.replay`), starting
    at step ``start`` (default: the last); ``interval_ms`` paces the play button."""

    def __init__(self, snapshots: Sequence[Snapshot], start: int | None = None,
                 interval_ms: int = 700, **view_options):
        if not snapshots:
            raise ValueError("a player needs at least one snapshot")
        self.snapshots = list(snapshots)
        self._view = {"colors": seq_colors(self.snapshots), **view_options}
        last = len(self.snapshots) - 1
        start = last if start is None else start
        self.slider = widgets.IntSlider(value=start, min=0, max=last, description="step",
                                        continuous_update=True)
        self.play = widgets.Play(value=start, min=0, max=last, interval=interval_ms)
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        prev = widgets.Button(description="<", tooltip="previous event",
                              layout=widgets.Layout(width="36px"))
        nxt = widgets.Button(description=">", tooltip="next event",
                             layout=widgets.Layout(width="36px"))
        prev.on_click(lambda _: self.show(self.slider.value - 1))
        nxt.on_click(lambda _: self.show(self.slider.value + 1))
        self.caption = widgets.HTML()
        self.picture = widgets.HTML()
        self.slider.observe(lambda change: self._draw(change["new"]), names="value")
        self._draw(start)
        super().__init__([widgets.HBox([self.play, prev, self.slider, nxt]), self.caption,
                          self.picture])

    @classmethod
    def of(cls, mgr: KVCacheManager, **options) -> BlockPlayer:
        """A player over the recorded history of ``mgr``."""
        return cls(history(mgr), **options)

    def show(self, step: int) -> None:
        """Move to ``step``, clamped to the recorded range."""
        self.slider.value = max(self.slider.min, min(self.slider.max, step))

    def _draw(self, step: int) -> None:
        snap = self.snapshots[step]
        self.caption.value = (f"<b>step {step} of {len(self.snapshots) - 1}</b>: "
                              f"{escape(snap.caption)}")
        self.picture.value = block_svg(snap, **self._view)
