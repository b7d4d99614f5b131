"""Paged attention for a mixed batch (prefill chunks and decodes) in one Triton kernel.

The decode kernel (:mod:`pagedlab.kernels.decode`) gives each (sequence, KV head) one query
token. Here a sequence brings ``q_len`` new tokens (1 for a decode, a prompt chunk for a
prefill), packed with every other sequence's into ``query [num_tokens, num_heads, head_dim]``.
A program takes a tile of ``TILE_Q`` consecutive query tokens of one sequence and the query
heads of one KV head: ``TILE_Q * GROUP`` rows, row r being token r // GROUP and head r % GROUP
of the group, so that each key and value loaded serves every row (the decode kernel's GQA
packing, with tokens as a second axis). It walks the sequence's cache a tile of keys at a time
as the decode kernel does, up to the position of its last query token, with a causal mask:
the query at position p sees keys 0 ... p.

Which program owns which tile, without reading query_start_loc on the host (a device sync):
sequence i's tiles are numbered from ``query_start_loc[i] // TILE_Q + i``. Those first numbers
increase with i and leave each sequence at least ceil(q_len_i / TILE_Q) numbers, and the
largest is below ``num_tokens // TILE_Q + num_seqs``, the grid's size. A program finds its
sequence by binary search over them; programs numbered past a sequence's last tile exit at
once. vLLM V1's Triton "unified attention" kernel (``triton_unified_attention.py``) numbers
its query blocks the same way.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedlab._checks import check_positive
from pagedlab.kernels.tiles import check_launchable, decode_meta, dot_pad, online_softmax_step
from pagedlab.kernels.varlen_checks import check_paged_attention_varlen

__all__ = ["paged_attention_varlen", "choose_query_tile", "QUERY_ROWS"]

QUERY_ROWS = 64  # rows (query tokens x heads of a group) a program aims at when chunks are present


@triton.jit
def _sequence_of(query_start_loc_ptr, tile_id, num_seqs, TILE_Q: tl.constexpr):
    """The sequence that owns query tile ``tile_id``: the last i whose first tile,
    query_start_loc[i] // TILE_Q + i, is at most tile_id (binary search over i)."""
    lo = tl.full([], 0, tl.int32)  # the answer is in [lo - 1, hi - 1]
    hi = tl.full([], num_seqs, tl.int32)
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // TILE_Q + mid
        after = first_tile <= tile_id
        lo = tl.where(after, mid + 1, lo)
        hi = tl.where(after, hi, mid)
    return lo - 1


