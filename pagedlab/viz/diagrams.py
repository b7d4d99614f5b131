"""Explanatory diagrams the chapters draw from their own data (chapters 3 to 7, 9, 11 and 14).

Each function takes what the chapter computed (a cache tensor, a block table, log-sum-exps,
prompts, a run's transition counts, model presets) and returns a matplotlib figure about 7
inches wide, the book's page width, with fonts of at least 9 points. The artists that stand for
the things counted (blocks, programs, splits, states, ...) carry a ``gid``, so a test can check
that the picture shows what the data says (:func:`artists`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from pagedlab._arith import cdiv
from pagedlab.footprint import get_model, kv_bytes_per_token
from pagedlab.memory.prefix_cache import block_key

__all__ = [
    "artists", "cache_layout", "decode_grid", "split_ranges", "split_merge", "hash_chain",
    "state_machine", "kv_heads", "traffic_bars", "varlen_tiles", "chunk_mask", "online_sweep",
    "free_list_moves", "scheduler_steps", "tensor_parallel_blocks", "slot_loads",
]

WIDTH = 7.0  # inches: the page width
FONT = 9  # the smallest font on any diagram, in points
COLORS = ["#3b75af", "#e8590c", "#2ca02c", "#9467bd", "#8c564b", "#d62728", "#138d9c", "#8a8b10"]
MAX_CELLS = 16  # a tier of the cache layout draws at most this many cells


def artists(fig: Figure, gid: str) -> list:
    """The artists of ``fig`` tagged ``gid``."""
    return [a for a in fig.findobj() if a.get_gid() == gid]


def _canvas(height: float, xlim: tuple[float, float], ylim: tuple[float, float]):
    fig, ax = plt.subplots(figsize=(WIDTH, height))
    ax.set(xlim=xlim, ylim=ylim)
    ax.axis("off")
    return fig, ax


def _box(ax, x, y, w, h, text="", gid=None, fill="#ffffff", edge="#444444", size=FONT, **kw):
    """A rectangle with centred text; returns the rectangle."""
    rect = Rectangle((x, y), w, h, facecolor=fill, edgecolor=edge, lw=1, **kw)
    rect.set_gid(gid)
    ax.add_patch(rect)
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)
    return rect


def _arrow(ax, start, end, gid=None, rad=0.0, color="#444444", lw=1.2):
    arrow = FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=color, lw=lw,
                            connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2)
    arrow.set_gid(gid)
    ax.add_patch(arrow)
    return arrow


# --- Chapter 7: the cache layout ------------------------------------------------------------


def cache_layout(cache) -> Figure:
    """One layer's cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` as memory.

    Four tiers, each a zoom into one cell of the tier above: the blocks, one block's token
    slots, one slot's KV heads, one head's values, each labelled with the stride (elements and
    bytes) between its cells, read from ``cache.stride()``. A ``meta`` tensor will do.
    """
    names = ("block", "slot", "head", "value")
    titles = ("cache: {:,} blocks", "a block: {:,} token slots", "a slot: {:,} KV heads",
              "a KV head: {:,} values")
    shape, strides, size = tuple(cache.shape), cache.stride(), cache.element_size()
    fig, ax = _canvas(3.9, (0, 10), (-0.5, 4.4))
    left, right = 3.4, 9.9
    zoom = (None, None)
    for tier, (name, n, stride) in enumerate(zip(names, shape, strides)):
        y = 3.6 - tier * 1.2
        drawn = min(n, MAX_CELLS)
        w = (right - left) / drawn
        for i in range(drawn):
            label = str(i) if drawn == n or i < drawn - 1 else "…"  # the rest, elided
            _box(ax, left + i * w, y, w, 0.5, label if w > 0.3 else "", gid=name,
                 fill="#d0e2f3" if i == 1 % n else "#ffffff")
        ax.text(0, y + 0.38, titles[tier].format(n), fontsize=FONT + 1, weight="bold",
                va="center")
        unit = f"{stride * size:,} B" if stride * size < 1024 else f"{stride * size / 1024:g} KiB"
        ax.text(0, y + 0.05, f"stride {stride:,} el. = {unit}", fontsize=FONT, va="center",
                gid=f"stride{tier}")
        if zoom[0] is not None:  # lines from the zoomed cell above to this tier's ends
            for xa, xb in ((zoom[0], left), (zoom[1], right)):
                ax.plot([xa, xb], [y + 1.2, y + 0.5], color="#999999", lw=0.8)
        zoom = (left + (1 % n) * w, left + (1 % n + 1) * w)
    ax.text(0, -0.4, f"shape {list(shape)}, {size} bytes per value; each shaded cell is "
            "opened up in the tier below it", fontsize=FONT, color="#555555")
    return fig


def slot_loads(loads: Mapping[tuple[int, ...], Sequence[int]], cache) -> Figure:
    """The cache's token slots each program loaded, as :func:`pagedlab.viz.loads.record_loads`
    recorded them.

    ``loads`` maps a program's grid coordinates to element offsets into ``cache``
    (``[num_blocks, block_size, ...]``); an offset's slot is ``offset // cache.stride(1)``, that
    is ``block * block_size + token``. One row per program, the cache's blocks side by side along
    it, each labelled with its physical id; the slots the program loaded are filled.
    """
    num_blocks, block_size = cache.shape[:2]
    step = block_size + 0.5  # a block's slots, then a gap
    left = 0.3 * num_blocks * step  # room for the programs' names
    fig, ax = _canvas(1.1 + 0.45 * len(loads), (-left, num_blocks * step), (-1.3, len(loads) + 0.8))
    ax.text(-0.3, len(loads) + 0.3, "physical block", ha="right", fontsize=FONT)
    for b in range(num_blocks):
        ax.text(b * step + block_size / 2, len(loads) + 0.3, str(b), ha="center", fontsize=FONT,
                gid="block")
    for r, (program, offsets) in enumerate(loads.items()):
        y, color = len(loads) - 1 - r, COLORS[r % len(COLORS)]
        name = ", ".join(map(str, program))
        ax.text(-0.3, y + 0.4, f"program {name}", ha="right", va="center", fontsize=FONT)
        slots = {o // cache.stride(1) for o in offsets}
        for s in range(num_blocks * block_size):
            b, t = divmod(s, block_size)
            _box(ax, b * step + t, y, 1, 0.8, gid="slot" if s in slots else None,
                 fill=color if s in slots else "#ffffff", edge="#bbbbbb")
    ax.text(-left, -0.75, f"each block holds {block_size} token slots; a filled slot is one whose "
            "values the program loaded\n(masked lanes load nothing)", fontsize=FONT,
            color="#555555", va="center")
    return fig


# --- Chapter 7: the decode grid and split-KV ------------------------------------------------


def split_ranges(seq_len: int, num_splits: int, tile: int) -> list[tuple[int, int]]:
    """Token range [start, end) of each split, as the decode kernel computes it: an equal share
    of ``seq_len`` rounded up to whole tiles; a split past the end is empty (start >= end)."""
    split_len = cdiv(cdiv(seq_len, num_splits), tile) * tile
    return [(k * split_len, min((k + 1) * split_len, seq_len)) for k in range(num_splits)]


def decode_grid(seq_lens: Sequence[int], block_tables, block_size: int, num_kv_heads: int,
                num_splits: int, tile: int) -> Figure:
    """The decode kernel's grid (sequence x KV head x split) over the sequences' blocks.

    One row per (sequence, KV head); along it the sequence's logical blocks, each naming its
    physical block from ``block_tables``, and below them the programs of the row's splits, each
    cut into the tiles its loop visits. A tile's tokens may span several blocks, or part of one.
    """
    rows = [(s, h) for s in range(len(seq_lens)) for h in range(num_kv_heads)]
    coords = "seq, KV head, split" if num_splits > 1 else "seq, KV head"
    longest = max(seq_lens)
    fig, ax = _canvas(0.9 + 0.62 * len(rows), (-0.2 * longest, longest * 1.16),
                      (-0.9, len(rows) * 1.0))
    for r, (s, h) in enumerate(rows):
        y = (len(rows) - 1 - r) * 1.0
        ax.text(-0.02 * longest, y + 0.45, f"seq {s}, KV head {h}", ha="right", va="center",
                fontsize=FONT)
        for j in range(cdiv(seq_lens[s], block_size)):
            end = min((j + 1) * block_size, seq_lens[s])
            label = str(int(block_tables[s][j])) if 2 * (end - j * block_size) >= block_size else ""
            _box(ax, j * block_size, y + 0.45, end - j * block_size, 0.4, label, gid="block",
                 fill="#f2f2f2")
        for k, (start, end) in enumerate(split_ranges(seq_lens[s], num_splits, tile)):
            color = COLORS[k % len(COLORS)]
            if start >= end:  # an empty split: a program that loads nothing
                ax.text(seq_lens[s] + 0.01 * longest, y + 0.215, f"({s},{h},{k}) empty",
                        va="center", fontsize=FONT, color=color, gid="program")
                continue
            prog = Rectangle((start, y + 0.05), end - start, 0.33, facecolor=color, alpha=0.25,
                             edgecolor=color, lw=1.2, gid="program")
            ax.add_patch(prog)
            for t in range(start, end, tile):
                _box(ax, t, y + 0.05, min(t + tile, end) - t, 0.1, gid="tile", fill=color,
                     edge="#ffffff")
            label = f"({s},{h},{k})" if num_splits > 1 else f"({s},{h})"
            if end - start >= 0.1 * longest:  # room for the label
                ax.text((start + end) / 2, y + 0.27, label, ha="center", va="center",
                        fontsize=FONT, color="#222222")
    ax.text(-0.2 * longest, -0.5, f"grey: logical blocks of {block_size} tokens, each naming "
            f"its physical block\ncoloured: the programs ({coords}), cut into tiles of {tile} "
            "tokens", fontsize=FONT, color="#555555", va="center")
    return fig


def split_merge(ranges: Sequence[tuple[int, int]], lse: Sequence[float]) -> Figure:
    """The split-KV merge: each split's log-sum-exp, and the weight its output gets.

    Split ``k`` covers tokens ``ranges[k]`` and reports ``lse[k]`` (``-inf`` if empty); the
    merge weighs its normalised output by ``exp(lse[k] - lse_total)``; the weights sum to 1.
    """
    finite = [x for x in lse if x != -math.inf]
    top = max(finite)
    total = top + math.log(sum(math.exp(x - top) for x in finite))
    weights = [0.0 if x == -math.inf else math.exp(x - total) for x in lse]
    n = len(lse)
    fig, ax = _canvas(0.9 + 0.55 * n, (0, 10), (-0.3, n))
    merge_y = n / 2 - 0.45
    _box(ax, 6.6, merge_y, 3.3, 0.9, f"merge\nlse = {total:.2f}\nout = Σ w·out_k", gid="merge",
         fill="#fff1c2")
    for k, ((start, end), x, w) in enumerate(zip(ranges, lse, weights)):
        y = n - 1 - k + 0.1
        text = (f"split {k}: tokens {start}–{end - 1}\nlse = {x:.2f}" if end > start
                else f"split {k}: empty\nlse = −inf")
        _box(ax, 0.1, y, 3.0, 0.75, text, gid="split", fill="#d0e2f3")
        _arrow(ax, (3.1, y + 0.37), (6.6, merge_y + 0.45), lw=0.6 + 5 * w, color="#3b75af")
        ax.text(3.3, y + 0.37 + 0.1 * (merge_y + 0.08 - y) + 0.15, f"w = {w:.2f}",
                fontsize=FONT, gid="weight", va="center")
    return fig


# --- Chunked prefill: the varlen kernel's query tiles and a chunk's causal mask ---------------


def varlen_tiles(query_lens: Sequence[int], tile_q: int) -> Figure:
    """The varlen kernel's first grid axis over a step's packed query tokens.

    Sequence ``i`` brings ``query_lens[i]`` tokens; its tiles of ``tile_q`` tokens are numbered
    from ``start_i // tile_q + i`` (``start_i`` its first packed row), as the kernel numbers
    them. Top: the packed tokens cut into each sequence's tiles; bottom: one box per program of
    the grid's ``num_tokens // tile_q + num_seqs``, joined to the tile it computes, or marked as
    a spare number that exits at once.
    """
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    total = sum(query_lens)
    grid = total // tile_q + len(query_lens)
    owner = {}  # program -> (sequence, first token of its tile)
    for i, (start, n) in enumerate(zip(starts, query_lens)):
        for k in range(cdiv(n, tile_q)):
            owner[start // tile_q + i + k] = (i, k * tile_q)
    fig, ax = _canvas(2.6, (-0.16 * total, total * 1.02), (-0.4, 3.5))
    ax.text(-0.01 * total, 2.45, "packed\nquery rows", ha="right", va="center", fontsize=FONT)
    ax.text(-0.01 * total, 0.45, "programs\n(axis 0)", ha="right", va="center", fontsize=FONT)
    for i, (start, n) in enumerate(zip(starts, query_lens)):
        color = COLORS[i % len(COLORS)]
        for first in range(0, n, tile_q):
            width = min(tile_q, n - first)
            _box(ax, start + first, 2.2, width, 0.5, "", gid="tile", fill=color, edge="#ffffff",
                 alpha=0.75)
        wide = n >= 0.12 * total  # room for a full label; narrow ones alternate in height
        ax.text(start + n / 2, 2.95 if wide or i % 2 else 3.35,
                f"seq {i}: {n}" if wide else str(i), ha="center", va="center", fontsize=FONT,
                color=color)
    w = total / grid
    for t in range(grid):
        if t in owner:
            i, first = owner[t]
            _box(ax, t * w + 0.05 * w, 0.2, 0.9 * w, 0.5, str(t) if w > 0.03 * total else "",
                 gid="program", fill=COLORS[i % len(COLORS)], alpha=0.35)
            tile_mid = starts[i] + first + min(tile_q, query_lens[i] - first) / 2
            ax.plot([t * w + w / 2, tile_mid], [0.7, 2.2], color="#888888", lw=0.7,
                    gid="assignment")
        else:
            _box(ax, t * w + 0.05 * w, 0.2, 0.9 * w, 0.5, "×", gid="spare", fill="#f2f2f2",
                 edge="#aaaaaa")
    ax.text(-0.16 * total, -0.25, f"tiles of {tile_q} query tokens; × a spare program number: "
            "its sequence has fewer tiles, so it exits", fontsize=FONT, color="#555555",
            va="center")
    return fig


def chunk_mask(cached: int, chunk: int, block_size: int) -> Figure:
    """Which keys each query token of a prefill chunk sees: a chunk of ``chunk`` tokens after
    ``cached`` cached ones. Row j (query at position ``cached + j``) sees every cached key and
    the chunk's keys up to itself; vertical lines mark the cache's blocks."""
    keys = cached + chunk
    fig, ax = _canvas(1.0 + 0.28 * chunk, (-0.22 * keys, keys + 0.5), (-2.3, chunk + 0.3))
    for j in range(chunk):
        y = chunk - 1 - j
        ax.text(-0.3, y + 0.5, f"query at {cached + j}", ha="right", va="center", fontsize=FONT)
        for k in range(keys):
            if k < cached:
                gid, fill = "visible", COLORS[0]
            elif k <= cached + j:
                gid, fill = "visible", COLORS[1]
            else:
                gid, fill = "masked", "#ffffff"
            _box(ax, k, y, 1, 1, gid=gid, fill=fill, edge="#dddddd", alpha=0.7)
    for b in range(0, keys + 1, block_size):
        ax.plot([b, b], [0, chunk], color="#444444", lw=1.2, gid="block_edge")
    ax.text(0, -0.45, f"keys 0 to {keys - 1} (blocks of {block_size})", va="center",
            fontsize=FONT)
    ax.text(0, -1.55, f"blue: the {cached} cached keys, seen by every row\norange: the chunk's "
            "own keys, seen causally; white: masked", va="center", fontsize=FONT,
            color="#555555")
    return fig


# --- Chapter 5: the prefix cache's hash chain -----------------------------------------------


def hash_chain(prompts: Sequence[Sequence[int]], block_size: int,
               words: Mapping[int, str] | None = None) -> Figure:
    """The prefix cache's keys for ``prompts``: full blocks chained by ``block_key``.

    A block's key hashes its parent's key with its own tokens, so equal keys mean equal
    prefixes: blocks that several prompts share are drawn once, and the chains form a tree.
    A partial last block has no key (it is never cached) and is drawn dashed. ``words`` maps
    token ids to the text shown; by default the ids are.
    """
    def show(tokens):  # a block's tokens on two lines, so that four words fit its box
        shown = [words[t] if words else str(t) for t in tokens]
        half = cdiv(len(shown), 2) if len(shown) > 2 else len(shown)
        return "\n".join(filter(None, (" ".join(shown[:half]), " ".join(shown[half:]))))

    nodes: dict[int, tuple] = {}  # key -> (row, column, parent key, tokens)
    partial = []
    for row, prompt in enumerate(prompts):
        parent = None
        for j in range(0, len(prompt), block_size):
            tokens = tuple(prompt[j:j + block_size])
            if len(tokens) < block_size:
                partial.append((row, j // block_size, parent, tokens))
                break
            key = block_key(parent, tokens)
            nodes.setdefault(key, (row, j // block_size, parent, tokens))
            parent = key
    columns = max(cdiv(len(p), block_size) for p in prompts)
    w = 9.6 / columns
    fig, ax = _canvas(1.0 + 0.85 * len(prompts), (0, 10), (-0.7, len(prompts)))

    BOX_H = 0.74  # three lines of 9 pt: two of words, the key

    def corner(row, col):
        return 0.2 + col * w, len(prompts) - 1 - row + 0.08

    for key, (row, col, parent, tokens) in nodes.items():
        x, y = corner(row, col)
        _box(ax, x, y, w * 0.92, BOX_H, f"{show(tokens)}\n#{key & 0xffff:04x}",
             gid="block", fill="#d0e2f3")
        if parent is not None:
            px, py = corner(*nodes[parent][:2])
            _arrow(ax, (px + w * 0.92, py + BOX_H / 2), (x, y + BOX_H / 2), gid="chain")
    for row, col, parent, tokens in partial:
        x, y = corner(row, col)
        _box(ax, x, y, w * 0.92, BOX_H, f"{show(tokens)}\nno key", gid="partial",
             linestyle="--")
    for row in range(len(prompts)):
        ax.text(0.2, len(prompts) - 1 - row + 0.88, f"prompt {row}", fontsize=FONT,
                color="#555555")
    ax.text(0.2, -0.3, "#key: block_key(parent's key, tokens), last 4 hex digits\n"
            "arrow: from a block to the next block of its chain", fontsize=FONT,
            color="#555555", va="center")
    return fig


# --- Chapter 6: the scheduler's request states ----------------------------------------------

_STATE_XY = {"WAITING": (1.2, 2.2), "RUNNING": (5.0, 2.2), "SWAPPED": (5.0, 0.4),
             "FINISHED": (8.8, 2.2)}
_HALF_W, _HALF_H = 0.8, 0.3  # half a state box


def state_machine(states: Sequence[str], edges: Mapping[tuple[str, str], str]) -> Figure:
    """States as boxes and ``edges`` ``{(from, to): label}`` as labelled arrows.

    The four states of :class:`~pagedlab.engine.sequence.GroupStatus` have fixed places; any
    other state goes on a row below them.
    """
    fig, ax = _canvas(3.0, (0, 10), (-0.6, 3.2))
    where = {}
    for i, state in enumerate(states):
        x, y = _STATE_XY.get(state, (1.6 + 2.5 * i, -0.4))
        where[state] = (x, y)
        _box(ax, x - _HALF_W, y - _HALF_H, 2 * _HALF_W, 2 * _HALF_H, state.lower(), gid="state",
             fill="#d0e2f3", size=FONT + 1)
    for (src, dst), label in edges.items():
        (x0, y0), (x1, y1) = where[src], where[dst]
        back = (dst, src) in edges
        rad = 0.35 if back else 0.0
        dx, dy = x1 - x0, y1 - y0
        # leave and enter the boxes at their sides (horizontal edges) or ends (vertical ones)
        if abs(dx) > abs(dy):
            sx, sy = _HALF_W * math.copysign(1, dx), 0
        else:
            sx, sy = 0, _HALF_H * math.copysign(1, dy)
        start, end = (x0 + sx, y0 + sy), (x1 - sx, y1 - sy)
        _arrow(ax, start, end, gid="transition", rad=rad)
        mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
        # a curved arrow bulges to the right of its direction of travel: label it there
        side = -1 if back else 1
        if abs(dx) > abs(dy):
            nx, ny = 0, (0.45 if back else 0.2) * side * (1 if dx > 0 else -1)
        else:
            nx, ny = (0.3 if back else 0.15) * side * (1 if dy < 0 else -1), 0
        ha = "center" if nx == 0 else ("left" if nx > 0 else "right")
        ax.text(mx + nx, my + ny, label, ha=ha, va="center", fontsize=FONT,
                gid="transition_label")
    return fig


# --- Chapters 1 and 11: what one token caches per layer -------------------------------------


def kv_heads(models: Sequence, max_heads: int = 32) -> Figure:
    """Query heads and what they read from the cache, for MHA, GQA, MQA and MLA models.

    Left: each model's query heads (at most ``max_heads`` drawn, a proportional share of its
    KV heads with them) joined to the KV heads they read, or, for MLA, to the one latent all
    heads share. Right: a bar to scale of the values one token caches per layer.
    """
    models = [get_model(m) for m in models]
    per_layer = [kv_bytes_per_token(m, "fp16") // (2 * m.n_layers) for m in models]  # values
    fig, ax = _canvas(0.5 + 1.05 * len(models), (0, 10), (-0.2, len(models) * 1.05))
    for r, (m, values) in enumerate(zip(models, per_layer)):
        y = (len(models) - 1 - r) * 1.05
        shown = min(m.n_heads, max_heads)
        hw = 4.6 / shown
        drawn = f", {shown} drawn" if shown < m.n_heads else ""
        ax.text(0.0, y + 0.92, f"{m.name} ({m.attention.upper()}, {m.n_heads} query heads{drawn})",
                fontsize=FONT, weight="bold", va="center")
        for i in range(shown):
            _box(ax, 0.2 + i * hw, y + 0.5, hw * 0.8, 0.22, gid="query_head", fill="#d0e2f3",
                 edge="#3b75af")
        if m.attention == "mla":
            c = m.kv_lora_rank / (m.kv_lora_rank + m.qk_rope_head_dim)
            _box(ax, 0.2, y + 0.02, 4.6 * c - 0.05, 0.26, f"latent c ({m.kv_lora_rank})",
                 gid="latent", fill="#fff1c2")
            _box(ax, 0.2 + 4.6 * c, y + 0.02, 4.6 * (1 - c), 0.26, "kᴿ", gid="latent",
                 fill="#fff1c2", size=FONT)
            for i in range(shown):
                ax.plot([0.2 + (i + 0.4) * hw] * 2, [y + 0.5, y + 0.28], color="#bbbbbb", lw=0.6)
        else:
            kv = max(1, m.n_kv_heads * shown // m.n_heads)
            kw = 4.6 / kv
            for g in range(kv):
                _box(ax, 0.2 + g * kw, y + 0.02, kw * 0.9, 0.26, "K V" if kw > 0.5 else "",
                     gid="kv_head", fill="#fde0cf", edge="#e8590c")
                for i in range(g * shown // kv, (g + 1) * shown // kv):
                    ax.plot([0.2 + (i + 0.4) * hw, 0.2 + (g + 0.45) * kw], [y + 0.5, y + 0.28],
                            color="#bbbbbb", lw=0.6)
        length = 4.2 * values / max(per_layer)
        bar = Rectangle((5.4, y + 0.1), length, 0.4, facecolor="#3b75af", gid="cache_bar")
        ax.add_patch(bar)
        beside = length < 2.6  # the label beside a short bar, above a long one
        ax.text(5.4 + length + 0.08 if beside else 5.45, y + 0.3 if beside else y + 0.72,
                f"{values:,} values per token and layer", fontsize=FONT, va="center")
    return fig


# --- Chapter 11: bytes per tensor -----------------------------------------------------------


def traffic_bars(loads: Mapping[str, Mapping[str, int]], unit: int = 1024,
                 unit_name: str = "KiB") -> Figure:
    """Stacked horizontal bars: bytes each kernel (row) loads from each tensor (segment)."""
    tensors = list(dict.fromkeys(t for per in loads.values() for t in per))
    fig, ax = plt.subplots(figsize=(WIDTH, 0.8 + 0.55 * len(loads)), layout="constrained")
    for r, (kernel, per) in enumerate(loads.items()):
        left = 0.0
        for i, tensor in enumerate(tensors):
            width = per.get(tensor, 0) / unit
            bars = ax.barh(r, width, left=left, color=COLORS[i % len(COLORS)],
                           label=tensor if r == 0 else None)
            bars.patches[0].set_gid("segment")
            left += width
    ax.set_yticks(range(len(loads)), list(loads), fontsize=FONT + 1)
    ax.invert_yaxis()
    ax.set_xlabel(f"bytes loaded ({unit_name})", fontsize=FONT + 1)
    ax.tick_params(labelsize=FONT)
    ax.legend(fontsize=FONT, ncols=min(len(tensors), 4), loc="lower center",
              bbox_to_anchor=(0.5, 1.0), frameon=False)
    return fig


# --- Chapter 3: the online softmax's running maximum and rescaled sum -----------------------


def online_sweep(logits, block_sizes: Sequence[int] = (2,)) -> Figure:
    """The online softmax's state after each block of one row of logits, one column per block size.

    Top: the running maximum m after each block, a step line. Bottom, for each block t: the
    running sum l before the block (grey); the same sum times alpha = exp(m_old - m_new) (blue),
    with the block's own terms, the sum of exp(s_j - m_new), stacked on it (orange), so the stack
    is the new l; a dashed line marks the plain softmax denominator, the sum of exp(s_j - max s).
    The states come from :func:`pagedlab.softmax._online_step`, the step ``online_softmax`` takes.
    """
    import torch

    from pagedlab import softmax

    s = torch.as_tensor(logits, dtype=torch.float64).flatten()  # [n]
    denominator = torch.exp(s - s.max()).sum().item()
    fig, axes = plt.subplots(2, len(block_sizes), figsize=(WIDTH, 4.6), sharey="row",
                             squeeze=False, height_ratios=(1, 1.6), layout="constrained")
    for c, block_size in enumerate(block_sizes):
        m, l = s.new_tensor(-math.inf), s.new_tensor(0.0)
        maxima, before, rescaled, terms, alphas = [], [], [], [], []
        for block in s.split(block_size):
            m, l_new, alpha, p = softmax._online_step(m, l, block)
            maxima.append(m.item())
            before.append(l.item())
            rescaled.append((alpha * l).item())
            terms.append(p.sum().item())
            alphas.append(alpha.item())
            l = l_new
        steps = range(1, len(maxima) + 1)
        top, bottom = axes[0, c], axes[1, c]
        top.stairs(maxima, [t - 0.5 for t in steps] + [len(maxima) + 0.5], baseline=None,
                   color=COLORS[3], lw=2, gid="running_max")
        top.set_title(f"blocks of {block_size}", fontsize=FONT + 1)
        top.set_xticks(list(steps), [])
        for t, b, r, p, a in zip(steps, before, rescaled, terms, alphas):
            bottom.bar(t - 0.19, b, 0.34, color="#bbbbbb", label="ℓ before the block"
                       ).patches[0].set_gid("sum_before")
            bottom.bar(t + 0.19, r, 0.34, color=COLORS[0], label="ℓ × α (rescaled)"
                       ).patches[0].set_gid("sum_rescaled")
            bottom.bar(t + 0.19, p, 0.34, bottom=r, color=COLORS[1], label="+ the block's terms"
                       ).patches[0].set_gid("block_terms")
            bottom.text(t + 0.19, r + p + 0.05, f"α={a:.2g}", ha="center", va="bottom",
                        fontsize=FONT, gid="alpha")
        bottom.axhline(denominator, color="#444444", ls="--", lw=1, gid="denominator",
                       label="softmax denominator")
        bottom.set_xticks(list(steps), [str(t) for t in steps], fontsize=FONT)
        bottom.set_xlabel("block t", fontsize=FONT + 1)
        for ax in (top, bottom):
            ax.set_xlim(0.4, len(maxima) + 0.6)
            ax.tick_params(labelsize=FONT)
    axes[0, 0].set_ylabel("running max m", fontsize=FONT + 1)
    axes[1, 0].set_ylabel("running sum ℓ", fontsize=FONT + 1)
    axes[1, 0].set_ylim(0, 1.3 * max(denominator, max(before)))
    handles = dict(zip(*reversed(axes[1, 0].get_legend_handles_labels())))  # label -> artist
    order = ["ℓ before the block", "ℓ × α (rescaled)", "+ the block's terms",
             "softmax denominator"]
    fig.legend([handles[k] for k in order], order, loc="outside lower center", ncols=4,
               fontsize=FONT, frameon=False)
    return fig




# --- Chapter 4: a request's blocks between the free list and its block table ---------------


def free_list_moves(moments: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                    seq_name: str = "the request") -> Figure:
    """The free list and one sequence's block table at a few moments, one row each.

    ``moments`` holds ``(what happened, free list, block table)``. The free list is given
    bottom to top, as the allocator stores it (it pops from the end), and drawn left to right,
    so the top of the stack sits next to the table; the table is drawn in logical order. A block
    that entered the free list or the table since the row above is orange (gid ``moved``), the
    others blue (``free``, ``table``). An arrow shows blocks the table took from the free list
    (gid ``take``) or gave back to it (``give``).
    """
    rows = len(moments)
    most_free = max([len(free) for _, free, _ in moments] + [1])
    most_table = max([len(table) for _, _, table in moments] + [1])
    w = min(0.62, 5.0 / most_free, 3.2 / most_table)  # a box's width
    free_x, table_x, h = 0.2, 6.6, 0.45
    fig, ax = _canvas(0.9 + 0.62 * rows, (0, 10), (-0.9, rows + 0.35))
    ax.text(free_x, rows + 0.1, "free list (bottom ... top of the stack)", fontsize=FONT,
            fontweight="bold", va="center")
    ax.text(table_x, rows + 0.1, f"block table of {seq_name}", fontsize=FONT, fontweight="bold",
            va="center")
    prev_free: set[int] = set()
    prev_table: set[int] = set()
    for r, (what, free, table) in enumerate(moments):
        y = rows - 1 - r  # the row's boxes sit on y, its label above them
        ax.text(free_x, y + 0.66, what, fontsize=FONT, color="#333333", va="center")
        for x0, blocks, gid, before in ((free_x, free, "free", prev_free),
                                        (table_x, table, "table", prev_table)):
            for i, b in enumerate(blocks):
                moved = r > 0 and b not in before
                _box(ax, x0 + i * w, y, w * 0.92, h, str(b), gid="moved" if moved else gid,
                     fill="#fde0cf" if moved else "#d0e2f3", edge="#e8590c" if moved else "#444444")
        if not table:
            ax.text(table_x, y + h / 2, "(no blocks)", fontsize=FONT, color="#777777",
                    va="center")
        if r > 0:
            mid = y + h / 2
            if any(b in prev_free and b not in prev_table for b in table):
                _arrow(ax, (5.5, mid), (6.4, mid), gid="take", color="#e8590c")
            if any(b in prev_table and b not in prev_free for b in free):
                _arrow(ax, (6.4, mid), (5.5, mid), gid="give", color="#e8590c")
        prev_free, prev_table = set(free), set(table)
    ax.text(free_x, -0.5, "orange: arrived since the row above; arrow: blocks taken by the "
            "table (→) or given back (←)", fontsize=FONT, color="#555555", va="center")
    return fig


# --- Chapter 6: scheduler steps -------------------------------------------------------------

_STEP_FILL = {"decode": "#3b75af", "prefill": "#e8590c"}  # the batch's segments
_QUEUE_FILL = {"running": "#d0e2f3", "admitted": "#fde0cf", "swapped_in": "#cfe8cf",
               "waiting": "#ffffff", "swapped": "#e4e4e4"}
_QUEUE_X = {"running": (4.2, 6.1), "waiting": (6.35, 8.6), "swapped": (8.85, 10.0)}


def scheduler_steps(steps: Sequence[Mapping], budget: int, seats: int,
                    num_blocks: int) -> Figure:
    """Scheduler steps, one row each: the batch against the token budget, then the queues
    once the step was formed, with request ids.

    Each step is a mapping with ``step`` (its number), ``prefills`` [(request, tokens)],
    ``decodes`` [request], ``preempted`` [(request, mode)], ``swapped_in`` [request], the
    queues ``running``, ``waiting`` and ``swapped`` [request] and ``used_blocks``. The batch
    is a bar to scale, ``budget`` tokens wide: a segment per prefill and per decode. The
    running queue fills ``seats`` seats (empty ones dashed), coloured by what each request
    does in the step; a request preempted in the step has a red frame in its new queue.
    """
    n = len(steps)
    fig, ax = _canvas(0.75 + 0.72 * n, (0, 10), (-0.6, n + 0.25))
    ax.set_position([0.01, 0.01, 0.98, 0.98])  # the whole figure, with or without a layout
    bar_x, bar_w = 1.35, 2.6
    for x, text in ((0.0, "step"), (bar_x, f"budget: {budget} tokens"),
                    (_QUEUE_X["running"][0], f"running ({seats} seats)"),
                    (_QUEUE_X["waiting"][0], "waiting"), (_QUEUE_X["swapped"][0], "swapped")):
        ax.text(x, n - 0.05, text, fontsize=FONT, weight="bold", va="bottom")
    for r, s in enumerate(steps):
        y = n - 1 - r  # the row's bottom; boxes sit at y + 0.3 .. y + 0.75
        ax.text(0.0, y + 0.62, f"step {s['step']}", fontsize=FONT + 1, va="center")
        ax.text(0.0, y + 0.25, f"{s['used_blocks']}/{num_blocks} blocks", fontsize=FONT,
                va="center", color="#555555")
        frame = Rectangle((bar_x, y + 0.35), bar_w, 0.4, facecolor="#f4f4f4",
                          edgecolor="#999999", lw=0.8, gid="budget")
        ax.add_patch(frame)
        x = bar_x
        batch = [("prefill", rid, k) for rid, k in s["prefills"]]
        batch += [("decode", rid, 1) for rid in s["decodes"]]
        for kind, rid, k in batch:
            w = bar_w * k / budget
            ax.add_patch(Rectangle((x, y + 0.35), w, 0.4, facecolor=_STEP_FILL[kind],
                                   edgecolor="white", lw=0.3, gid=kind))
            if kind == "prefill" and w >= 0.3:
                ax.text(x + w / 2, y + 0.55, str(rid), ha="center", va="center",
                        fontsize=FONT, color="white")
            x += w
        used = sum(k for _, _, k in batch)
        plural = "" if len(s["decodes"]) == 1 else "s"
        ax.text(bar_x, y + 0.12, f"{len(s['decodes'])} decode{plural} + "
                f"{sum(k for _, k in s['prefills'])} prefill = {used} tokens",
                fontsize=FONT, va="center", color="#555555")
        admitted = {rid for rid, _ in s["prefills"]}
        back = set(s["swapped_in"])
        victims = {rid for rid, _ in s["preempted"]}
        for queue in ("running", "waiting", "swapped"):
            ids = list(s[queue])
            x0, x1 = _QUEUE_X[queue]
            slots = max(len(ids), seats if queue == "running" else 1)
            w = min(0.45, (x1 - x0) / slots)
            for i in range(slots):
                bx = x0 + i * w
                if i >= len(ids):  # an empty seat
                    if queue == "running":
                        _box(ax, bx, y + 0.35, w * 0.88, 0.4, gid="seat", fill="none",
                             edge="#aaaaaa", ls="--")
                    continue
                rid = ids[i]
                fill = _QUEUE_FILL["admitted" if rid in admitted and queue == "running" else
                                   "swapped_in" if rid in back else queue]
                _box(ax, bx, y + 0.35, w * 0.88, 0.4, str(rid), gid=queue, fill=fill)
                if rid in victims:
                    ax.add_patch(Rectangle((bx - 0.03, y + 0.32), w * 0.88 + 0.06, 0.46,
                                           facecolor="none", edgecolor="#d62728", lw=2,
                                           gid="victim"))
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=_STEP_FILL["prefill"], label="prefill tokens"),
               Patch(facecolor=_STEP_FILL["decode"], label="decode tokens"),
               Patch(facecolor=_QUEUE_FILL["admitted"], edgecolor="#444444", label="admitted"),
               Patch(facecolor=_QUEUE_FILL["swapped_in"], edgecolor="#444444",
                     label="swapped in"),
               Patch(facecolor="none", edgecolor="#d62728", lw=2, label="preempted")]
    ax.legend(handles=handles, loc="lower center", ncols=5, fontsize=FONT, frameon=False,
              bbox_to_anchor=(0.5, 0.0), handlelength=1.2, columnspacing=1.0)
    return fig


# --- Chapter 14: one request's blocks on every tensor-parallel rank ------------------------


def tensor_parallel_blocks(block_table: Sequence[int], num_tokens: int,
                           cache_shapes: Sequence[Sequence[int]], element_size: int,
                           max_blocks: int = 6) -> Figure:
    """One request's blocks in every rank's cache under tensor parallelism, a row per rank.

    ``block_table`` is the request's table (the one scheduler's, sent to every rank),
    ``num_tokens`` the tokens it holds, ``cache_shapes`` each rank's one-layer cache shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` and ``element_size`` its bytes per
    value. Every row draws the same physical block ids (gid ``block``, at most ``max_blocks``
    of them), each split into the rank's KV heads (gid ``kv_head``), numbered and coloured by
    the model's head: rank r holds the heads after those of ranks 0 to r-1. The filled share of
    each block's slots is shaded. The right column gives each rank's bytes per token and layer.
    """
    shapes = [tuple(int(n) for n in s) for s in cache_shapes]
    if not shapes or any(len(s) != 4 for s in shapes):
        raise ValueError(f"cache_shapes={cache_shapes!r} must be one 4-d shape per rank")
    if len({s[:2] for s in shapes}) != 1:
        raise ValueError("every rank's cache must have the same blocks and block size: "
                         f"{[s[:2] for s in shapes]}")
    num_blocks, block_size = shapes[0][:2]
    if not 0 < num_tokens <= len(block_table) * block_size:
        raise ValueError(f"num_tokens={num_tokens} must fit the table's {len(block_table)} "
                         f"blocks of {block_size}")
    if any(not 0 <= b < num_blocks for b in block_table):
        raise ValueError(f"block_table={list(block_table)} names a block outside "
                         f"0..{num_blocks - 1}")
    world, total_heads = len(shapes), sum(s[2] for s in shapes)
    drawn = list(block_table[:max_blocks])
    left, right, gap = 1.9, 7.5, 0.12
    bw = (right - left) / max(len(drawn), 1)
    fig, ax = _canvas(1.0 + 0.95 * world, (0, 10), (-0.75, world * 0.95 + 0.1))
    first = 0  # the model's index of this rank's first KV head
    for r, (_, _, heads, head_dim) in enumerate(shapes):
        y = (world - 1 - r) * 0.95
        ax.text(0, y + 0.5, f"rank {r}", fontsize=FONT + 1, weight="bold", va="center")
        ax.text(0, y + 0.2, f"[{num_blocks}, {block_size}, {heads}, {head_dim}]", fontsize=FONT,
                va="center", color="#555555")
        for j, b in enumerate(drawn):
            x = left + j * bw
            filled = min(block_size, num_tokens - j * block_size) / block_size
            _box(ax, x, y, bw - gap, 0.72, gid="block", fill="#ffffff")
            ax.text(x + (bw - gap) / 2, y + 0.8, f"block {b}" if bw > 0.9 else str(b),
                    ha="center", va="center",
                    fontsize=FONT, gid="block_id")
            hw = (bw - gap) / heads
            for h in range(heads):
                k = first + h
                strip = Rectangle((x + h * hw + 0.03, y + 0.04), hw - 0.06, 0.64 * filled,
                                  facecolor=COLORS[k % len(COLORS)], alpha=0.75, lw=0)
                strip.set_gid("kv_head")
                ax.add_patch(strip)
                if hw > 0.3:
                    ax.text(x + (h + 0.5) * hw, y + 0.36, f"h{k}", ha="center", va="center",
                            fontsize=FONT, gid="head_label")
        per_token = 2 * heads * head_dim * element_size  # K and V of this rank's heads
        ax.text(right + 0.15, y + 0.5, f"KV heads {first}–{first + heads - 1} of {total_heads}"
                if heads > 1 else f"KV head {first} of {total_heads}", fontsize=FONT,
                va="center")
        ax.text(right + 0.15, y + 0.2, f"{per_token:,} B / token / layer", fontsize=FONT,
                va="center", gid="bytes_per_token")
        first += heads
    more = len(block_table) - len(drawn)
    table = ", ".join(map(str, block_table[:max_blocks])) + (f", … (+{more})" if more else "")
    ax.text(0, -0.3, f"one block table, [{table}], on every rank; {num_tokens} tokens in blocks "
            f"of {block_size} (filled share shaded)", fontsize=FONT, color="#555555",
            va="center")
    ax.text(0, -0.62, "each rank's block b holds only its own KV heads' keys and values "
            "(colour: the model's KV head)", fontsize=FONT, color="#555555", va="center")
    return fig
