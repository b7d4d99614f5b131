"""Argument checks shared by the torch references and the Triton kernels, run before any launch.

Every error names the argument that is wrong: a wrong type or dtype raises TypeError, a wrong
shape, device, stride or value raises ValueError. Shape, dtype, device and stride checks read
only metadata. Strides: the kernels take the strides of queries, caches, block tables and copy
pairs, so views of those work, except that a head's vector must be one run (stride 1 in the last
dimension) and a cache that is written must not be an expanded view; 1-D metadata (seq_lens,
slot_mapping) must be contiguous. The value checks (sequence lengths, block ids, slots) read
the tensors, which on a GPU costs a device sync; the Triton wrappers let an engine that built
those tensors itself skip them with ``check_values=False``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedlab._checks import check_positive

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = [
    "FLOAT_DTYPES",
    "check_paged_attention",
    "check_reshape_and_cache",
    "check_copy_blocks",
    "check_swap_blocks",
]


# ---------------------------------------------------------------------------------------------
# Metadata


def _check_tensor(name: str, t, ndim: int | None, dtypes=None) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {t.dtype}")


def _check_like(name: str, t, ref_name: str, ref: Tensor, *, shape=True, strides=False) -> None:
    """t has ref's dtype and device, and (optionally) its shape and strides."""
    _check_tensor(name, t, ref.dim() if shape else None)
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")
    if shape and t.shape != ref.shape:
        raise ValueError(
            f"{name} must have {ref_name}'s shape {tuple(ref.shape)}, got {tuple(t.shape)}"
        )
    if strides and t.stride() != ref.stride():
        raise ValueError(f"{name} must have {ref_name}'s strides {ref.stride()}, got {t.stride()}")


def _check_device(name: str, t: Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_rows(name: str, t: Tensor, rows: int, what: str) -> None:
    if t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows ({what}), got shape {tuple(t.shape)}")


def _check_unit_stride(name: str, t: Tensor) -> None:
    """Kernels load a head's vector as one contiguous run: the last dimension has stride 1."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (head_dim), got strides {t.stride()}"
        )


def _check_contiguous(name: str, t: Tensor) -> None:
    """1-D metadata is read as one run: a kernel takes no stride for it."""
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got strides {t.stride()}: pass {name}.contiguous()"
        )


def _check_writable(name: str, t: Tensor) -> None:
    """A cache that is written: no dimension of an expanded view (stride 0) aliases its slots."""
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        raise ValueError(
            f"{name} is an expanded view (strides {t.stride()}): its slots alias, so it "
            "cannot be written"
        )


def _check_pairs(name: str, mapping, device: torch.device | None) -> None:
    """An int64 [num_pairs, 2] tensor of (src, dst) block ids, on ``device`` if given."""
    _check_tensor(name, mapping, 2, (torch.int64,))
    if mapping.shape[1] != 2:
        raise ValueError(f"{name} must have shape [num_pairs, 2], got {tuple(mapping.shape)}")
    if device is not None:
        _check_device(name, mapping, device)


# ---------------------------------------------------------------------------------------------
# Values (each costs a device sync on a GPU)


def _first(mask: Tensor) -> tuple[int, ...]:
    """Index of the first True entry of ``mask``."""
    return tuple(mask.nonzero()[0].tolist())


def _check_block_ids(name: str, ids: Tensor, num_blocks: int, of: str, used=None) -> None:
    """Every (used) entry of ``ids`` is a block of a cache with ``num_blocks`` blocks."""
    bad = (ids < 0) | (ids >= num_blocks)
    if used is not None:
        bad &= used
    if bad.any():
        at = _first(bad)
        raise ValueError(
            f"{name}[{', '.join(map(str, at))}] = {ids[at].item()} is not a block of {of} "
            f"(num_blocks={num_blocks})"
        )


def _check_distinct(name: str, dst: Tensor) -> None:
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError(f"{name} names a destination block twice: {dst.tolist()}")


# ---------------------------------------------------------------------------------------------
# Public checks, one per operation


def _check_query_and_caches(query, key_cache, value_cache) -> tuple[int, int]:
    """query [n, num_heads, D] against caches [num_blocks, block_size, num_kv_heads, D]: dtypes,
    device, head_dim, query heads a multiple of KV heads, unit stride in the last dimension.
    Returns (num_blocks, block_size)."""
    _check_tensor("query", query, 3, FLOAT_DTYPES)
    _check_tensor("key_cache", key_cache, 4)
    _check_like("key_cache", key_cache, "query", query, shape=False)
    _check_like("value_cache", value_cache, "key_cache", key_cache, strides=True)
    _, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(
            f"key_cache has head_dim {cache_head_dim} but query has head_dim {head_dim}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"query's num_heads={num_heads} must be a multiple of key_cache's "
            f"num_kv_heads={num_kv_heads}"
        )
    _check_unit_stride("query", query)
    _check_unit_stride("key_cache", key_cache)
    return num_blocks, block_size


def check_paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, scale, *, check_values: bool = True
) -> float:
    """Check :func:`paged_attention`'s arguments; return the scale (default 1/sqrt(head_dim))."""
    num_blocks, block_size = _check_query_and_caches(query, key_cache, value_cache)
    num_seqs, _, head_dim = query.shape
    _check_tensor("block_tables", block_tables, 2, (torch.int32,))
    _check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    _check_contiguous("seq_lens", seq_lens)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        _check_device(name, t, query.device)
        _check_rows(name, t, num_seqs, "one per sequence of query")
    scale = head_dim**-0.5 if scale is None else scale
    check_positive("scale", scale)
    if check_values and num_seqs:
        _check_seq_lens(block_tables, seq_lens, block_size, num_blocks)
    return float(scale)


def _check_seq_lens(block_tables: Tensor, seq_lens: Tensor, block_size: int, num_blocks: int):
    """1 <= seq_len <= the table's capacity, and every block a sequence reads exists."""
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    lens = seq_lens.long()  # [num_seqs]
    bad_len = (lens < 1) | (lens > capacity)
    if bad_len.any():
        (i,) = _first(bad_len)
        raise ValueError(
            f"seq_lens[{i}] = {lens[i].item()} must be in [1, {capacity}]: 1 to the table's "
            f"capacity max_blocks_per_seq * block_size = {max_blocks} * {block_size}"
        )
    needed = (lens + block_size - 1) // block_size  # [num_seqs], blocks each sequence reads
    used = torch.arange(max_blocks, device=lens.device) < needed[:, None]  # [num_seqs, max_blocks]
    _check_block_ids("block_tables", block_tables, num_blocks, "key_cache", used)


def check_reshape_and_cache(
    key, value, key_cache, value_cache, slot_mapping, *, check_values: bool = True
) -> None:
    """Check :func:`reshape_and_cache`'s arguments."""
    _check_tensor("key", key, 3, FLOAT_DTYPES)
    _check_like("value", value, "key", key, strides=True)
    _check_tensor("key_cache", key_cache, 4)
    _check_like("key_cache", key_cache, "key", key, shape=False)
    _check_like("value_cache", value_cache, "key_cache", key_cache, strides=True)
    num_blocks, block_size = key_cache.shape[:2]
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key has (num_kv_heads, head_dim) = {tuple(key.shape[1:])} but key_cache holds "
            f"{tuple(key_cache.shape[2:])}"
        )
    _check_unit_stride("key", key)
    _check_unit_stride("key_cache", key_cache)
    _check_writable("key_cache", key_cache)
    _check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    _check_contiguous("slot_mapping", slot_mapping)
    _check_device("slot_mapping", slot_mapping, key.device)
    _check_rows("slot_mapping", slot_mapping, key.shape[0], "one slot per token of key")
    if check_values and slot_mapping.numel():
        capacity = num_blocks * block_size
        bad = slot_mapping >= capacity
        if bad.any():
            (i,) = _first(bad)
            raise ValueError(
                f"slot_mapping[{i}] = {slot_mapping[i].item()} is past the cache's last slot "
                f"(num_blocks * block_size = {capacity})"
            )


