"""Playgrounds: buttons that drive a live :class:`KVCacheManager` (chapters 4, 5 and, speculating,
12) or a live :class:`~pagedlab.engine.Scheduler` (chapter 6).

In :class:`KVPlayground` each button calls the manager itself (allocate, append, fork, free, preempt by swapping out,
resume); the picture is the manager's state after it, replayed from its events and drawn by
:mod:`pagedlab.viz.block_view`, so the reader sees block tables, reference counts, the free
and cached-free blocks and each copy-on-write. An operation the manager refuses shows the
manager's own message and changes nothing. In :class:`SchedulerPlayground` a reader queues
requests and steps the engine's own scheduler, with placeholder tokens for a model, and sees
each step's batch, its token budget, its preemption victim and the blocks that moved. In
:class:`SpeculationPlayground` a reader reserves slots for a decode's proposals and verifies
them: the rejected ones' slots go back, and no block holding an unverified proposal is ever
cached.

Built on ipywidgets 8's core widgets (buttons, text boxes, HTML), which JupyterLab, Notebook 7,
VS Code and Colab all render with no extension to install, and which pagedlab already depends
on. In the HTML book no kernel answers a button, so the same object also carries a static form
(the book's build prefers it): a player of the operations done so far.
"""

from __future__ import annotations

from collections.abc import Hashable
from html import escape

from pagedlab.engine import Placeholders, SamplingParams, Scheduler, SchedulerConfig, run_step
from pagedlab.memory import KVCacheManager
from pagedlab.memory.errors import InvariantError, OutOfBlocks, StateError, UnknownSequence
from pagedlab.viz.block_player import BlockPlayer
from pagedlab.viz.block_replay import Snapshot, history
from pagedlab.viz.block_view import block_svg, scroll_box, seq_colors

SHARED_PROMPT = tuple(range(1, 9))  # a "system prompt" of 8 tokens that prompts may start with


