"""Replay a :class:`KVCacheManager` event trace into snapshots of its block tables (ch. 4-5).

The manager records what it did (``record_events=True``); :func:`replay` rebuilds from those
events alone the state after each one: every sequence's block table, its token count, and
the GPU pool's reference counts. The views in :mod:`pagedlab.viz.block_view` and the player
in :mod:`pagedlab.viz.block_player` draw these snapshots.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from pagedlab._arith import cdiv
from pagedlab.memory import Event, KVCacheManager


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The manager's state after ``event`` (None: the empty pool before any event).

    ``tables`` maps each running sequence to its GPU blocks, ``swapped`` each swapped-out one
    to its CPU blocks; ``parked`` holds the GPU blocks that have no user but keep cached
    prefix contents (free capacity that a prefix hit can revive). ``touched`` holds the GPU
    blocks the event took, shared, copied, released or evicted; ``caption`` says what it did.
    """

    num_blocks: int
    block_size: int
    tables: dict[Hashable, tuple[int, ...]]
    swapped: dict[Hashable, tuple[int, ...]]
    num_tokens: dict[Hashable, int]
    parked: frozenset[int]
    event: Event | None = None
    touched: frozenset[int] = frozenset()
    caption: str = "empty pool"

    @property
    def refcounts(self) -> list[int]:
        """Users of each GPU block: the number of block-table entries pointing at it."""
        entries = Counter(b for blocks in self.tables.values() for b in blocks)
        return [entries[b] for b in range(self.num_blocks)]

    def fills(self, seq_id: Hashable) -> list[int]:
        """Tokens in each logical block of ``seq_id``: full blocks, then a partial last one."""
        n, bs = self.num_tokens[seq_id], self.block_size
        return [min(bs, n - i * bs) for i in range(cdiv(n, bs))]

    def summary(self) -> str:
        """Compact text: one line per sequence ``[block:fill/size] ...``, then the pool."""
        refs, bs = self.refcounts, self.block_size
        lines = []
        for where, tables in (("", self.tables), (" (swapped out, CPU blocks)", self.swapped)):
            for seq_id, blocks in tables.items():
                cells = " ".join(f"[{b}:{f}/{bs}]" for b, f in zip(blocks, self.fills(seq_id)))
                lines.append(f"seq {seq_id}{where}: {cells}")
        used = sum(r > 0 for r in refs)
        lines.append(f"pool: {used} of {self.num_blocks} blocks used, {len(self.parked)} cached "
                     f"free, {self.num_blocks - used - len(self.parked)} free")
        lines.append("refcounts: " + (" ".join(f"{b}:{r}" for b, r in enumerate(refs) if r)
                                      or "none"))
        if self.parked:
            lines.append("cached free: " + " ".join(map(str, sorted(self.parked))))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()


def _blocks(blocks: Sequence[int]) -> str:
    return f"block{'s' * (len(blocks) != 1)} {', '.join(map(str, blocks))}"


def caption(event: Event, swapped: bool = False) -> str:
    """One line saying what ``event`` did; ``swapped``: a freed sequence was on the CPU."""
    kind, seq, blocks = event.kind, event.seq_id, _blocks(event.blocks)
    if kind == "allocate":
        text = f"allocate seq {seq}: {event.num_tokens} prompt tokens in {blocks}"
        if event.cached_tokens:
            text += f" ({event.cached_tokens} tokens from the prefix cache)"
        return text
    if kind == "append":
        text = f"append {event.num_tokens} token{'s' * (event.num_tokens != 1)} to seq {seq}"
        if event.blocks:
            text += f", overflowing into new {blocks}"
        return text
    if kind == "fork":
        return f"fork seq {seq} from seq {event.parent}: share {blocks}"
    if kind == "cow":
        (src, dst), = event.pairs
        return f"copy-on-write for seq {seq}: shared partial block {src} copied to block {dst}"
    if kind == "free":
        return f"free seq {seq}: release {'CPU' if swapped else 'GPU'} {blocks}"
    if kind == "truncate":
        n = event.num_tokens
        text = f"roll back seq {seq}: {n} rejected token{'s' * (n != 1)}"
        return text + (f", release {blocks}" if event.blocks else "")
    if kind == "evict":
        return f"evict cached {blocks} (least recently used)"
    if kind in ("swap_out", "swap_in"):
        src, dst = ("GPU", "CPU") if kind == "swap_out" else ("CPU", "GPU")
        pairs = ", ".join(f"{a}->{b}" for a, b in event.pairs)
        return f"{kind.replace('_', ' ')} seq {seq}: {src} -> {dst} blocks {pairs}"
    raise ValueError(f"unknown event kind {kind!r}")


