"""MLA decode in Triton over a paged latent cache, with the up-projections absorbed.

The cache holds one row per token, [c_kv ‖ k_rope] (see :mod:`pagedlab.kernels.mla_reference`
for the algebra and the torch spec). The kernel reads each row once per program and uses it
twice: the whole row against the absorbed query for the logit, and its latent part c_kv as the
value. Keys and values are the same bytes, so a cache split into a key cache and a value cache,
as the paged kernel of chapter 7 takes, has nothing to hold here.

All query heads share the one latent (as in MQA), so a program serves ``heads_per_program``
heads (a power of two >= 16, the rows of ``tl.dot``) and a sequence needs
ceil(num_heads / heads_per_program) programs, each reading the sequence's rows: more heads per
program, fewer re-reads, more registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.kernels.mla_reference import cache_latent, check_mla_attention, check_mla_decode
from pagedlab.kernels.tiles import (
    check_launchable,
    MIN_DOT,
    TILE_TOKENS,
    dot_dtype,
    dot_pad,
    online_softmax_step,
    tile_slots,
)

__all__ = ["cache_latent", "absorb_query", "mla_decode", "mla_attention", "HEADS_PER_PROGRAM"]

HEADS_PER_PROGRAM = 16


@triton.jit
def _mla_decode_kernel(
    query_ptr,  # [num_seqs, num_heads, RANK + ROPE]: [q_latent ‖ q_rope]
    cache_ptr,  # [num_blocks, block_size, RANK + ROPE]: [c_kv ‖ k_rope] per token
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [num_seqs]
    out_ptr,  # [num_seqs, num_heads, RANK]
    scale,
    stride_q_seq,
    stride_q_head,
    stride_c_block,
    stride_c_token,
    stride_t_seq,
    stride_t_entry,
    stride_o_seq,
    stride_o_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr,  # query heads per program, a power of two >= 16
    RANK: tl.constexpr,  # kv_lora_rank
    ROPE: tl.constexpr,  # rope_dim
    RANK_PAD: tl.constexpr,  # RANK and ROPE rounded up to powers of two >= 16
    ROPE_PAD: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Grid: (num_seqs, cdiv(NUM_HEADS, HEADS)). Program (seq, h) serves heads h * HEADS ...
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    head_ok = heads < NUM_HEADS
    lat = tl.arange(0, RANK_PAD)
    rope = tl.arange(0, ROPE_PAD)
    lat_ok = lat < RANK
    rope_ok = rope < ROPE
    seq_len = tl.load(seq_lens_ptr + seq)

    q_rows = query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head  # [HEADS, 1]
    q_lat = tl.load(q_rows + lat[None, :], mask=head_ok[:, None] & lat_ok[None, :], other=0.0)
    q_rope = tl.load(
        q_rows + RANK + rope[None, :], mask=head_ok[:, None] & rope_ok[None, :], other=0.0
    )
    q_lat = q_lat.to(DOT_DTYPE)  # [HEADS, RANK_PAD]
    q_rope = q_rope.to(DOT_DTYPE)  # [HEADS, ROPE_PAD]
    table_row = block_tables_ptr + seq * stride_t_seq

    m = tl.full([HEADS], float("-inf"), tl.float32)
    l = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, RANK_PAD], tl.float32)  # the output, in latent space
    for tile_start in range(0, seq_len, TILE):
        slots, tok_ok = tile_slots(
            table_row, stride_t_entry, tile_start, seq_len, stride_c_block, stride_c_token,
            BLOCK_SIZE, TILE,
        )
        # >>> latents
        rows = cache_ptr + slots[:, None]  # [TILE, 1]
        c = tl.load(rows + lat[None, :], mask=tok_ok[:, None] & lat_ok[None, :], other=0.0)
        k_rope = tl.load(
            rows + RANK + rope[None, :], mask=tok_ok[:, None] & rope_ok[None, :], other=0.0
        )
        c = c.to(DOT_DTYPE)  # [TILE, RANK_PAD]: the keys' latent part and the values
        k_rope = k_rope.to(DOT_DTYPE)  # [TILE, ROPE_PAD]
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)  # [HEADS, TILE]
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        s = tl.where(tok_ok[None, :], s * scale, float("-inf"))
        m, l, acc = online_softmax_step(m, l, acc, s, c, PRECISION)
        # <<< latents

    out = acc / l[:, None]  # [HEADS, RANK_PAD]
    out_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + lat[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & lat_ok[None, :])


def _check_heads_per_program(heads_per_program) -> None:
    n = heads_per_program
    if isinstance(n, bool) or not isinstance(n, int) or n < MIN_DOT or n & (n - 1):
        raise ValueError(
            f"heads_per_program={n!r} must be a power of two >= {MIN_DOT} (tl.dot's rows)"
        )


def mla_decode(
    query,
    latent_cache,
    block_tables,
    seq_lens,
    *,
    kv_lora_rank: int,
    scale,
    heads_per_program: int = HEADS_PER_PROGRAM,
    check_values: bool = True,
):
    """Absorbed MLA decode over the paged latent cache; same contract as
    ``mla_reference.mla_decode``: [num_seqs, H, kv_lora_rank + rope_dim] -> [num_seqs, H,
    kv_lora_rank]. ``check_values=False`` skips the checks that read seq_lens and block_tables.
    """
    scale = check_mla_decode(
        query, latent_cache, block_tables, seq_lens, kv_lora_rank, scale,
        check_values=check_values,
    )
    _check_heads_per_program(heads_per_program)
    check_launchable(query)
    num_seqs, num_heads, width = query.shape
    out = query.new_empty(num_seqs, num_heads, kv_lora_rank)
    if num_seqs == 0:
        return out
    rope_dim = width - kv_lora_rank
    dot, precision = dot_dtype(query.dtype)
    grid = (num_seqs, triton.cdiv(num_heads, heads_per_program))
    _mla_decode_kernel[grid](
        query,
        latent_cache,
        block_tables,
        seq_lens,
        out,
        scale,
        *query.stride()[:2],
        *latent_cache.stride()[:2],
        *block_tables.stride(),
        *out.stride()[:2],
        BLOCK_SIZE=latent_cache.shape[1],
        NUM_HEADS=num_heads,
        HEADS=heads_per_program,
        RANK=kv_lora_rank,
        ROPE=rope_dim,
        RANK_PAD=dot_pad(kv_lora_rank),
        ROPE_PAD=dot_pad(rope_dim),
        TILE=TILE_TOKENS,
        DOT_DTYPE=dot,
        PRECISION=precision,
    )
    return out


def absorb_query(q_nope, q_rope, w_uk):
    """The query in latent space: [w_uk[h]ᵀ q_nope[:, h] ‖ q_rope[:, h]] for every head h.

    q_nope [num_seqs, H, nope_dim], q_rope [num_seqs, H, rope_dim], w_uk [H, nope_dim,
    kv_lora_rank] -> [num_seqs, H, kv_lora_rank + rope_dim] in q_nope's dtype (computed in fp32).
    """
    q_latent = torch.einsum("shn,hnc->shc", q_nope.float(), w_uk.float())  # [S, H, C]
    return torch.cat([q_latent, q_rope.float()], dim=-1).to(q_nope.dtype)


def mla_attention(
    q_nope,
    q_rope,
    latent_cache,
    block_tables,
    seq_lens,
    w_uk,
    w_uv,
    *,
    scale,
    heads_per_program: int = HEADS_PER_PROGRAM,
    check_values: bool = True,
):
    """MLA decode the fast way: absorb w_uk into the query, run :func:`mla_decode`, apply w_uv
    to the latent output. Same contract as ``mla_reference.mla_attention``, which expands the
    cache instead: [num_seqs, H, nope_dim] (+ q_rope) -> [num_seqs, H, v_head_dim]."""
    scale = check_mla_attention(
        q_nope, q_rope, latent_cache, block_tables, seq_lens, w_uk, w_uv, scale,
        check_values=check_values,
    )
    query = absorb_query(q_nope, q_rope, w_uk)  # [S, H, C + R]
    out_latent = mla_decode(
        query, latent_cache, block_tables, seq_lens, kv_lora_rank=w_uk.shape[2], scale=scale,
        heads_per_program=heads_per_program, check_values=False,
    )  # [S, H, C]
    out = torch.einsum("shc,hvc->shv", out_latent.float(), w_uv.float())  # [S, H, v_head_dim]
    return out.to(q_nope.dtype)