class Live:
    """What a playground shares: a manager that records its events (``self.mgr``), the
    operations a reader may run (``OPERATIONS``, each a method returning its log line), their
    log, the pictures of the last one, and the forms the playground is shown in."""

    OPERATIONS: tuple[str, ...] = ()
    # What the library raises for a request it refuses; anything else is a bug and propagates.
    REFUSALS: tuple[type[Exception], ...] = (OutOfBlocks, UnknownSequence, StateError, ValueError)
    mgr: KVCacheManager

    def reset(self) -> None:
        self.log: list[str] = []
        self._shown_from = 0  # the first manager event of the last operation that ran
        self._fresh = 1000  # token ids no prompt has used: a prompt shares only what it means to

    def _tokens(self, n: int) -> list[int]:
        self._fresh += n
        return list(range(self._fresh - n, self._fresh))

    def do(self, operation: str, *args) -> bool:
        """Run one operation; log it, or the library's refusal. True if it ran. A refused
        operation leaves the manager as it was (the library's own guarantee, checked here)."""
        if operation not in self.OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}; one of "
                             f"{', '.join(self.OPERATIONS)}")
        before = len(self.mgr.events)
        try:
            self.log.append(getattr(self, operation)(*args))
        except self.REFUSALS as refusal:
            if len(self.mgr.events) != before:
                raise InvariantError(f"{operation}{args}: refused after changing the manager")
            self.log.append(f"refused: {operation} {' '.join(map(str, args))}: {refusal}")
            return False
        self._shown_from = before
        self.mgr.commit()  # the work "ran": its blocks may be hit by the next prompt
        self.check()
        return True

    def check(self) -> None:
        """The manager's invariants, after every operation that ran."""
        self.mgr.check_invariants()

    def snapshots(self) -> list[Snapshot]:
        return history(self.mgr)

    def picture(self) -> str:
        """The last operation as inline SVG, one picture per manager event it caused (an
        append that copies a shared block shows the copy, then the append): block tables,
        the pool with each block's users, what the event touched."""
        snaps = self.snapshots()
        colors, new = seq_colors(snaps), len(self.mgr.events) - self._shown_from
        return "".join(scroll_box(block_svg(snap, colors=colors), "pagedlab-playground")
                       for snap in snaps[-max(new, 1):])

    def log_html(self) -> str:
        lines = [escape(line) for line in self.log[-12:]] or ["(nothing yet)"]
        return ("<pre style='margin:0.3em 0;white-space:pre-wrap'>"
                + "\n".join(lines) + "</pre>")

    def panel(self, inputs, actions):
        """ipywidgets 8 controls: a row of ``inputs``, a button for each of ``actions``
        (label, tooltip, operation, the inputs it reads) and one to reset, four to a row, the
        pictures and the log."""
        import ipywidgets as w

        picture, log = w.HTML(self.picture()), w.HTML(self.log_html())

        def refresh(*_):
            picture.value, log.value = self.picture(), self.log_html()

        def press(label, run):
            """A button's handler: ``run``, then the new picture and log. An exception that is
            no refusal (a bug) goes in the log too, then on to ipywidgets, which prints its
            traceback where the front end puts a callback's output (JupyterLab: its log
            console, which a reader does not see; without the log line a bug would look like a
            button that does nothing)."""
            def handler(_):
                try:
                    run()
                    refresh()
                except Exception as error:
                    self.log.append(f"error in {label} (a bug, not a refusal; the manager may "
                                    f"be inconsistent: reset): {type(error).__name__}: {error}")
                    log.value = self.log_html()  # the log alone: drawing may be what failed
                    raise
            return handler

        buttons = []
        for label, tip, operation, fields in actions:
            buttons.append(w.Button(description=label, tooltip=tip, layout=w.Layout(width="auto")))
            buttons[-1].on_click(press(label, lambda operation=operation, fields=fields: self.do(
                operation, *(f.value for f in fields))))
        buttons.append(w.Button(description="reset", tooltip="start again",
                                layout=w.Layout(width="auto")))
        buttons[-1].on_click(press("reset", self.reset))
        rows = [w.HBox(buttons[i:i + 4]) for i in range(0, len(buttons), 4)]
        return w.VBox([w.HBox(inputs), *rows, picture, log])

    def widget(self):
        raise NotImplementedError

    def _repr_mimebundle_(self, include=None, exclude=None):
        """Live in a kernel's front end (the widget); a player of what was done where no kernel
        runs (the HTML book prefers text/html); its text summary in a terminal or nbval."""
        note = ("<p><i>The live playground runs in Jupyter or Colab (the launch button above); "
                "here, a replay of its operations.</i></p>")
        bundle = self.widget()._repr_mimebundle_()
        bundle.update({"text/plain": repr(self),
                       "text/html": note + BlockPlayer(self.snapshots())._repr_html_()})
        return bundle

    def __repr__(self) -> str:
        log = "\n".join(self.log) or "(nothing yet)"
        return f"{log}\n{self.snapshots()[-1].summary()}"


class KVPlayground(Live):
    """A live manager of ``num_blocks`` GPU blocks of ``block_size`` tokens (``num_cpu_blocks``
    to swap into), with prefix caching unless ``prefix_caching=False``, and its log."""

    OPERATIONS = ("allocate", "allocate_shared", "append", "fork", "free", "preempt", "resume")

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
        super().reset()

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

    def widget(self):
        """The live playground: controls over this manager."""
        seq, child = name_box("A", "sequence"), name_box("B", "fork into")
        tokens = count_box(6, 1, 256, "tokens")
        return self.panel([seq, child, tokens], [
            ("allocate", "a new prompt of `tokens` tokens", "allocate", [seq, tokens]),
            ("allocate, shared prompt", "a prompt that starts with the shared 8 tokens",
             "allocate_shared", [seq, tokens]),
            ("append", "`tokens` decoded tokens", "append", [seq, tokens]),
            ("fork", "a child sharing every block", "fork", [seq, child]),
            ("free", "give the blocks back", "free", [seq]),
            ("preempt (swap out)", "move the blocks to CPU memory", "preempt", [seq]),
            ("resume (swap in)", "bring them back to GPU blocks", "resume", [seq])])


