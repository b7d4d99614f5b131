"""Block-table views: the replay of a manager's events matches the manager, step by step; the
text summary and the SVG show the manager's blocks, fills and reference counts; the player
steps over every event."""

import random
import re
import xml.etree.ElementTree as ET

import pytest

from pagedlab.memory import Event, KVCacheManager, OutOfBlocks
from pagedlab.viz.block_player import BlockPlayer
from pagedlab.viz.block_replay import event_log, history, parked_blocks, replay
from pagedlab.viz.block_view import BlockView, block_svg

SVG = "{http://www.w3.org/2000/svg}"


def live_state(mgr, running, swapped):
    """What the manager itself says, through its public API, in the snapshot's shape."""
    return (
        {s: tuple(mgr.block_table(s)) for s in running},
        set(swapped),
        {s: mgr.num_tokens(s) for s in [*running, *swapped]},
        [mgr.gpu.refcount(b) for b in range(mgr.num_gpu_blocks)],
        parked_blocks(mgr),
    )


def snapshot_state(snap):
    return snap.tables, set(snap.swapped), snap.num_tokens, snap.refcounts, snap.parked


def random_workload(seed, steps=300, prefix_caching=True):
    """Random calls on a small manager, recording after each call how many events it had
    and the live state then. Prompts start from a few shared prefixes, so the prefix cache
    hits, parks and evicts; failed calls (out of blocks) change nothing and are skipped."""
    rng = random.Random(seed)
    mgr = KVCacheManager(16, 2, num_cpu_blocks=8, enable_prefix_caching=prefix_caching,
                         record_events=True)
    prefixes = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 7, 7]]
    running, swapped, checkpoints, next_id = [], [], [], 0
    for _ in range(steps):
        op = rng.choice(["allocate", "allocate", "append", "append", "append", "fork", "free",
                         "free", "swap_out", "swap_in", "swap_in", "speculate"])
        try:
            if op == "allocate":
                prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(4))]
                mgr.allocate(next_id, prompt)
                running.append(next_id)
                next_id += 1
            elif op == "append" and running:
                mgr.append(rng.choice(running), [rng.randrange(3)] * rng.randint(1, 3))
            elif op == "speculate" and running:  # a verification step: keep a prefix
                seq, k = rng.choice(running), rng.randint(1, 4)
                n = mgr.num_tokens(seq)
                mgr.append(seq, [rng.randrange(3) for _ in range(1 + k)], num_speculative=k)
                mgr.truncate(seq, n + 1 + rng.randint(0, k))
            elif op == "fork" and running:
                mgr.fork(rng.choice(running), next_id)
                running.append(next_id)
                next_id += 1
            elif op == "free" and running + swapped:
                seq = rng.choice(running + swapped)
                mgr.free(seq)
                (running if seq in running else swapped).remove(seq)
            elif op in ("swap_out", "swap_in"):  # a group of one or two sequences
                src, dst = (running, swapped) if op == "swap_out" else (swapped, running)
                group = rng.sample(src, min(len(src), rng.randint(1, 2)))
                can, move = ((mgr.can_swap_out, mgr.swap_out) if op == "swap_out"
                             else (mgr.can_swap_in, mgr.swap_in))
                if group and can(*group):
                    move(*group)
                    for seq in group:
                        src.remove(seq)
                        dst.append(seq)
        except OutOfBlocks:
            pass
        mgr.take_copies()
        checkpoints.append((len(mgr.events), live_state(mgr, running, swapped)))
    mgr.check_invariants()
    return mgr, checkpoints


SEEDS = range(6)


def test_the_workloads_exercise_every_event_kind():
    for prefix_caching in (True, False):
        events = [e for seed in SEEDS for e in random_workload(seed, 300, prefix_caching)[0].events]
        kinds = {"allocate", "append", "fork", "cow", "free", "swap_out", "swap_in", "truncate"}
        assert kinds | ({"evict"} if prefix_caching else set()) == {e.kind for e in events}
        assert any(e.cached_tokens for e in events) == prefix_caching


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_replay_matches_the_manager_after_every_call(seed, prefix_caching):
    mgr, checkpoints = random_workload(seed, prefix_caching=prefix_caching)
    snaps = history(mgr)
    assert len(snaps) == len(mgr.events) + 1 and snaps[0].tables == {}
    for num_events, live in checkpoints:
        assert snapshot_state(snaps[num_events]) == live, f"after {num_events} events"


