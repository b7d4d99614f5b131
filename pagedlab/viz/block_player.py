"""A step-through player over a manager's history: slider, play, previous and next (ch. 4-5).

Step ``k`` shows the state after the first ``k`` events (step 0: the empty pool), drawn by
:func:`pagedlab.viz.block_view.block_svg`, under a one-line caption of the event. Every step
is rendered to SVG in Python, once, and the player is a self-contained piece of HTML whose few
lines of JavaScript only show one frame and hide the others: it works the same in the published
HTML book (no kernel behind it), in Jupyter and in Colab. Without JavaScript (a notebook
viewer) it shows the starting step; in a terminal or under nbval its repr is that step's text.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from html import escape

from pagedlab.memory import KVCacheManager
from pagedlab.viz.block_replay import Snapshot, history
from pagedlab.viz.block_view import block_svg, scroll_box, seq_colors

_ids = itertools.count()

# Moves the player rooted at ROOT to a step; the controls and the play timer call it.
_SCRIPT = """
(function () {
  var root = document.getElementById("ROOT"), slider = root.querySelector("input");
  var frames = root.querySelectorAll(".pagedlab-frame"), last = frames.length - 1, timer = null;
  var play = root.querySelector("[data-act=play]");
  function show(k) {
    k = Math.max(0, Math.min(last, k));
    frames.forEach(function (f, i) { f.hidden = i !== k; });
    slider.value = k;
  }
  function stop() { clearInterval(timer); timer = null; play.textContent = "\\u25b6 play"; }
  slider.addEventListener("input", function () { stop(); show(+slider.value); });
  root.querySelector("[data-act=prev]").onclick = function () { stop(); show(+slider.value - 1); };
  root.querySelector("[data-act=next]").onclick = function () { stop(); show(+slider.value + 1); };
  play.onclick = function () {
    if (timer) { stop(); return; }
    if (+slider.value === last) show(0);
    play.textContent = "\\u275a\\u275a pause";
    timer = setInterval(function () {
      if (+slider.value >= last) stop(); else show(+slider.value + 1);
    }, INTERVAL);
  };
})();
"""


class BlockPlayer:
    """Steps through ``snapshots`` (from :func:`~pagedlab.viz.block_replay.replay`), starting
    at step ``start`` (default: the last); ``interval_ms`` paces the play button."""

    def __init__(self, snapshots: Sequence[Snapshot], start: int | None = None,
                 interval_ms: int = 700, **view_options):
        if not snapshots:
            raise ValueError("a player needs at least one snapshot")
        self.snapshots = list(snapshots)
        self.last = len(self.snapshots) - 1
        self.interval_ms = interval_ms
        self._view = {"colors": seq_colors(self.snapshots), **view_options}
        self.step = self.last
        self.show(self.last if start is None else start)

    @classmethod
    def of(cls, mgr: KVCacheManager, **options) -> BlockPlayer:
        """A player over the recorded history of ``mgr``."""
        return cls(history(mgr), **options)

    def show(self, step: int) -> None:
        """Start at ``step``, clamped to the recorded range."""
        self.step = max(0, min(self.last, step))

    def frame(self, step: int) -> str:
        """The HTML of one step: its caption over its picture."""
        snap = self.snapshots[step]
        return (f'<div style="margin:0.3em 0"><b>step {step} of {self.last}</b>: '
                f"{escape(snap.caption)}</div>"
                f"{scroll_box(block_svg(snap, **self._view), 'pagedlab-frame-svg')}")

    def _repr_html_(self) -> str:
        root = f"pagedlab-player-{next(_ids)}"
        frames = "".join(
            f'<div class="pagedlab-frame" data-step="{k}"{"" if k == self.step else " hidden"}>'
            f"{self.frame(k)}</div>" for k in range(self.last + 1))
        button = '<button type="button" data-act="{}" title="{}">{}</button>'
        controls = (button.format("play", "play all steps", "&#9654; play")
                    + button.format("prev", "previous event", "&lt;")
                    + f'<input type="range" min="0" max="{self.last}" value="{self.step}" '
                      f'aria-label="step" style="width:min(24em,60%);vertical-align:middle">'
                    + button.format("next", "next event", "&gt;"))
        script = _SCRIPT.replace("ROOT", root).replace("INTERVAL", str(self.interval_ms))
        return (f'<div class="pagedlab-player" id="{root}">'
                f"<div>{controls}</div>{frames}<script>{script}</script></div>")

    def __repr__(self) -> str:
        snap = self.snapshots[self.step]
        return f"step {self.step} of {self.last}: {snap.caption}\n{snap.summary()}"
