"""Argument checks for decode batches whose cache is not of the query's dtype (fp8, MLA latents).

:func:`pagedlab.kernels.validate.check_paged_attention` requires caches of the query's dtype.
The fp8 and MLA kernels of chapter 11 take other caches but the same batch description (query,
block tables, sequence lengths); :func:`check_decode_batch` checks that part with
``validate``'s helpers, so that every error names its argument in the same words.
"""

from __future__ import annotations

import torch

from pagedlab.kernels.validate import (
    FLOAT_DTYPES,
    _check_contiguous,
    _check_device,
    _check_rows,
    _check_seq_lens,
    _check_tensor,
    _check_unit_stride,
)

__all__ = ["check_decode_batch", "check_scale_vector", "check_slot_mapping"]


def check_decode_batch(
    query, cache_name: str, cache, block_tables, seq_lens, *, cache_ndim: int,
    cache_dtypes=None, check_values: bool = True,
) -> None:
    """Check a decode step's query, one cache and its batch description.

    query [num_seqs, num_heads, D] (fp32/fp16/bf16); ``cache`` [num_blocks, block_size, ...]
    of ``cache_ndim`` dimensions and one of ``cache_dtypes`` (default: query's dtype), on
    query's device; both unit stride in their last dimension; block_tables int32 [num_seqs,
    max_blocks_per_seq] and seq_lens int32 [num_seqs] (contiguous) on query's device.
    ``check_values`` also reads seq_lens and the used table entries (a device sync): 1 <=
    seq_len <= the table's capacity, and every block exists.
    """
    _check_tensor("query", query, 3, FLOAT_DTYPES)
    _check_unit_stride("query", query)
    _check_tensor(cache_name, cache, cache_ndim, cache_dtypes or (query.dtype,))
    _check_device(cache_name, cache, query.device)
    _check_unit_stride(cache_name, cache)
    _check_tensor("block_tables", block_tables, 2, (torch.int32,))
    _check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    _check_contiguous("seq_lens", seq_lens)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        _check_device(name, t, query.device)
        _check_rows(name, t, query.shape[0], "one per sequence of query")
    if check_values and query.shape[0]:
        num_blocks, block_size = cache.shape[:2]
        _check_seq_lens(block_tables, seq_lens, block_size, num_blocks)


def check_scale_vector(name: str, scale, length: int, device, *, check_values: bool = True):
    """``scale`` is an fp32 tensor of shape [] (one for all) or [length] (one per head), on
    ``device``, with finite positive values (read only if ``check_values``)."""
    _check_tensor(name, scale, None, (torch.float32,))
    if scale.shape not in ((), (length,)):
        raise ValueError(
            f"{name} must have shape [] (per tensor) or [{length}] (per KV head), "
            f"got {tuple(scale.shape)}"
        )
    _check_device(name, scale, device)
    if check_values and not bool(((scale > 0) & scale.isfinite()).all()):
        raise ValueError(f"{name} must be finite and > 0, got {scale.tolist()}")



def check_slot_mapping(slot_mapping, num_tokens: int, capacity: int, device, *, check_values=True):
    """int64 [num_tokens], contiguous, on ``device``; if ``check_values``, no slot at or past
    ``capacity`` (the cache's num_blocks * block_size). Negative slots mean "skip", allowed."""
    _check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    _check_contiguous("slot_mapping", slot_mapping)
    _check_device("slot_mapping", slot_mapping, device)
    _check_rows("slot_mapping", slot_mapping, num_tokens, "one slot per token")
    if check_values and slot_mapping.numel():
        past = slot_mapping >= capacity
        if past.any():
            i = int(past.nonzero()[0])
            raise ValueError(
                f"slot_mapping[{i}] = {slot_mapping[i].item()} is past the cache's last slot "
                f"(num_blocks * block_size = {capacity})"
            )