def test_replay_alone_reproduces_tables_and_refcounts():
    """From the events only (no parked set given), tables and counts are still exact."""
    mgr, _ = random_workload(seed=11, prefix_caching=False)
    final = replay(mgr.events, mgr.num_gpu_blocks, mgr.block_size)[-1]
    for seq, blocks in final.tables.items():
        assert list(blocks) == mgr.block_table(seq)
        assert sum(final.fills(seq)) == mgr.num_tokens(seq)
    assert final.refcounts == [mgr.gpu.refcount(b) for b in range(mgr.num_gpu_blocks)]
    assert final.parked == frozenset()


def shared_prefix_manager():
    """Two samples of one prompt that diverge (copy-on-write), then a freed cached prompt."""
    mgr = KVCacheManager(10, 4, enable_prefix_caching=True, record_events=True)
    mgr.allocate("A", range(10))  # blocks 0, 1 full, block 2 holds 2 tokens
    mgr.fork("A", "B")
    mgr.append("B", [100])  # copy-on-write: B's block 2 becomes 3
    mgr.append("A", [200, 201, 202])  # fills block 2, takes block 4
    mgr.allocate("C", [9, 9, 9, 9, 8])
    mgr.free("C")  # its full block is parked in the prefix cache
    return mgr


def test_summary_lists_each_block_its_fill_and_the_refcounts():
    mgr = shared_prefix_manager()
    assert history(mgr)[-1].summary() == "\n".join([
        "seq A: [0:4/4] [1:4/4] [2:4/4] [4:1/4]",
        "seq B: [0:4/4] [1:4/4] [3:3/4]",
        "pool: 5 of 10 blocks used, 1 cached free, 4 free",
        "refcounts: 0:2 1:2 2:1 3:1 4:1",
        "cached free: 5",
    ])


def test_the_svg_shows_the_managers_blocks_fills_and_users():
    mgr = shared_prefix_manager()
    snaps = history(mgr)
    root = ET.fromstring(block_svg(snaps[-1]))
    texts = [t.text for t in root.iter(f"{SVG}text")]
    for seq in ("A", "B"):  # the row: label, token count, then (L<j>, block, fill) per box
        start = texts.index(f"seq {seq}")
        assert texts[start + 1] == f"{mgr.num_tokens(seq)} tokens"
        blocks = mgr.block_table(seq)
        fills = [min(4, mgr.num_tokens(seq) - 4 * j) for j in range(len(blocks))]
        row = texts[start + 2 : start + 2 + 3 * len(blocks)]
        assert row == [x for j, (b, f) in enumerate(zip(blocks, fills))
                       for x in (f"L{j}", str(b), f"{f}/4")]
    tooltips = [t.text for g in root.iter(f"{SVG}g") for t in g.findall(f"{SVG}title")]
    assert len(tooltips) == mgr.num_gpu_blocks
    for b, tip in enumerate(tooltips):
        users = int(re.match(rf"block {b}: (\d+) users?", tip).group(1))
        assert users == mgr.gpu.refcount(b)
    assert "block 5: 0 users (cached, free)" in tooltips


def test_the_svg_is_an_image_named_by_what_it_shows():
    """A screen reader reads a view as one image named in words (review 2026-12-04, row 10):
    ``role="img"``, and an ``aria-label`` and a first ``<title>`` that give the title, each
    sequence's tokens and blocks, and the pool's counts, all from the snapshot."""
    mgr = shared_prefix_manager()
    last = history(mgr)[-1]
    root = ET.fromstring(block_svg(last, "two samples & a cached prompt"))
    assert root.get("role") == "img"
    label = root.get("aria-label")
    assert root[0].tag == f"{SVG}title" and root[0].text == label
    assert label == (
        "Paged KV cache, two samples & a cached prompt. "
        "seq A: 13 tokens in blocks 0, 1, 2, 4. seq B: 11 tokens in blocks 0, 1, 3. "
        "GPU pool of 10 blocks of 4 tokens: 5 in use (2 shared), 1 cached and free, 4 free. "
        "The event touched blocks 5, 6.")  # C freed: block 5 parked, block 6 free
    # no sequences; a swapped one; rows cut at max_blocks as the picture cuts them
    assert ET.fromstring(block_svg(history(mgr)[0])).get("aria-label") == (
        "Paged KV cache, empty pool. No sequences. "
        "GPU pool of 10 blocks of 4 tokens: 0 in use, 10 free.")
    swap = KVCacheManager(8, 2, num_cpu_blocks=4, record_events=True)
    swap.allocate("x", range(3))
    swap.allocate("long", range(12))
    swap.swap_out("x")
    label = ET.fromstring(block_svg(history(swap)[-1], max_blocks=4)).get("aria-label")
    assert "seq long: 12 tokens in blocks 2, 3, 4, 5 and 2 more." in label
    assert "seq x: swapped out to CPU blocks " in label
    # every snapshot of a random history names itself by its own caption and counts
    random_mgr, _ = random_workload(seed=7)
    for snap in history(random_mgr)[::15]:
        label = ET.fromstring(block_svg(snap)).get("aria-label")
        assert label.startswith(f"Paged KV cache, {snap.caption}.")
        assert f"{sum(r > 0 for r in snap.refcounts)} in use" in label
        for seq in snap.tables:
            assert f"seq {seq}: {snap.num_tokens[seq]} token" in label


