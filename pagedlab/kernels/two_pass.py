"""Paged decode attention in two passes over the KV blocks: the shape of vLLM's original kernel.

Pass 1 walks a sequence's blocks for the logits and finds their max and sum; pass 2 walks the
blocks again, weights each value by exp(logit - max) / sum and adds it up. Pass 2 needs the
logits again, and there are two ways to have them:

- ``logits="recompute"``: read the keys a second time and recompute q·k. The key cache is
  then read twice and the value cache once.
- ``logits="scratch"``: pass 1 writes the fp32 logits to a scratch buffer and pass 2 reads
  them back. Keys and values are read once each, plus 8 bytes per (token, query head) of scratch
  traffic. vLLM's CUDA kernel kept this buffer in shared memory, sized by the longest context;
  Triton has no shared arrays of run-time size, so here it lives in global memory.

The single-pass kernel (:mod:`pagedlab.kernels.decode`) needs neither: its online softmax
rescales what it has accumulated whenever the max grows. :mod:`pagedlab.kernels.traffic` counts
the bytes each variant loads. No split-KV here: one program per (sequence, KV head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.kernels.tiles import (
    check_launchable,
    decode_meta,
    decode_strides,
    group_logits,
    tile_slots,
)
from pagedlab.kernels.validate import check_paged_attention

__all__ = ["paged_attention_two_pass", "LOGITS_MODES"]

LOGITS_MODES = ("recompute", "scratch")


@triton.jit
def _two_pass_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides as key_cache
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [num_seqs]
    out_ptr,  # [num_seqs, num_heads, head_dim]
    logits_ptr,  # fp32 [num_seqs, num_heads, max_context] scratch, or None
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
    stride_s_seq,
    stride_s_head,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # GROUP and HEAD_DIM rounded up to powers of two >= 16
    DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SCRATCH: tl.constexpr,  # keep the logits in logits_ptr instead of recomputing them
):
    # Grid: (num_seqs, num_kv_heads). Program (seq, kv_head) serves query heads
    # kv_head * GROUP ... kv_head * GROUP + GROUP - 1 over all of the sequence's tokens.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows  # [GROUP_PAD]
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q_ptrs = query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)
    table_row = block_tables_ptr + seq * stride_t_seq
    head_offs = kv_head * stride_c_head + dims[None, :]  # [1, DIM_PAD]
    if SCRATCH:  # this group's rows of the scratch buffer, [GROUP_PAD, 1]
        s_row = logits_ptr + seq * stride_s_seq + heads[:, None] * stride_s_head

    # >>> passes
    # Pass 1: every key, for the logits' max m and sum l = sum exp(s - m) (running, as in
    # chapter 3's online softmax, but with no values to rescale).
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    for tile_start in range(0, seq_len, TILE):
        slots, tok_ok = tile_slots(
            table_row, stride_t_entry, tile_start, seq_len, stride_c_block, stride_c_token,
            BLOCK_SIZE, TILE,
        )
        kv_offs = slots[:, None] + head_offs  # [TILE, DIM_PAD]
        kv_ok = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT_DTYPE)
        s = group_logits(q, k, scale, tok_ok, PRECISION)  # [GROUP_PAD, TILE]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m = m_new
        if SCRATCH:
            tokens = tile_start + tl.arange(0, TILE)
            tl.store(s_row + tokens[None, :], s, mask=row_ok[:, None] & tok_ok[None, :])

    # Pass 2: every value, weighted by its final softmax probability; nothing is rescaled.
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for tile_start in range(0, seq_len, TILE):
        slots, tok_ok = tile_slots(
            table_row, stride_t_entry, tile_start, seq_len, stride_c_block, stride_c_token,
            BLOCK_SIZE, TILE,
        )
        kv_offs = slots[:, None] + head_offs
        kv_ok = tok_ok[:, None] & dim_ok[None, :]
        if SCRATCH:
            tokens = tile_start + tl.arange(0, TILE)
            s_ok = row_ok[:, None] & tok_ok[None, :]
            s = tl.load(s_row + tokens[None, :], mask=s_ok, other=float("-inf"))
        else:
            k = tl.load(key_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT_DTYPE)
            s = group_logits(q, k, scale, tok_ok, PRECISION)
        p = tl.exp(s - m[:, None]) / l[:, None]  # [GROUP_PAD, TILE], final probabilities
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT_DTYPE)
        acc += tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        # <<< passes

    out_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention_two_pass(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    *,
    scale=None,
    logits: str = "recompute",
    check_values: bool = True,
):
    """One decode step in two passes; same contract as ``reference.paged_attention``.

    ``logits`` says how pass 2 gets the logits back: ``"recompute"`` (read the keys again) or
    ``"scratch"`` (write them to an fp32 buffer in pass 1 and read them back).
    """
    scale = check_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, check_values=check_values
    )
    if logits not in LOGITS_MODES:
        raise ValueError(f"logits={logits!r} must be one of {LOGITS_MODES}")
    check_launchable(query)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = query.new_empty(query.shape)  # [num_seqs, num_heads, head_dim]
    if num_seqs == 0:
        return out

    scratch = None
    if logits == "scratch":
        max_context = block_tables.shape[1] * block_size
        scratch = query.new_empty(num_seqs, num_heads, max_context, dtype=torch.float32)
    _two_pass_kernel[(num_seqs, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        scratch,
        scale,
        *decode_strides(query, key_cache, block_tables),
        *out.stride()[:2],
        *(scratch.stride()[:2] if scratch is not None else (0, 0)),
        **decode_meta(query, key_cache),
        SCRATCH=scratch is not None,
    )
    return out