class SpeculationPlayground(Live):
    """Speculative decoding on a live manager with prefix caching (chapter 12): a sequence's
    prompt is computed and its first output token is pending; *speculate* gives the pending
    token and ``k`` proposals slots (the proposals unverified: no block holding one is
    cached); *verify* keeps the pending token and the first ``accepted`` proposals and gives
    the other slots back (a block left empty too); the target's own token is pending then."""

    OPERATIONS = ("allocate", "speculate", "verify", "free")

    def __init__(self, num_blocks: int = 12, block_size: int = 4):
        self.config = dict(num_blocks=num_blocks, block_size=block_size)
        self.reset()

    def reset(self) -> None:
        """An empty pool with prefix caching, no proposals, an empty log."""
        self.mgr = KVCacheManager(self.config["num_blocks"], self.config["block_size"], 0, True,
                                  record_events=True)
        self.proposed: dict[Hashable, int] = {}  # unverified proposals, by sequence
        super().reset()

    def check(self) -> None:
        """The invariants hold between steps: with proposals unverified, a full block holding
        one has no key yet, by design (the engine checks after a step's verification)."""
        if not self.proposed:
            super().check()

    def allocate(self, seq_id: Hashable, num_tokens: int) -> str:
        self.mgr.allocate(seq_id, self._tokens(num_tokens))
        return f"allocate {seq_id}: a prompt of {num_tokens} tokens; its first output is pending"

    def speculate(self, seq_id: Hashable, k: int) -> str:
        if seq_id in self.proposed:
            raise ValueError(f"sequence {seq_id!r} holds {self.proposed[seq_id]} proposals: "
                             "verify them first")
        if k < 1:
            raise ValueError(f"k={k}: speculate at least one proposal")
        self.mgr.append(seq_id, self._tokens(1 + k), num_speculative=k)
        self.proposed[seq_id] = k
        return (f"speculate {seq_id}: the pending token and {k} proposals get slots; "
                "none of the proposals' blocks is cached")

    def verify(self, seq_id: Hashable, accepted: int) -> str:
        k = self.proposed.get(seq_id)
        if k is None:
            raise ValueError(f"sequence {seq_id!r} has no proposals to verify")
        if not 0 <= accepted <= k:
            raise ValueError(f"accepted={accepted} must be in [0, {k}], the proposals made")
        self.mgr.truncate(seq_id, self.mgr.num_tokens(seq_id) - k + accepted)
        del self.proposed[seq_id]
        return (f"verify {seq_id}: {accepted} of {k} accepted, {k - accepted} slots given back;"
                " the target's own token is pending")

    def free(self, seq_id: Hashable) -> str:
        self.mgr.free(seq_id)
        self.proposed.pop(seq_id, None)
        return f"free {seq_id}"

    def widget(self):
        """The live playground: a prompt, proposals and verification over this manager."""
        seq = name_box("A", "sequence")
        size = count_box(6, 1, 256, "tokens / k", width="14em")
        accepted = count_box(1, 0, 64, "accepted")
        return self.panel([seq, size, accepted], [
            ("allocate", "a prompt of `tokens` tokens", "allocate", [seq, size]),
            ("speculate", "the pending token and k proposals", "speculate", [seq, size]),
            ("verify", "keep `accepted` proposals, give the rest back", "verify",
             [seq, accepted]),
            ("free", "give the blocks back", "free", [seq])])


