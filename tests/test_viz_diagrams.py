"""The chapters' diagrams show what their data says: as many blocks, programs, tiles, splits,
states and heads as the inputs hold, labelled with the inputs' own numbers."""

import dataclasses
import math
import warnings

import matplotlib
import matplotlib.text
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pagedlab.engine.sequence import GroupStatus  # noqa: E402
from pagedlab.footprint import get_model, kv_bytes_per_token  # noqa: E402
from pagedlab.viz import diagrams as D  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(fig, gid=None):
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text)
            if gid is None or t.get_gid() == gid]


def test_cache_layout_draws_each_dimension_and_its_stride():
    cache = torch.empty(1024, 16, 8, 128, dtype=torch.bfloat16, device="meta")
    fig = D.cache_layout(cache)
    for gid, n in zip(("block", "slot", "head", "value"), cache.shape):
        assert len(D.artists(fig, gid)) == min(n, D.MAX_CELLS), gid
    for tier, stride in enumerate(cache.stride()):
        (label,) = texts(fig, f"stride{tier}")
        assert f"stride {stride:,} el." in label
    assert "32 KiB" in texts(fig, "stride0")[0]  # 16 * 8 * 128 values of 2 bytes
    assert fig.get_size_inches()[0] == pytest.approx(7)


@pytest.mark.parametrize("seq_len,num_splits,tile", [(1, 4, 32), (100, 3, 32), (64, 2, 32),
                                                      (300, 8, 16), (33, 1, 32)])
def test_split_ranges_partition_the_tokens_on_tile_boundaries(seq_len, num_splits, tile):
    ranges = D.split_ranges(seq_len, num_splits, tile)
    assert len(ranges) == num_splits
    covered = [t for start, end in ranges for t in range(start, end)]
    assert covered == list(range(seq_len))  # in order, each token once
    assert all(start % tile == 0 for start, _ in ranges)
    # every non-empty split but the last holds the same whole number of tiles
    lengths = [end - start for start, end in ranges if end > start]
    assert len(set(lengths[:-1])) <= 1 and lengths[0] >= lengths[-1]


