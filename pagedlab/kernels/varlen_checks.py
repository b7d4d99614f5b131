"""Argument checks of the mixed-batch (varlen) attention, shared by its kernel and its reference.

A mixed batch packs every sequence's new query tokens into one tensor; ``query_start_loc``
says where each sequence's tokens start. The checks use :mod:`pagedlab.kernels.validate`'s
helpers, so that errors name their argument in the same words; as there, the value checks
(offsets, lengths, block ids) read tensors and can be skipped with ``check_values=False``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedlab._checks import check_positive
from pagedlab.kernels.validate import (
    _check_device,
    _check_query_and_caches,
    _check_seq_lens,
    _check_tensor,
    _first,
)

__all__ = ["check_paged_attention_varlen"]


def check_paged_attention_varlen(
    query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, *,
    check_values: bool = True,
) -> float:
    """Check :func:`paged_attention_varlen`'s arguments; return the scale (default 1/sqrt(D)).

    query [num_tokens, num_heads, D] and the caches as in ``paged_attention``; block_tables
    int32 [num_seqs, max_blocks_per_seq] (any strides); query_start_loc int32 [num_seqs + 1]
    and seq_lens int32 [num_seqs], both contiguous (the kernel indexes them as flat arrays).
    Values: query_start_loc runs from 0 to num_tokens without decreasing; each sequence's
    seq_len is in [1, the table's capacity] and at least its query length; every block a
    sequence reads exists.
    """
    num_blocks, block_size = _check_query_and_caches(query, key_cache, value_cache)
    num_tokens, _, head_dim = query.shape
    _check_tensor("block_tables", block_tables, 2, (torch.int32,))
    _check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    _check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    num_seqs = seq_lens.shape[0]
    for name, t, rows in (
        ("block_tables", block_tables, num_seqs),
        ("query_start_loc", query_start_loc, num_seqs + 1),
    ):
        if t.shape[0] != rows:
            raise ValueError(
                f"{name} must have {rows} rows (seq_lens has {num_seqs} sequences), "
                f"got shape {tuple(t.shape)}"
            )
    for name, t in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        _check_device(name, t, query.device)
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if num_seqs == 0 and num_tokens:
        raise ValueError(f"query has {num_tokens} tokens but seq_lens has no sequence")
    scale = head_dim**-0.5 if scale is None else scale
    check_positive("scale", scale)
    if check_values and num_seqs:
        _check_offsets(query_start_loc, num_tokens)
        _check_seq_lens(block_tables, seq_lens, block_size, num_blocks)  # as for a decode
        _check_query_lens(query_start_loc, seq_lens)
    return float(scale)


def _check_offsets(query_start_loc: Tensor, num_tokens: int) -> None:
    """0 = query_start_loc[0] <= query_start_loc[1] <= ... <= query_start_loc[-1] = num_tokens."""
    first, last = query_start_loc[0].item(), query_start_loc[-1].item()
    if first != 0 or last != num_tokens:
        raise ValueError(
            f"query_start_loc must run from 0 to query's num_tokens={num_tokens}, "
            f"got {first} ... {last}"
        )
    falls = query_start_loc[1:] < query_start_loc[:-1]  # [num_seqs]
    if falls.any():
        (i,) = _first(falls)
        raise ValueError(
            f"query_start_loc must not decrease: query_start_loc[{i + 1}] = "
            f"{query_start_loc[i + 1].item()} < query_start_loc[{i}] = {query_start_loc[i].item()}"
        )


def _check_query_lens(query_start_loc: Tensor, seq_lens: Tensor) -> None:
    """Each sequence's context length counts its new query tokens: q_len <= seq_len."""
    q_lens = query_start_loc.diff()  # [num_seqs]
    short = seq_lens < q_lens
    if short.any():
        (i,) = _first(short)
        raise ValueError(
            f"seq_lens[{i}] = {seq_lens[i].item()} is less than the sequence's "
            f"{q_lens[i].item()} query tokens (query_start_loc[{i + 1}] - query_start_loc[{i}]): "
            "a context length includes the new tokens, whose K/V are already in the cache"
        )