@triton.jit
def _varlen_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides as key_cache
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc_ptr,  # int32 [num_seqs + 1], contiguous
    seq_lens_ptr,  # int32 [num_seqs], contiguous
    out_ptr,  # [num_tokens, num_heads, head_dim]
    scale,
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_c_block,
    stride_c_token,
    stride_c_head,
    stride_t_seq,
    stride_t_block,
    stride_o_token,
    stride_o_head,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two >= 16
    TILE_Q: tl.constexpr,  # query tokens per program
    ROWS: tl.constexpr,  # TILE_Q * GROUP rounded up to a power of two >= 16
    TILE: tl.constexpr,  # keys per iteration
    DOT_DTYPE: tl.constexpr,  # dtype of tl.dot's operands
    PRECISION: tl.constexpr,  # "ieee" for fp32 operands: no TF32 rounding
):
    # >>> grid
    # Grid: (num_tokens // TILE_Q + num_seqs, num_kv_heads).
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _sequence_of(query_start_loc_ptr, tile_id, num_seqs, TILE_Q)
    q_start = tl.load(query_start_loc_ptr + seq)  # the sequence's first row of query
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (tile_id - (q_start // TILE_Q + seq)) * TILE_Q  # this tile's first query token
    if first >= q_len:  # a spare tile number: the sequence has fewer tiles
        return
    context = tl.load(seq_lens_ptr + seq) - q_len  # tokens cached before this step's queries
    # <<< grid

    # >>> rows
    # Rows [ROWS]: query token first + r // GROUP of the sequence, query head r % GROUP of the
    # group. Rows past the tile or past the sequence's last token load as 0 and are not stored.
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM_PAD)
    q_tokens = first + rows // GROUP  # [ROWS]
    heads = kv_head * GROUP + rows % GROUP  # [ROWS]
    row_ok = (rows < TILE_Q * GROUP) & (q_tokens < q_len)
    dim_ok = dims < HEAD_DIM
    io_ok = row_ok[:, None] & dim_ok[None, :]  # [ROWS, DIM_PAD]
    packed = (q_start + q_tokens).to(tl.int64)  # [ROWS], row of query and out
    q_ptrs = query_ptr + packed[:, None] * stride_q_token + heads[:, None] * stride_q_head
    q = tl.load(q_ptrs + dims[None, :], mask=io_ok, other=0.0).to(DOT_DTYPE)  # [ROWS, DIM_PAD]
    # <<< rows
    # >>> positions
    # Position of each row's token in its sequence. Rows that are not stored sit past the
    # last key, so every row sees key 0 and no row's softmax is empty.
    positions = context + q_tokens  # [ROWS]
    end = context + tl.minimum(first + TILE_Q, q_len)  # keys 0 ... end - 1 are seen by some row
    # <<< positions

    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_t_seq
    # >>> loop
    for tile_start in range(0, end, TILE):
        keys = tile_start + tl.arange(0, TILE)  # [TILE] key positions
        key_ok = keys < end
        # Physical slot of each key through the block table, as in the decode kernel.
        blocks = tl.load(table_row + (keys // BLOCK_SIZE) * stride_t_block, mask=key_ok, other=0)
        token_offs = blocks.to(tl.int64) * stride_c_block + (keys % BLOCK_SIZE) * stride_c_token
        kv_offs = token_offs[:, None] + kv_head * stride_c_head + dims[None, :]  # [TILE, DIM_PAD]
        kv_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT_DTYPE)
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT_DTYPE)

        # Logits [ROWS, TILE]; the causal mask gives keys after a row's position weight 0.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = key_ok[None, :] & (keys[None, :] <= positions[:, None])
        s = tl.where(visible, s, float("-inf"))
        m, l, acc = online_softmax_step(m, l, acc, s, v, PRECISION)
    # <<< loop

    out = acc / l[:, None]  # [ROWS, DIM_PAD]; l > 0: every row saw key 0
    o_ptrs = out_ptr + packed[:, None] * stride_o_token + heads[:, None] * stride_o_head
    tl.store(o_ptrs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_ok)


def choose_query_tile(num_tokens: int, num_seqs: int, group: int) -> int:
    """Query tokens per program: 1 for a batch of decodes (one token per sequence: the decode
    kernel's tile), else enough tokens to fill ``QUERY_ROWS`` rows with the group's heads,
    so that each key tile loaded serves as many queries as a 64-row ``tl.dot`` holds."""
    if num_tokens <= num_seqs:
        return 1
    return max(1, QUERY_ROWS // group)


def paged_attention_varlen(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    *,
    scale=None,
    query_tile: int | None = None,
    check_values: bool = True,
):
    """Attention for a mixed batch on the paged cache; same contract as
    ``varlen_reference.paged_attention_varlen``.

    query [num_tokens, num_heads, head_dim], the sequences' new tokens packed in order;
    query_start_loc int32 [num_seqs + 1], where each sequence's tokens start; seq_lens int32
    [num_seqs], context lengths including the new tokens (whose K/V are already cached);
    block_tables int32 [num_seqs, max_blocks_per_seq]. Returns [num_tokens, num_heads,
    head_dim]. ``query_tile`` forces the query tokens per program (default:
    :func:`choose_query_tile`); ``check_values=False`` skips the checks that read the offsets,
    lengths and tables (a device sync), for callers that built them.
    """
    scale = check_paged_attention_varlen(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        check_values=check_values,
    )
    num_tokens, num_heads, _ = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if query_tile is None:
        query_tile = choose_query_tile(num_tokens, num_seqs, group)
    check_positive("query_tile", query_tile, integer=True)
    check_launchable(query)
    out = query.new_empty(query.shape)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0:
        return out

    meta = decode_meta(query, key_cache)  # block size, group, padding, tl.dot dtype
    del meta["GROUP_PAD"]  # rows here are tokens x heads: ROWS below
    grid = (num_tokens // query_tile + num_seqs, num_kv_heads)
    _varlen_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale,
        num_seqs,
        *query.stride()[:2],
        *key_cache.stride()[:3],
        *block_tables.stride(),
        *out.stride()[:2],
        TILE_Q=query_tile,
        ROWS=dot_pad(query_tile * group),
        **meta,
    )
    return out