def test_decode_grid_draws_every_program_tile_and_block_of_the_table():
    seq_lens, block_size, heads, splits, tile = [40, 100, 9], 16, 2, 2, 32
    tables = [[3, 7, 1, 0, 0, 0, 0], [5, 2, 9, 4, 11, 6, 8], [10, 0, 0, 0, 0, 0, 0]]
    fig = D.decode_grid(seq_lens, tables, block_size, heads, splits, tile)
    assert len(D.artists(fig, "program")) == len(seq_lens) * heads * splits
    blocks = D.artists(fig, "block")
    used = [tables[s][j] for s, n in enumerate(seq_lens) for j in range(-(-n // block_size))]
    assert len(blocks) == heads * len(used)
    tiles = sum(-(-(end - start) // tile) for n in seq_lens
                for start, end in D.split_ranges(n, splits, tile) if end > start)
    assert len(D.artists(fig, "tile")) == heads * tiles
    assert sum(r.get_width() for r in D.artists(fig, "tile")) == heads * sum(seq_lens)
    # each block at least half full is labelled with its physical id from the table
    labelled = [tables[s][j] for s, n in enumerate(seq_lens) for j in range(-(-n // block_size))
                if 2 * min(block_size, n - j * block_size) >= block_size]
    assert sorted(int(t) for t in texts(fig) if t.isdigit()) == sorted(heads * labelled)


def test_split_merge_weights_are_the_softmax_of_the_log_sum_exps():
    lse = [3.1, 4.2, 2.0, -math.inf]
    fig = D.split_merge([(0, 64), (64, 128), (128, 150), (150, 150)], lse)
    assert len(D.artists(fig, "split")) == len(lse)
    weights = [float(t.split("=")[1]) for t in texts(fig, "weight")]
    expected = torch.softmax(torch.tensor(lse), 0).tolist()
    assert weights == pytest.approx(expected, abs=0.005)
    assert weights[-1] == 0.0
    total = torch.logsumexp(torch.tensor(lse), 0).item()
    assert f"lse = {total:.2f}" in next(t for t in texts(fig) if t.startswith("merge"))


def test_hash_chain_draws_each_distinct_prefix_block_once():
    # the last prompt's second block holds the first prompt's first tokens, after another prefix
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 9, 9, 1, 2],
               [1, 2, 3, 4, 7, 7, 7, 7], [7, 7, 7, 1, 2, 3]]
    bs = 3
    fig = D.hash_chain(prompts, bs)
    prefixes = {tuple(p[:k]) for p in prompts for k in range(bs, len(p) + 1, bs)}
    assert len(D.artists(fig, "block")) == len(prefixes)  # shared prefixes drawn once
    assert len(D.artists(fig, "partial")) == sum(len(p) % bs > 0 for p in prompts)
    # every block but a chain's first has an arrow from its parent
    assert len(D.artists(fig, "chain")) == len(prefixes) - len({tuple(p[:bs]) for p in prompts})
    # each block is labelled with its own tokens
    drawn = sorted(" ".join(t.split("\n")[:-1]) for t in texts(fig) if "\n#" in t)
    assert drawn == sorted(" ".join(map(str, p[-bs:])) for p in prefixes)


def test_hash_chain_text_fits_its_boxes():
    """Chapter 5's blocks of four words, the longest it draws ("helpful and brief assistant")."""
    from matplotlib.patches import Rectangle

    text = ["You are a helpful and brief assistant . What is paging ?",
            "You are a helpful and brief assistant . What is a block table ?",
            "Answer in one word What is paging ?"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(" ".join(text).split()))}
    prompts = [[vocab[w] for w in t.split()] for t in text]
    fig = D.hash_chain(prompts, 4, words={i: w for w, i in vocab.items()})
    fig.canvas.draw()
    boxes = [r.get_window_extent() for r in fig.findobj(Rectangle)
             if r.get_gid() in ("block", "partial")]
    labels = [t for t in fig.findobj(matplotlib.text.Text) if "\n" in t.get_text()
              and t.get_text().splitlines()[-1].startswith(("#", "no key"))]
    assert len(labels) == len(boxes) == 7  # two blocks shared, one partial
    for label in labels:
        extent = label.get_window_extent()
        box = next(b for b in boxes if b.contains(*extent.get_points().mean(axis=0)))
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 \
            and extent.y1 <= box.y1, f"{label.get_text()!r} leaves its box"
    plt.close(fig)


def test_state_machine_draws_every_state_and_labelled_transition():
    states = [s.name for s in GroupStatus]
    edges = {("WAITING", "RUNNING"): "admit ×3", ("RUNNING", "WAITING"): "recompute ×1",
             ("RUNNING", "FINISHED"): "finish ×2"}
    fig = D.state_machine(states, edges)
    assert sorted(t for t in texts(fig) if t.upper() in states) == sorted(s.lower() for s in states)
    assert len(D.artists(fig, "state")) == len(states)
    assert len(D.artists(fig, "transition")) == len(edges)
    assert sorted(texts(fig, "transition_label")) == sorted(edges.values())


def test_kv_heads_bars_scale_with_the_values_a_token_caches_per_layer():
    llama2 = get_model("Llama-2-7B")
    mqa = dataclasses.replace(llama2, name="MQA", n_kv_heads=1, attention="mqa")
    models = [llama2, get_model("Llama-3-8B"), mqa, get_model("DeepSeek-V3")]
    fig = D.kv_heads(models)
    bars = [b.get_width() for b in D.artists(fig, "cache_bar")]
    per_layer = [kv_bytes_per_token(m) / m.n_layers for m in models]
    assert [b / bars[0] for b in bars] == pytest.approx([v / per_layer[0] for v in per_layer])
    assert len(D.artists(fig, "query_head")) == sum(min(m.n_heads, 32) for m in models)
    assert len(D.artists(fig, "kv_head")) == 32 + 8 + 1  # MHA, GQA-8, MQA; MLA has none
    assert len(D.artists(fig, "latent")) == 2  # the latent and the RoPE key


def test_traffic_bars_segments_are_the_bytes():
    loads = {"one": {"key": 2048, "value": 2048}, "two": {"key": 4096, "value": 2048, "x": 512}}
    fig = D.traffic_bars(loads)
    widths = [r.get_width() for r in D.artists(fig, "segment")]
    assert widths == [2, 2, 0, 4, 2, 0.5]


def test_traffic_bars_warn_nothing_under_the_books_style():
    """The book's style lays figures out with constrained layout; a helper that asks for tight
    layout on top makes matplotlib print a UserWarning above the figure in the book."""
    from pagedlab.viz import style

    with matplotlib.rc_context(), warnings.catch_warnings():
        style.use()
        warnings.simplefilter("error")
        D.traffic_bars({"one": {"key": 2048, "value": 2048}})


@pytest.mark.parametrize("query_lens,tile_q", [([1, 1, 37, 1, 20], 8), ([5], 16), ([16, 16], 16),
                                               ([1, 1, 1], 1), ([3, 30, 2, 9], 4)])
def test_varlen_tiles_draws_the_kernels_grid_and_each_tile_once(query_lens, tile_q):
    """As many programs as the kernel launches; one per query tile, the rest spare; the tiles
    cover the packed tokens exactly."""
    fig = D.varlen_tiles(query_lens, tile_q)
    grid = sum(query_lens) // tile_q + len(query_lens)
    tiles = sum(-(-n // tile_q) for n in query_lens)
    assert len(D.artists(fig, "program")) == tiles == len(D.artists(fig, "assignment"))
    assert len(D.artists(fig, "spare")) == grid - tiles
    assert sum(r.get_width() for r in D.artists(fig, "tile")) == sum(query_lens)
    # each program's number is the kernel's: the tile numbering starts at start // tile_q + i
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    numbers = sorted(start // tile_q + i + k
                     for i, (start, n) in enumerate(zip(starts, query_lens))
                     for k in range(-(-n // tile_q)))
    drawn = sorted(round(r.get_x() / (sum(query_lens) / grid)) for r in D.artists(fig, "program"))
    assert drawn == numbers


@pytest.mark.parametrize("cached,chunk,block_size", [(12, 6, 4), (0, 5, 4), (7, 1, 16)])
def test_chunk_mask_shows_every_cached_key_and_the_chunk_causally(cached, chunk, block_size):
    fig = D.chunk_mask(cached, chunk, block_size)
    visible, mask = len(D.artists(fig, "visible")), len(D.artists(fig, "masked"))
    assert visible == chunk * cached + chunk * (chunk + 1) // 2
    assert visible + mask == chunk * (cached + chunk)
    expected = torch.ones(chunk, cached + chunk).tril(cached).sum().item()  # key k <= cached + j
    assert visible == expected
    assert len(D.artists(fig, "block_edge")) == (cached + chunk) // block_size + 1


@pytest.mark.parametrize("logits,block_sizes", [([1.0, 2.0, 3.0, 0.0], (2, 1)),
                                                ([0.5, -1.0, 4.0, 2.0, 4.5], (2,)),
                                                ([3.0, 2.0, 1.0], (1, 3))])
def test_online_sweep_draws_each_blocks_state_and_the_rescaling(logits, block_sizes):
    """One step of the maximum and one set of bars per block; the blue bar is the old sum times
    exp(m_old - m_new), and the last stack reaches the plain softmax denominator."""
    fig = D.online_sweep(torch.tensor(logits), block_sizes)
    s = torch.tensor(logits, dtype=torch.float64)
    denominator = torch.exp(s - s.max()).sum().item()
    steps = [math.ceil(len(logits) / b) for b in block_sizes]
    lines = D.artists(fig, "running_max")
    assert len(lines) == len(block_sizes)
    before, rescaled, terms = (D.artists(fig, g) for g in ("sum_before", "sum_rescaled",
                                                             "block_terms"))
    assert len(before) == len(rescaled) == len(terms) == len(D.artists(fig, "alpha")) == sum(steps)
    first = 0
    for line, b, T in zip(lines, block_sizes, steps):
        blocks = [logits[i:i + b] for i in range(0, len(logits), b)]
        maxima = [max(x for blk in blocks[:t + 1] for x in blk) for t in range(T)]
        assert line.get_data().values.tolist() == pytest.approx(maxima)
        l_old, m_old = 0.0, -math.inf
        for t in range(T):
            i = first + t
            assert before[i].get_height() == pytest.approx(l_old)
            assert rescaled[i].get_height() == pytest.approx(l_old * math.exp(m_old - maxima[t]))
            assert terms[i].get_y() == pytest.approx(rescaled[i].get_height())
            l_old = terms[i].get_y() + terms[i].get_height()  # the new l, the stack's top
            assert l_old == pytest.approx(sum(math.exp(x - maxima[t])
                                              for blk in blocks[:t + 1] for x in blk))
            m_old = maxima[t]
        assert l_old == pytest.approx(denominator)
        first += T
    dashed = D.artists(fig, "denominator")  # one per block size
    assert [d.get_ydata()[0] for d in dashed] == pytest.approx([denominator] * len(block_sizes))
    from pagedlab.viz import style
    assert style.overlapping_text(fig) == [] and style.small_text(fig) == []
    assert fig.get_size_inches()[0] == pytest.approx(7)


def test_free_list_moves_draws_each_moment_and_the_blocks_that_moved():
    """Chapter 4's request: a row per moment, a box per block in the free list and the table,
    orange for the blocks that arrived since the row above, an arrow for each hand-over."""
    from pagedlab.memory import KVCacheManager
    from pagedlab.viz import style

    mgr = KVCacheManager(num_gpu_blocks=12, block_size=4)
    moments = []  # (what happened, free list bottom to top, block table)

    def moment(what):
        table = mgr.block_table("seed") if "seed" in mgr else []
        moments.append((what, mgr.gpu._free.copy(), table))

    mgr.allocate("a", range(8))
    mgr.allocate("b", range(5))
    moment("a and b running")
    mgr.free("a")
    moment("a finishes")
    mgr.allocate("seed", range(7))
    moment("prefill")
    mgr.append("seed", [0])
    moment("fills the last block")
    mgr.append("seed", [0])
    moment("takes a block")
    mgr.free("seed")
    moment("completion")
    with matplotlib.rc_context():
        style.use()
        fig = D.free_list_moves(moments, "seed")
        assert style.overlapping_text(fig) == [] and style.small_text(fig) == []
    moved = free = table = 0
    prev_fl, prev_tb = set(), set()
    for r, (_, fl, tb) in enumerate(moments):
        new_fl = [b for b in fl if r > 0 and b not in prev_fl]
        new_tb = [b for b in tb if r > 0 and b not in prev_tb]
        moved += len(new_fl) + len(new_tb)
        free += len(fl) - len(new_fl)
        table += len(tb) - len(new_tb)
        prev_fl, prev_tb = set(fl), set(tb)
    assert len(D.artists(fig, "moved")) == moved > 0
    assert len(D.artists(fig, "free")) == free and len(D.artists(fig, "table")) == table
    # the boxes carry the block ids, row by row, free list then table, in the data's order
    drawn = [t for t in texts(fig) if t.isdigit()]
    assert drawn == [str(b) for _, fl, tb in moments for b in [*fl, *tb]]
    # one hand-over to the table at prefill and at the overflow, one back at completion
    assert len(D.artists(fig, "take")) == 2 and len(D.artists(fig, "give")) == 1
    assert [t for t in texts(fig) if t in [m[0] for m in moments]] == [m[0] for m in moments]


def _step(number, prefills=(), decodes=(), preempted=(), swapped_in=(), running=(), waiting=(),
          swapped=(), used_blocks=0):
    return dict(step=number, prefills=list(prefills), decodes=list(decodes),
                preempted=list(preempted), swapped_in=list(swapped_in), running=list(running),
                waiting=list(waiting), swapped=list(swapped), used_blocks=used_blocks)


def test_scheduler_steps_draws_each_batch_to_scale_and_each_queue_by_id():
    """A bar segment per prefill (its tokens wide) and per decode (one token wide) against
    the budget; every queued request once, with its id; empty seats; victims framed."""
    from pagedlab.viz import style

    budget, seats = 64, 4
    steps = [
        _step(5, prefills=[(5, 11)], decodes=[1, 2, 4], running=[1, 2, 4, 5],
              waiting=[6, 7, 8, 9, 10, 11], used_blocks=19),
        _step(6, decodes=[1, 2, 4], preempted=[(5, "swap")], running=[1, 2, 4],
              waiting=[6, 7, 8, 9, 10, 11], swapped=[5], used_blocks=18),
        _step(8, prefills=[(6, 11)], decodes=[1, 4, 5], swapped_in=[5], running=[1, 4, 5, 6],
              waiting=[7, 8, 9, 10, 11], used_blocks=18),
        _step(9, prefills=[(7, 40), (8, 9)], decodes=[4], preempted=[(6, "recompute")],
              running=[4, 7, 8], waiting=[6, 9], used_blocks=20),
    ]
    fig = D.scheduler_steps(steps, budget, seats, num_blocks=20)
    bar = D.artists(fig, "budget")
    assert len(bar) == len(steps)
    unit = bar[0].get_width() / budget  # the width of one token
    prefills = D.artists(fig, "prefill")
    assert [round(r.get_width() / unit) for r in prefills] == [
        k for s in steps for _, k in s["prefills"]]
    decodes = D.artists(fig, "decode")
    assert len(decodes) == sum(len(s["decodes"]) for s in steps)
    assert all(r.get_width() == pytest.approx(unit) for r in decodes)
    for queue in ("running", "waiting", "swapped"):
        boxes = D.artists(fig, queue)
        assert len(boxes) == sum(len(s[queue]) for s in steps), queue
    labels = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    for s in steps:
        assert f"step {s['step']}" in labels and f"{s['used_blocks']}/20 blocks" in labels
        for queue in ("running", "waiting", "swapped"):
            assert all(str(rid) in labels for rid in s[queue])
    assert len(D.artists(fig, "seat")) == sum(seats - len(s["running"]) for s in steps)
    assert len(D.artists(fig, "victim")) == sum(len(s["preempted"]) for s in steps)
    assert style.overlapping_text(fig) == []
    assert fig.get_size_inches()[0] == pytest.approx(7)


@pytest.mark.parametrize("table, tokens, shapes", [
    ([7, 2, 11], 37, [(64, 16, 1, 64)] * 3),  # SmolLM2 at 3 ranks: one KV head each
    ([5, 0, 9, 3, 1, 4, 8, 2], 120, [(10, 16, 2, 128)] * 4),  # more blocks than drawn
])
def test_tensor_parallel_blocks_draws_the_same_ids_on_every_rank_each_with_its_own_heads(
        table, tokens, shapes):
    fig = D.tensor_parallel_blocks(table, tokens, shapes, element_size=2)
    world, drawn = len(shapes), table[:6]
    assert len(D.artists(fig, "block")) == world * len(drawn)
    ids = texts(fig, "block_id")
    assert [int(t.split()[-1]) for t in ids] == drawn * world  # the same ids, row after row
    heads = [s[2] for s in shapes]
    strips = D.artists(fig, "kv_head")
    assert len(strips) == len(drawn) * sum(heads)
    labels = texts(fig, "head_label")
    per_rank = [labels[i * len(drawn) * h:(i + 1) * len(drawn) * h] for i, h in enumerate(heads)]
    owned = [set(rank) for rank in per_rank]
    assert all(len(o) == h for o, h in zip(owned, heads))  # each rank: its own heads only
    assert set.union(*owned) == {f"h{k}" for k in range(sum(heads))}  # together, all of them
    assert sum(map(len, owned)) == sum(heads)  # and no head on two ranks
    # the last block's strips are shaded by its filled share, the others full
    last = min(len(table), 6) - 1
    full = max(s.get_height() for s in strips)
    share = (tokens - last * shapes[0][1]) / shapes[0][1] if len(table) <= 6 else 1
    assert strips[last * heads[0]].get_height() == pytest.approx(full * share)
    for label, (_, _, h, d) in zip(texts(fig, "bytes_per_token"), shapes):
        assert label.startswith(f"{2 * h * d * 2:,} B")
    assert fig.get_size_inches()[0] == pytest.approx(7)


def test_tensor_parallel_blocks_refuses_ranks_that_disagree():
    with pytest.raises(ValueError, match="same blocks"):
        D.tensor_parallel_blocks([0], 4, [(8, 16, 1, 64), (9, 16, 1, 64)], 2)
    with pytest.raises(ValueError, match="outside"):
        D.tensor_parallel_blocks([8], 4, [(8, 16, 1, 64)], 2)
    with pytest.raises(ValueError, match="num_tokens"):
        D.tensor_parallel_blocks([1], 17, [(8, 16, 1, 64)], 2)