class SchedulerPlayground(Live):
    """The engine's own scheduler over ``num_blocks`` blocks of ``block_size`` tokens, a token
    budget of ``max_num_batched_tokens`` a step and ``preemption_mode``; every sequence
    samples a placeholder token, so no model runs."""

    OPERATIONS = ("add", "step")

    def __init__(self, num_blocks: int = 10, block_size: int = 4, num_cpu_blocks: int = 8,
                 max_num_batched_tokens: int = 12, preemption_mode: str = "recompute"):
        self.config = dict(num_blocks=num_blocks, block_size=block_size,
                           num_cpu_blocks=num_cpu_blocks, preemption_mode=preemption_mode,
                           max_num_batched_tokens=max_num_batched_tokens)
        self.reset()

    def reset(self) -> None:
        c = self.config
        self.mgr = KVCacheManager(c["num_blocks"], c["block_size"], c["num_cpu_blocks"],
                                  record_events=True)
        self.scheduler = Scheduler(self.mgr, SchedulerConfig(
            max_num_batched_tokens=c["max_num_batched_tokens"],
            max_num_seqs=min(8, c["max_num_batched_tokens"]),
            preemption_mode=c["preemption_mode"], watermark=0.0))
        self.num_steps = 0
        super().reset()

    def add(self, request_id: str, prompt_tokens: int, max_tokens: int) -> str:
        """Queue a request of ``prompt_tokens`` that will decode ``max_tokens``."""
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(request_id, self._tokens(prompt_tokens), params)
        return f"add {request_id}: {prompt_tokens} prompt tokens, {max_tokens} to decode"

    def step(self) -> str:
        """One engine step: the scheduler's batch, run with placeholder tokens."""
        if not self.scheduler.has_unfinished:
            raise StateError("nothing to run: add a request first")
        names = {s.seq_id: g.request_id for g in self.scheduler.unfinished.values()
                 for s in g.seqs}
        step, _, finished = run_step(self.scheduler, Placeholders(7))
        self.num_steps += 1
        return describe_step(self.num_steps, step, finished, names, self.scheduler,
                             self.config["max_num_batched_tokens"])

    def widget(self):
        """The live playground: queue requests and step the scheduler."""
        rid = name_box("A", "request")
        prompt, out = count_box(8, 1, 256, "prompt"), count_box(4, 1, 256, "decode")
        return self.panel([rid, prompt, out], [
            ("add request", "queue a request: `prompt` tokens, then `decode` more", "add",
             [rid, prompt, out]),
            ("step", "one engine step: the scheduler's batch", "step", [])])


def name_box(value: str, label: str):
    """A text box for a sequence's or a request's name."""
    import ipywidgets as w

    return w.Text(value=value, description=label, layout=w.Layout(width="14em"))


def count_box(value: int, low: int, high: int, label: str, width: str = "12em"):
    """A box for a count of tokens, bounded to [``low``, ``high``]."""
    import ipywidgets as w

    return w.BoundedIntText(value=value, min=low, max=high, description=label,
                            layout=w.Layout(width=width))


def describe_step(number, step, finished, names, scheduler, budget) -> str:
    """A step as text: the chunks it ran against the token budget, who was preempted and how,
    the blocks that moved, who finished, and the queues after it."""
    def who(chunks):
        return ", ".join(f"{names[c.seq.seq_id]} ({c.num_tokens})" for c in chunks) or "none"

    used = sum(c.num_tokens for c in (*step.prefills, *step.decodes))
    lines = [f"step {number}: {used} of {budget} budget tokens; decodes {who(step.decodes)};"
             f" prefill chunks {who(step.prefills)}"]
    for group, mode in step.preempted:
        lines.append(f"  preempted {group.request_id} by {mode}")
    if step.swap_out or step.swap_in:
        lines.append(f"  blocks swapped out {step.swap_out}, in {step.swap_in}")
    if finished:
        lines.append(f"  finished {', '.join(g.request_id for g in finished)}")
    queues = {name: [g.request_id for g in getattr(scheduler, name)]
              for name in ("running", "waiting", "swapped")}
    lines.append("  " + "; ".join(f"{k}: {' '.join(v) or '-'}" for k, v in queues.items()))
    return "\n".join(lines)
