"""A KV-cache playground: buttons that drive a live :class:`KVCacheManager` (chapters 4, 5).

Each button calls the manager itself (allocate, append, fork, free, preempt by swapping out,
resume); the picture is the manager's state after it, replayed from its events and drawn by
:mod:`pagedlab.viz.block_view`, so the reader sees block tables, reference counts, the free
and cached-free blocks and each copy-on-write. An operation the manager refuses shows the
manager's own message and changes nothing.

Built on ipywidgets 8's core widgets (buttons, text boxes, HTML), which JupyterLab, Notebook 7,
VS Code and Colab all render with no extension to install, and which pagedlab already depends
on. In the HTML book no kernel answers a button, so the same object also carries a static form
(the book's build prefers it): a player of the operations done so far.
"""

from __future__ import annotations

from collections.abc import Hashable
from html import escape

from pagedlab.memory import KVCacheManager
from pagedlab.memory.errors import InvariantError, OutOfBlocks, StateError, UnknownSequence
from pagedlab.viz.block_player import BlockPlayer
from pagedlab.viz.block_replay import Snapshot, history
from pagedlab.viz.block_view import block_svg, scroll_box, seq_colors

SHARED_PROMPT = tuple(range(1, 9))  # a "system prompt" of 8 tokens that prompts may start with
# What the manager raises for a request it refuses; anything else is a bug and propagates.
REFUSALS = (OutOfBlocks, UnknownSequence, StateError, ValueError)
OPERATIONS = ("allocate", "allocate_shared", "append", "fork", "free", "preempt", "resume")


