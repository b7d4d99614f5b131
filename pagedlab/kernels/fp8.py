"""An fp8 (e4m3) paged KV cache in Triton: a quantising writer and a decode kernel that reads it.

The writer stores x / scale as e4m3 (one byte per value, half of fp16). The decode kernel loads
fp8 keys and values, widens them to the query's dtype for ``tl.dot``, and never multiplies a
loaded element by its scale. With s = scale * q.(k_scale k8) = (scale * k_scale) * q.k8, the key
scale folds into the softmax scale, one multiply per logit; and since softmax weights sum to 1,
sum_j p_j (v_scale v8_j) = v_scale * sum_j p_j v8_j, so the value scale multiplies the output
once. vLLM's CUDA kernel instead dequantised every loaded element, scale included, before its
dot products. Scales are per tensor or per KV head: a program serves one KV head, so either
way it reads two numbers. The torch spec is :mod:`pagedlab.kernels.fp8_reference`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedlab.kernels.cache_ops import cache_write_meta, cache_write_strides
from pagedlab.kernels.fp8_reference import (
    FP8,
    FP8_MAX,
    check_paged_attention_fp8,
    check_reshape_and_cache_fp8,
    kv_scale,
)
from pagedlab.kernels.tiles import (
    check_launchable,
    decode_meta,
    decode_strides,
    group_logits,
    online_softmax_step,
    tile_slots,
)

__all__ = ["FP8", "FP8_MAX", "kv_scale", "reshape_and_cache_fp8", "paged_attention_fp8"]

E4M3_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_e4m3(x):
    """fp32 -> e4m3 as torch converts: saturated at ±448, rounded to nearest, ties to even.

    The rounding is done in fp32 first, so the final cast only converts an exact e4m3 value:
    Triton's interpreter rounds fp32 -> fp8 casts half-up and can lose a carry out of the
    mantissa (7.9 becomes 4.0); a GPU's cast would round correctly on its own.
    """
    x = tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX)
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3: smallest normal is 2**-6
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(exponent - 3)
    # Adding 1.5 * 2**23 leaves no fp32 mantissa bits for a fraction: it rounds to an integer,
    # ties to even (|x| / step <= 16 here).
    units = (tl.math.div_rn(tl.abs(x), step) + 12582912.0) - 12582912.0
    # The sign goes back as a bit, so a negative value that rounds to zero stays -0.0 (a GPU
    # compiles -(0 * step) to +0.0).
    signed = (units * step).to(tl.int32, bitcast=True) | ((bits >> 31) << 31)
    return signed.to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _reshape_and_cache_fp8_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # same shape and strides as key
    key_cache_ptr,  # fp8 [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides as key_cache
    slot_mapping_ptr,  # int64 [num_tokens]
    k_scale_ptr,  # fp32 [num_kv_heads]
    v_scale_ptr,
    stride_kv_token,
    stride_kv_head,
    stride_c_block,
    stride_c_token,
    stride_c_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    # Grid: (num_tokens,). Program `token` quantises that token's keys and values into its slot.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padding token: it owns no slot
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)[None, :]
    head_ok = heads < NUM_KV_HEADS
    mask = head_ok[:, None] & (dims < HEAD_DIM)  # [HEADS_PAD, DIM_PAD]
    src = token * stride_kv_token + heads[:, None] * stride_kv_head + dims
    dst = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_token
    dst += heads[:, None] * stride_c_head + dims
    k_scale = tl.load(k_scale_ptr + heads, mask=head_ok, other=1.0)[:, None]  # [HEADS_PAD, 1]
    v_scale = tl.load(v_scale_ptr + heads, mask=head_ok, other=1.0)[:, None]
    k = tl.load(key_ptr + src, mask=mask).to(tl.float32)
    v = tl.load(value_ptr + src, mask=mask).to(tl.float32)
    # div_rn: IEEE division, as torch divides; a GPU's plain "/" is approximate (2 ulp), which
    # moves values that sit next to a rounding boundary into the other e4m3 step.
    tl.store(key_cache_ptr + dst, to_e4m3(tl.math.div_rn(k, k_scale)), mask=mask)
    tl.store(value_cache_ptr + dst, to_e4m3(tl.math.div_rn(v, v_scale)), mask=mask)


def _per_head(scale, num_kv_heads: int):
    """A scale of shape [] or [num_kv_heads] as a contiguous fp32 [num_kv_heads]."""
    return scale.expand(num_kv_heads).contiguous()


def reshape_and_cache_fp8(
    key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, *, check_values=True
):
    """Quantise each token's key and value into its fp8 cache slot; same contract as the
    reference. ``check_values=False`` skips the checks that read slots and scales."""
    check_reshape_and_cache_fp8(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        check_values=check_values,
    )
    check_launchable(key)
    num_tokens, num_kv_heads, _ = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_fp8_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        _per_head(k_scale, num_kv_heads),
        _per_head(v_scale, num_kv_heads),
        *cache_write_strides(key, key_cache),
        **cache_write_meta(key, key_cache),
    )


@triton.jit
def _paged_attention_fp8_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # fp8 [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides as key_cache
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [num_seqs]
    k_scale_ptr,  # fp32 [num_kv_heads]
    v_scale_ptr,
    out_ptr,  # [num_seqs, num_heads, head_dim]
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
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Grid: (num_seqs, num_kv_heads), one pass, as in decode.py without split-KV.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # >>> scales
    qk_scale = scale * tl.load(k_scale_ptr + kv_head)  # the key scale, folded in once
    v_scale = tl.load(v_scale_ptr + kv_head)
    # <<< scales

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    io_ok = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]  # [GROUP_PAD, DIM_PAD]
    q_ptrs = query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=io_ok, other=0.0).to(DOT_DTYPE)
    table_row = block_tables_ptr + seq * stride_t_seq

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for tile_start in range(0, seq_len, TILE):
        slots, tok_ok = tile_slots(
            table_row, stride_t_entry, tile_start, seq_len, stride_c_block, stride_c_token,
            BLOCK_SIZE, TILE,
        )
        kv_offs = slots[:, None] + kv_head * stride_c_head + dims[None, :]  # [TILE, DIM_PAD]
        kv_ok = tok_ok[:, None] & (dims < HEAD_DIM)[None, :]
        # One byte per value from memory; widened (exactly) to the dot's dtype in registers.
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT_DTYPE)
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT_DTYPE)
        s = group_logits(q, k, qk_scale, tok_ok, PRECISION)
        m, l, acc = online_softmax_step(m, l, acc, s, v, PRECISION)

    # >>> output
    out = acc * (v_scale / l)[:, None]  # the value scale, applied once
    # <<< output
    out_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_ok)


def paged_attention_fp8(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    k_scale,
    v_scale,
    *,
    scale=None,
    check_values: bool = True,
):
    """One decode step on fp8 caches; same contract as ``fp8_reference.paged_attention_fp8``.

    ``check_values=False`` skips the checks that read seq_lens, block_tables and the scales.
    """
    scale = check_paged_attention_fp8(
        query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, scale,
        check_values=check_values,
    )
    check_launchable(query)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = query.new_empty(query.shape)  # [num_seqs, num_heads, head_dim]
    if num_seqs == 0:
        return out
    _paged_attention_fp8_kernel[(num_seqs, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        _per_head(k_scale, num_kv_heads),
        _per_head(v_scale, num_kv_heads),
        out,
        scale,
        *decode_strides(query, key_cache, block_tables),
        *out.stride()[:2],
        **decode_meta(query, key_cache),
    )
    return out
