"""An fp8 (e4m3) KV cache in plain torch: the spec for :mod:`pagedlab.kernels.fp8`.

A cached value x is stored as the e4m3 number nearest x / scale, saturated at ±448, with one
fp32 scale for the whole cache or one per KV head (``k_scale`` for keys, ``v_scale`` for
values). Reading multiplies by the scale again. e4m3 keeps 3 mantissa bits, so a stored value
is within 2**-4 (6.25%) of x / scale, relative, wherever x / scale is at least 2**-6.

The cache layouts are those of :mod:`pagedlab.kernels.reference`, in ``torch.float8_e4m3fn``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedlab._checks import check_positive
from pagedlab.dtypes import FP8
from pagedlab.kernels import reference
from pagedlab.kernels.batch_checks import (
    check_decode_batch,
    check_scale_vector,
    check_slot_mapping,
)
from pagedlab.kernels.inputs import PagedDecodeInputs
from pagedlab.kernels.validate import (
    FLOAT_DTYPES,
    _check_device,
    _check_like,
    _check_tensor,
    _check_unit_stride,
    _check_writable,
)

__all__ = [
    "FP8",
    "FP8_MAX",
    "kv_scale",
    "quantize",
    "dequantize",
    "reshape_and_cache_fp8",
    "paged_attention_fp8",
    "check_reshape_and_cache_fp8",
    "check_paged_attention_fp8",
    "quantize_inputs",
]

FP8_MAX = torch.finfo(FP8).max  # 448.0, the largest e4m3 value


def kv_scale(x: Tensor, *, per_head: bool = False) -> Tensor:
    """The scale that maps x's largest magnitude to FP8_MAX, so that nothing saturates.

    x [..., num_kv_heads, head_dim] -> fp32 [] (per tensor) or [num_kv_heads] (``per_head``).
    An all-zero x gets the smallest positive scale rather than 0.
    """
    dims = tuple(d for d in range(x.dim()) if d != x.dim() - 2) if per_head else None
    amax = x.abs().amax(dim=dims) if per_head else x.abs().amax()
    return (amax.float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """x [..., num_kv_heads, head_dim] / scale, saturated and rounded to e4m3 (ties to even)."""
    scaled = x.float() / scale.reshape(-1, 1)  # scale [] or [num_kv_heads] -> [1 or H, 1]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x8: Tensor, scale: Tensor) -> Tensor:
    """fp32 values of an fp8 tensor [..., num_kv_heads, head_dim] stored with ``scale``."""
    return x8.float() * scale.reshape(-1, 1)


def check_reshape_and_cache_fp8(
    key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, *, check_values=True
) -> None:
    """``reshape_and_cache``'s contract with fp8 caches, plus the two scales."""
    _check_tensor("key", key, 3, FLOAT_DTYPES)
    _check_like("value", value, "key", key, strides=True)
    _check_unit_stride("key", key)
    _check_tensor("key_cache", key_cache, 4, (FP8,))
    _check_device("key_cache", key_cache, key.device)
    _check_unit_stride("key_cache", key_cache)
    _check_writable("key_cache", key_cache)
    _check_like("value_cache", value_cache, "key_cache", key_cache, strides=True)
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key has (num_kv_heads, head_dim) = {tuple(key.shape[1:])} but key_cache holds "
            f"{tuple(key_cache.shape[2:])}"
        )
    capacity = key_cache.shape[0] * key_cache.shape[1]
    check_slot_mapping(slot_mapping, key.shape[0], capacity, key.device, check_values=check_values)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_scale_vector(name, s, key.shape[1], key.device, check_values=check_values)


def check_paged_attention_fp8(
    query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, scale,
    *, check_values=True,
) -> float:
    """``paged_attention``'s contract with fp8 caches, plus the scales; returns the softmax
    scale (default 1/sqrt(head_dim))."""
    check_decode_batch(
        query, "key_cache", key_cache, block_tables, seq_lens,
        cache_dtypes=(FP8,), cache_ndim=4, check_values=check_values,
    )
    _check_like("value_cache", value_cache, "key_cache", key_cache, strides=True)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_head_dim = key_cache.shape[2:]
    if cache_head_dim != head_dim:
        raise ValueError(
            f"key_cache has head_dim {cache_head_dim} but query has head_dim {head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query's num_heads={num_heads} must be a multiple of key_cache's "
            f"num_kv_heads={num_kv_heads}"
        )
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_scale_vector(name, s, num_kv_heads, query.device, check_values=check_values)
    scale = head_dim**-0.5 if scale is None else scale
    check_positive("scale", scale)
    return float(scale)


def reshape_and_cache_fp8(
    key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, *, check_values=True
):
    """Quantise each new token's key and value and write them to their slots.

    key, value [num_tokens, num_kv_heads, head_dim] (fp32/fp16/bf16); caches fp8
    [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping int64 [num_tokens]
    (negative: skipped); k_scale, v_scale fp32 [] or [num_kv_heads].
    """
    check_reshape_and_cache_fp8(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        check_values=check_values,
    )
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0  # [num_tokens]
    blocks, offsets = slot_mapping[keep] // block_size, slot_mapping[keep] % block_size
    key_cache[blocks, offsets] = quantize(key[keep], k_scale)  # [num_kept, H, D]
    value_cache[blocks, offsets] = quantize(value[keep], v_scale)


def paged_attention_fp8(
    query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, *, scale=None,
    check_values=True,
):
    """One decode step on fp8 caches: dequantise them, then ``reference.paged_attention``.

    query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim] in query's dtype.
    """
    scale = check_paged_attention_fp8(
        query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, scale,
        check_values=check_values,
    )
    k = dequantize(key_cache, k_scale)  # fp32 copy of the whole cache: a spec, not a fast path
    v = dequantize(value_cache, v_scale)
    out = reference.paged_attention(
        query.float(), k, v, block_tables, seq_lens, scale=scale, check_values=False
    )  # checked above
    return out.to(query.dtype)


def quantize_inputs(x: PagedDecodeInputs, *, per_head: bool = False) -> tuple:
    """``paged_attention_fp8``'s arguments for the batch ``x``: its caches quantised with scales
    from their largest magnitudes (unused slots, NaN in random inputs, stay NaN and are ignored)."""
    k_scale = kv_scale(x.key_cache.nan_to_num(0.0), per_head=per_head)
    v_scale = kv_scale(x.value_cache.nan_to_num(0.0), per_head=per_head)
    k8, v8 = quantize(x.key_cache, k_scale), quantize(x.value_cache, v_scale)
    return x.query, k8, v8, x.block_tables, x.seq_lens, k_scale, v_scale
