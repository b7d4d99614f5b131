"""Paged decode attention in Triton: one program per (sequence, KV head), single pass.

Each program loads the queries of the whole group of heads that share its KV head, then walks
the sequence's tokens a tile at a time: it finds each token's physical slot through the block
table, loads the keys and values once for the whole group, and folds them into an online
softmax (the loop of :func:`pagedlab.softmax.online_attention`), accumulating in fp32.

Design choices, each for a reason a reader can check:

- The token tile (``TILE_TOKENS`` = 32) does not depend on the cache's block size: addresses
  are computed per token, ``block_tables[seq, t // block_size] * block_size + t % block_size``,
  so block sizes 1 to 128 (and any other) run the same code, and ``tl.dot`` never sees a
  dimension below 16, the GPU compiler's minimum for 16-bit inputs.
- The query group goes through ``tl.dot``, padded to 16 rows. A broadcast-and-reduce
  (``sum(q[:, None, :] * k[None], -1)``) would hold a [group, tile, head_dim] product in
  registers; the padded rows of a dot cost tensor-core FLOPs, which a memory-bound decode
  step has to spare.
- Split-KV (flash-decoding): with few sequences and KV heads, (sequence, KV head) programs
  alone leave most SMs idle. Each sequence's tokens are then split; each split writes its
  partial output and log-sum-exp, and a second kernel merges the splits
  (:func:`pagedlab.softmax.merge_attention_states`). :func:`choose_num_splits` decides.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedlab._arith import cdiv
from pagedlab._checks import check_positive
from pagedlab.device import INTERPRET
from pagedlab.kernels.tiles import (
    MIN_DOT,
    TILE_TOKENS,
    check_launchable,
    decode_meta,
    decode_strides,
)
from pagedlab.kernels.validate import check_paged_attention

__all__ = ["paged_attention", "choose_num_splits", "TILE_TOKENS", "MIN_DOT"]

MIN_TOKENS_PER_SPLIT = 256  # a shorter split costs more in its merge than it saves
MAX_SPLITS = 32


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides as key_cache
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [num_seqs]
    out_ptr,  # [num_seqs, num_heads, (num_splits,) head_dim]
    lse_ptr,  # fp32 [num_seqs, num_heads, num_splits], or None without split-KV
    scale,
    stride_q_seq,
    stride_q_head,
    stride_c_block,
    stride_c_token,
    stride_c_head,
    stride_t_seq,
    stride_t_entry,
    stride_o_seq,
    stride_o_head,
    stride_o_split,
    stride_l_seq,
    stride_l_head,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16
    DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two >= 16
    TILE: tl.constexpr,  # tokens per iteration
    DOT_DTYPE: tl.constexpr,  # dtype of tl.dot's operands
    PRECISION: tl.constexpr,  # "ieee" for fp32 operands: no TF32 rounding
    SAVE_LSE: tl.constexpr,  # split-KV: write each split's log-sum-exp too
):
    # >>> grid
    # Grid: (num_seqs, num_kv_heads, num_splits). Program (seq, kv_head, split) handles the query
    # heads kv_head * GROUP ... + GROUP - 1 over this split's share of the sequence's tokens.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # >>> split
    # This split's tokens [start, end): an equal share of seq_len, rounded up to whole tiles.
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE) * TILE
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    # <<< split

    # The group's queries [GROUP_PAD, DIM_PAD]; padding rows and columns load as 0.
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows  # [GROUP_PAD] query heads
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q_ptrs = query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)
    # <<< grid

    # Online-softmax state, fp32: running max m, running sum l, running weighted sum of values.
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)

    table_row = block_tables_ptr + seq * stride_t_seq
    for tile_start in range(start, end, TILE):
        # >>> addresses
        # Logical token positions of this tile; tokens at or past `end` are masked.
        tokens = tile_start + tl.arange(0, TILE)  # [TILE]
        tok_ok = tokens < end
        # Physical address of each token: its block from the table, its slot within the block.
        # Block ids become int64 before the multiply: num_blocks * stride can exceed 2**31.
        entries = table_row + (tokens // BLOCK_SIZE) * stride_t_entry  # [TILE] table entries
        block_ids = tl.load(entries, mask=tok_ok, other=0).to(tl.int64)
        token_offs = block_ids * stride_c_block + (tokens % BLOCK_SIZE) * stride_c_token  # [TILE]
        kv_offs = token_offs[:, None] + kv_head * stride_c_head + dims[None, :]  # [TILE, DIM_PAD]
        # <<< addresses
        # >>> masks
        # Masked loads never touch unused slots: whatever they hold (NaN included) reads as 0.
        kv_ok = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT_DTYPE)
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT_DTYPE)

        # >>> online
        # Logits [GROUP_PAD, TILE] in fp32; masked tokens get -inf, so their weight is exactly 0.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        # <<< masks

        # Online softmax: raise the running max, rescale what was accumulated against the old one.
        m_new = tl.maximum(m, tl.max(s, axis=1))  # [GROUP_PAD], finite: each tile has a token
        alpha = tl.exp(m - m_new)  # [GROUP_PAD], 0 on the first tile (m = -inf)
        p = tl.exp(s - m_new[:, None])  # [GROUP_PAD, TILE]
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m = m_new
        # <<< online

    # Normalise. A split that starts past seq_len saw no token (l = 0, m = -inf, acc = 0):
    # dividing by 1 instead of 0 makes it write out = 0 and lse = -inf, which the merge ignores.
    l_safe = tl.where(l > 0, l, 1.0)  # [GROUP_PAD]
    out = acc / l_safe[:, None]  # [GROUP_PAD, DIM_PAD]
    out_ptrs = out_ptr + seq * stride_o_seq + split * stride_o_split
    out_ptrs += heads[:, None] * stride_o_head + dims[None, :]  # [GROUP_PAD, DIM_PAD]
    out_ok = row_ok[:, None] & dim_ok[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_ok)
    if SAVE_LSE:
        lse = m + tl.log(l_safe)  # [GROUP_PAD], log-sum-exp of this split's logits
        tl.store(lse_ptr + seq * stride_l_seq + heads * stride_l_head + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    parts_ptr,  # fp32 [num_seqs, num_heads, num_splits, head_dim], each split's output
    lse_ptr,  # fp32 [num_seqs, num_heads, num_splits], each split's log-sum-exp
    out_ptr,  # [num_seqs, num_heads, head_dim]
    num_splits,
    stride_p_seq,
    stride_p_head,
    stride_p_split,
    stride_l_seq,
    stride_l_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
):
    # >>> merge
    # Grid: (num_seqs, num_heads). out = sum_s w_s out_s / sum_s w_s, w_s = exp(lse_s - max lse).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_ok = splits < num_splits
    dim_ok = dims < HEAD_DIM

    lse_ptrs = lse_ptr + seq * stride_l_seq + head * stride_l_head + splits
    lse = tl.load(lse_ptrs, mask=split_ok, other=float("-inf"))  # [SPLITS_PAD]
    weight = tl.exp(lse - tl.max(lse, axis=0))  # [SPLITS_PAD]; empty splits (-inf) weigh 0
    part_ptrs = (
        parts_ptr + seq * stride_p_seq + head * stride_p_head + splits[:, None] * stride_p_split
    )
    parts = tl.load(part_ptrs + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.sum(weight, axis=0)  # [DIM_PAD]
    out_ptrs = out_ptr + seq * stride_o_seq + head * stride_o_head + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_ok)
    # <<< merge


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence so that a decode step keeps every SM busy.

    The unsplit grid has num_seqs * num_kv_heads programs. Aim at two programs per SM, so that
    one program's loads overlap another's math: when the grid already reaches that, split
    nothing (a merge pass would only add work). Otherwise split each sequence into enough
    parts, but never into parts shorter than MIN_TOKENS_PER_SPLIT tokens of ``max_context``
    (the longest sequence the block table can hold), and at most MAX_SPLITS.
    """
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms
    if programs >= target:
        return 1
    wanted = cdiv(target, programs)
    return max(1, min(wanted, max_context // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    *,
    scale=None,
    num_splits: int | None = None,
    check_values: bool = True,
):
    """One decode step on the paged cache; same contract as ``reference.paged_attention``.

    ``num_splits`` forces the number of token splits per sequence (1: no split-KV); by default
    :func:`choose_num_splits` picks it on a GPU, and the interpreter, which runs programs one
    after another, never splits. ``check_values=False`` skips the checks that read seq_lens and
    block_tables (a device sync), for callers that built them.
    """
    scale = check_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, check_values=check_values
    )
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_splits is None:
        on_gpu = query.is_cuda and not INTERPRET
        max_context = block_tables.shape[1] * block_size
        num_splits = (
            choose_num_splits(num_seqs, num_kv_heads, max_context, _num_sms(query.device))
            if on_gpu
            else 1
        )
    check_positive("num_splits", num_splits, integer=True)
    check_launchable(query)
    out = query.new_empty(query.shape)  # [num_seqs, num_heads, head_dim]
    if num_seqs == 0:
        return out

    meta = decode_meta(query, key_cache)  # tile sizes, padding, tl.dot dtype: see tiles
    grid = (num_seqs, num_kv_heads, num_splits)
    inputs = (query, key_cache, value_cache, block_tables, seq_lens)
    strides = decode_strides(query, key_cache, block_tables)
    if num_splits == 1:  # write the output directly: no partials, no merge
        out_strides = (*out.stride()[:2], 0, 0, 0)
        _paged_attention_kernel[grid](
            *inputs, out, None, scale, *strides, *out_strides, SAVE_LSE=False, **meta
        )
        return out

    parts = query.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
    lse = query.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    part_strides = (*parts.stride()[:3], *lse.stride()[:2])
    _paged_attention_kernel[grid](
        *inputs, parts, lse, scale, *strides, *part_strides, SAVE_LSE=True, **meta
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        parts,
        lse,
        out,
        num_splits,
        *part_strides,
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        DIM_PAD=meta["DIM_PAD"],
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
    return out