def _parked_fates(events: Sequence[Event], block_size: int, parked_at_end: Iterable[int]):
    """For each step ``i`` (after ``i`` events): the blocks that, if unused then, are parked.

    Events do not say whether a released block was parked or freed, but its next taking
    does: an eviction or a prefix hit means it was parked, a fresh allocation that it was
    free. Scanning backwards carries each block's next fate to the steps before it;
    ``parked_at_end`` settles the blocks never taken again.
    """
    parked = set(parked_at_end)
    fates = [frozenset(parked)]
    for e in reversed(events):
        if e.kind == "evict":
            parked.update(e.blocks)
        elif e.kind == "allocate":
            hits = e.cached_tokens // block_size
            parked.update(e.blocks[:hits])
            parked.difference_update(e.blocks[hits:])
        elif e.kind in ("append", "swap_in"):
            parked.difference_update(e.blocks)
        elif e.kind == "cow":
            parked.discard(e.pairs[0][1])
        fates.append(frozenset(parked))
    return fates[::-1]


def replay(
    events: Sequence[Event], num_blocks: int, block_size: int, parked_at_end: Iterable[int] = ()
) -> list[Snapshot]:
    """Snapshots of the state before any event and after each one: ``len(events) + 1``.

    Built from the events only, so it checks the manager independently. ``parked_at_end``
    names the blocks parked after the last event (see :func:`history`).
    """
    tables: dict[Hashable, tuple[int, ...]] = {}
    swapped: dict[Hashable, tuple[int, ...]] = {}
    tokens: dict[Hashable, int] = {}
    fates = _parked_fates(events, block_size, parked_at_end)

    def snapshot(i, event=None, touched=(), text="empty pool"):
        refs = Counter(b for blocks in tables.values() for b in blocks)
        parked = frozenset(b for b in fates[i] if not refs[b])
        return Snapshot(num_blocks, block_size, dict(tables), dict(swapped), dict(tokens),
                        parked, event, frozenset(touched), text)

    snapshots = [snapshot(0)]
    for i, e in enumerate(events, start=1):
        seq, kind = e.seq_id, e.kind
        text = caption(e, swapped=seq in swapped)
        touched = () if kind == "free" and seq in swapped else e.blocks  # GPU blocks only
        if kind in ("allocate", "fork"):
            tables[seq], tokens[seq] = e.blocks, e.num_tokens
        elif kind == "append":
            tables[seq] += e.blocks
            tokens[seq] += e.num_tokens
        elif kind == "cow":
            (src, dst), = e.pairs
            if tables[seq][-1] != src:
                raise ValueError(f"event {i}: seq {seq} copies block {src}, not its last block")
            tables[seq] = (*tables[seq][:-1], dst)
            touched = (src, dst)
        elif kind == "truncate":
            tables[seq] = tables[seq][: len(tables[seq]) - len(e.blocks)]
            tokens[seq] -= e.num_tokens
        elif kind == "free":
            (tables if seq in tables else swapped).pop(seq)
            del tokens[seq]
        elif kind == "swap_out":
            touched = tables.pop(seq)
            swapped[seq] = e.blocks
        elif kind == "swap_in":
            del swapped[seq]
            tables[seq] = e.blocks
        # An eviction changes no table; caption() has rejected unknown kinds.
        snapshots.append(snapshot(i, e, touched, text))
    return snapshots


def event_log(snapshots: Sequence[Snapshot]) -> str:
    """The history as text, one numbered caption per event: a player's steps 1, 2, ..."""
    return "\n".join(f"{step:2}. {snap.caption}" for step, snap in enumerate(snapshots[1:], 1))


def parked_blocks(mgr: KVCacheManager) -> frozenset[int]:
    """GPU blocks of ``mgr`` that are cached by the prefix cache but have no user now."""
    cache = mgr.prefix_cache
    if cache is None:
        return frozenset()
    return frozenset(b for b in range(mgr.num_gpu_blocks)
                     if mgr.gpu.refcount(b) == 0 and cache.tokens_of(b) is not None)


def history(mgr: KVCacheManager) -> list[Snapshot]:
    """The snapshots of ``mgr``'s recorded events (it must be built with ``record_events``)."""
    if mgr.events is None:
        raise ValueError("the manager records no events: build it with record_events=True")
    return replay(mgr.events, mgr.num_gpu_blocks, mgr.block_size, parked_blocks(mgr))