def test_the_copy_on_write_snapshot_draws_the_copy():
    snaps = history(shared_prefix_manager())
    cow = next(s for s in snaps if s.event is not None and s.event.kind == "cow")
    assert cow.touched == {2, 3} and cow.tables["B"][-1] == 3 and cow.tables["A"][-1] == 2
    assert "block 2 copied to block 3" in cow.caption
    root = ET.fromstring(block_svg(cow))
    assert "copy" in [t.text for t in root.iter(f"{SVG}text")]
    assert len(list(root.iter(f"{SVG}path"))) == 2  # the arrow and its arrowhead marker


def test_every_snapshot_renders_well_formed_svg_and_a_matching_view():
    mgr, _ = random_workload(seed=3)
    for snap in history(mgr):
        ET.fromstring(block_svg(snap, max_blocks=3))
    view = BlockView(snap, title="final <state> & more")
    assert repr(view) == snap.summary()
    assert "final &lt;state&gt; &amp; more" in view._repr_svg_()
    big = KVCacheManager(4, 32, record_events=True)  # 32 slots drawn as 16 cells
    big.allocate("long", range(40))
    root = ET.fromstring(block_svg(history(big)[-1]))
    assert {"32/32", "8/32"} <= {t.text for t in root.iter(f"{SVG}text")}


def test_every_text_reads_at_9_px_in_the_books_column():
    """The book shows a view at its own width when that fits the 688-px text column, so its
    font sizes are the sizes a reader sees (tests/test_browser.py measures the built pages)."""
    mgr, _ = random_workload(seed=5)
    for snap in history(mgr)[::10]:
        root = ET.fromstring(block_svg(snap))
        assert float(root.get("width")) <= 688
        sizes = {float(t.get("font-size")) for t in root.iter(f"{SVG}text")}
        assert min(sizes) >= 9, snap.caption


def test_the_player_holds_a_frame_per_event_and_shows_one():
    """Every step is pre-rendered, so the page needs no kernel; only the start step shows
    before the script runs, and the script drives the slider, buttons and frames it names."""
    mgr = shared_prefix_manager()
    player = BlockPlayer.of(mgr)
    snaps, n = history(mgr), len(mgr.events)
    assert (player.last, player.step) == (n, n)
    player.show(-5)
    assert player.step == 0
    player.show(3)
    html = player._repr_html_()
    frames = re.findall(r'<div class="pagedlab-frame" data-step="(\d+)"( hidden)?>(.*?)</svg></div></div>',
                        html, re.S)
    assert [int(k) for k, _, _ in frames] == list(range(n + 1))
    assert [k for k, hidden, _ in frames if not hidden] == ["3"]
    assert "step 0 of" in frames[0][2] and "empty pool" in frames[0][2]
    assert "copy-on-write" in frames[3][2] and ">copy<" in frames[3][2]
    for k, _, frame in frames:
        svg = block_svg(snaps[int(k)], colors=player._view["colors"])
        assert frame + "</svg></div>" == player.frame(int(k))
        assert (frame + "</svg>").endswith(svg)  # at its own size, in a box that scrolls
    root = re.search(r'class="pagedlab-player" id="([\w-]+)"', html)[1]
    assert f'getElementById("{root}")' in html and f'max="{n}" value="3"' in html
    assert root != re.search(r'id="([\w-]+)"', BlockPlayer.of(mgr)._repr_html_())[1]
    assert repr(player).startswith("step 3 of") and snaps[3].summary() in repr(player)
    log = event_log(snaps).splitlines()
    assert len(log) == n and log[2] == " 3. " + snaps[3].caption


def test_misuse_is_reported():
    with pytest.raises(ValueError, match="record_events=True"):
        history(KVCacheManager(4, 2))
    with pytest.raises(ValueError, match="unknown event kind 'defrag'"):
        replay([Event("defrag", "a")], 4, 2)
    with pytest.raises(ValueError, match="at least one snapshot"):
        BlockPlayer([])