def check_copy_blocks(key_caches, value_caches, block_mapping, *, check_values: bool = True):
    """Check :func:`copy_blocks`'s arguments: same-shaped contiguous per-layer caches."""
    for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        if not isinstance(caches, (list, tuple)) or not caches:
            raise TypeError(f"{name} must be a non-empty list of per-layer caches")
    if len(value_caches) != len(key_caches):
        raise ValueError(
            f"len(value_caches)={len(value_caches)} must equal len(key_caches)={len(key_caches)}"
        )
    first = key_caches[0]
    _check_tensor("key_caches[0]", first, 4, FLOAT_DTYPES)
    if not first.is_contiguous():
        raise ValueError("key_caches[0] must be contiguous: each block is copied as one run")
    for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        for i, cache in enumerate(caches):
            _check_like(f"{name}[{i}]", cache, "key_caches[0]", first, strides=True)
    _check_pairs("block_mapping", block_mapping, first.device)
    if check_values and block_mapping.numel():
        _check_block_ids("block_mapping", block_mapping, first.shape[0], "key_caches[0]")
        src, dst = block_mapping.unbind(1)  # [num_pairs] each
        _check_distinct("block_mapping[:, 1]", dst)
        if torch.isin(dst, src).any():
            raise ValueError(
                "block_mapping copies into a block that is also a source; a destination "
                "must be a fresh block (the copies run in parallel)"
            )


def check_swap_blocks(src_cache, dst_cache, block_mapping, *, check_values: bool = True):
    """Check :func:`swap_blocks`'s arguments: caches with the same block shape and dtype."""
    if not isinstance(src_cache, Tensor) or src_cache.dim() == 0:
        raise TypeError("src_cache must be a torch.Tensor of blocks [num_blocks, ...]")
    _check_tensor("dst_cache", dst_cache, src_cache.dim())
    if dst_cache.dtype != src_cache.dtype:
        raise TypeError(
            f"dst_cache must have src_cache's dtype {src_cache.dtype}, got {dst_cache.dtype}"
        )
    if dst_cache.shape[1:] != src_cache.shape[1:]:
        raise ValueError(
            f"dst_cache's blocks must have src_cache's block shape {tuple(src_cache.shape[1:])}, "
            f"got {tuple(dst_cache.shape[1:])}"
        )
    _check_pairs("block_mapping", block_mapping, None)
    if check_values and block_mapping.numel():
        src, dst = block_mapping.unbind(1)  # [num_pairs] each
        _check_block_ids("block_mapping[:, 0]", src, src_cache.shape[0], "src_cache")
        _check_block_ids("block_mapping[:, 1]", dst, dst_cache.shape[0], "dst_cache")
        _check_distinct("block_mapping[:, 1]", dst)