class KVPlayground:
    """A live manager of ``num_blocks`` GPU blocks of ``block_size`` tokens (``num_cpu_blocks``
    to swap into), with prefix caching unless ``prefix_caching=False``, and its log."""

    def __init__(self, num_blocks: int = 12, block_size: int = 4, num_cpu_blocks: int = 8,
                 prefix_caching: bool = True):
        self.config = dict(num_blocks=num_blocks, block_size=block_size,
                           num_cpu_blocks=num_cpu_blocks, prefix_caching=prefix_caching)
        self.reset()

    def reset(self) -> None:
        """An empty pool and an empty log."""
        c = self.config
        self.mgr = KVCacheManager(c["num_blocks"], c["block_size"], c["num_cpu_blocks"],
                                  c["prefix_caching"], record_events=True)
        self.log: list[str] = []
        self._shown_from = 0  # the first manager event of the last operation that ran
        self._fresh = 1000  # token ids no prompt has used: a prompt shares only what it means to

    def _tokens(self, n: int) -> list[int]:
        self._fresh += n
        return list(range(self._fresh - n, self._fresh))

    # --- the operations, each one manager call ----------------------------------------------

    def allocate(self, seq_id: Hashable, num_tokens: int) -> str:
        self.mgr.allocate(seq_id, self._tokens(num_tokens))
        return f"allocate {seq_id}: a prompt of {num_tokens} new tokens"

    def allocate_shared(self, seq_id: Hashable, num_tokens: int) -> str:
        """A prompt that starts with :data:`SHARED_PROMPT`: the prefix cache may serve it."""
        extra = max(0, num_tokens - len(SHARED_PROMPT))
        cached = self.mgr.allocate(seq_id, [*SHARED_PROMPT, *self._tokens(extra)])
        return (f"allocate {seq_id}: the shared prompt of {len(SHARED_PROMPT)} tokens + {extra}"
                f" new; {cached} tokens served from the prefix cache")

    def append(self, seq_id: Hashable, num_tokens: int) -> str:
        self.mgr.append(seq_id, self._tokens(num_tokens))
        copied = self.mgr.take_copies()  # a copy-on-write of the shared last block, if any
        note = "".join(f"; block {src} copied to {dst}" for src, dst in copied)
        return f"append {num_tokens} token{'s' * (num_tokens != 1)} to {seq_id}{note}"

    def fork(self, parent_id: Hashable, child_id: Hashable) -> str:
        self.mgr.fork(parent_id, child_id)
        return f"fork {parent_id} into {child_id}: every block shared, none copied"

    def free(self, seq_id: Hashable) -> str:
        self.mgr.free(seq_id)
        return f"free {seq_id}"

    def preempt(self, seq_id: Hashable) -> str:
        self.mgr.swap_out(seq_id)
        return f"preempt {seq_id}: its blocks swapped out to CPU memory"

    def resume(self, seq_id: Hashable) -> str:
        self.mgr.swap_in(seq_id)
        return f"resume {seq_id}: swapped back into GPU blocks"

    def do(self, operation: str, *args) -> bool:
        """Run one operation; log it, or the manager's refusal. True if it ran. A refused
        operation leaves the manager as it was (the manager's own guarantee, checked here)."""
        if operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}; one of {', '.join(OPERATIONS)}")
        before = len(self.mgr.events)
        try:
            self.log.append(getattr(self, operation)(*args))
            self._shown_from = before
        except REFUSALS as refusal:
            if len(self.mgr.events) != before:
                raise InvariantError(f"{operation}{args}: refused after changing the manager")
            self.log.append(f"refused: {operation} {' '.join(map(str, args))}: {refusal}")
            return False
        self.mgr.commit()  # the step "ran": its blocks may be hit by the next prompt
        self.mgr.check_invariants()
        return True

    # --- what the reader sees ---------------------------------------------------------------

    def snapshots(self) -> list[Snapshot]:
        return history(self.mgr)

    def picture(self) -> str:
        """The last operation as inline SVG, one picture per manager event it caused (an
        append that copies a shared block shows the copy, then the append): block tables,
        the pool with each block's users, what the event touched."""
        snaps = self.snapshots()
        colors = seq_colors(snaps)
        shown = snaps[-(len(self.mgr.events) - self._shown_from):] if (
            len(self.mgr.events) > self._shown_from) else snaps[-1:]
        return "".join(scroll_box(block_svg(snap, colors=colors), "pagedlab-playground")
                       for snap in shown)

    def log_html(self) -> str:
        lines = [escape(line) for line in self.log[-12:]] or ["(nothing yet)"]
        return ("<pre style='margin:0.3em 0;white-space:pre-wrap'>"
                + "\n".join(lines) + "</pre>")

    def widget(self):
        """The live playground: ipywidgets 8 controls over this manager."""
        import ipywidgets as w

        seq = w.Text(value="A", description="sequence", layout=w.Layout(width="14em"))
        child = w.Text(value="B", description="fork into", layout=w.Layout(width="14em"))
        tokens = w.BoundedIntText(value=6, min=1, max=256, description="tokens",
                                  layout=w.Layout(width="12em"))
        picture, log = w.HTML(self.picture()), w.HTML(self.log_html())

        def refresh():
            picture.value, log.value = self.picture(), self.log_html()

        def button(label, tip, operation, *fields):
            b = w.Button(description=label, tooltip=tip, layout=w.Layout(width="auto"))
            b.on_click(lambda _: (self.do(operation, *(f.value for f in fields)), refresh()))
            return b

        def restart(_):
            self.reset()
            refresh()

        reset = w.Button(description="reset", tooltip="an empty pool",
                         layout=w.Layout(width="auto"))
        reset.on_click(restart)
        buttons = [
            button("allocate", "a new prompt of `tokens` tokens", "allocate", seq, tokens),
            button("allocate, shared prompt", "a prompt that starts with the shared 8 tokens",
                   "allocate_shared", seq, tokens),
            button("append", "`tokens` decoded tokens", "append", seq, tokens),
            button("fork", "a child sharing every block", "fork", seq, child),
            button("free", "give the blocks back", "free", seq),
            button("preempt (swap out)", "move the blocks to CPU memory", "preempt", seq),
            button("resume (swap in)", "bring them back to GPU blocks", "resume", seq),
            reset]
        return w.VBox([w.HBox([seq, child, tokens]), w.HBox(buttons[:4]), w.HBox(buttons[4:]),
                       picture, log])

    def _repr_mimebundle_(self, include=None, exclude=None):
        """Live in a kernel's front end (the widget); a player of what was done where no kernel
        runs (the HTML book prefers text/html); its text summary in a terminal or nbval."""
        note = ("<p><i>The live playground runs in Jupyter or Colab (the launch button above); "
                "here, a replay of its operations.</i></p>")
        bundle = {"text/plain": repr(self),
                  "text/html": note + BlockPlayer(self.snapshots())._repr_html_()}
        bundle.update(self.widget()._repr_mimebundle_())
        bundle["text/plain"] = repr(self)
        return bundle

    def __repr__(self) -> str:
        log = "\n".join(self.log) or "(nothing yet)"
        return f"{log}\n{self.snapshots()[-1].summary()}"
