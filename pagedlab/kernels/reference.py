"""Paged decode attention and the KV-cache operations in plain torch: the spec for the kernels.

Each function has the signature of its Triton counterpart in :mod:`pagedlab.kernels` and is
written to be read: keys and values gathered through the block tables with plain indexing,
attention computed in fp32. It is also the engine's fast path on a CPU, so decode attention is
batched over sequences rather than looped (:func:`gather_kv` shows one sequence's gather).

Layouts (the same everywhere in pagedlab)::

    key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables            int32 [num_seqs, max_blocks_per_seq]: logical block -> physical block
    token t of a sequence   lives in block block_tables[seq, t // block_size], slot t % block_size
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedlab.kernels.validate import (
    check_copy_blocks,
    check_paged_attention,
    check_reshape_and_cache,
    check_swap_blocks,
)

__all__ = ["gather_kv", "paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks"]


def gather_kv(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """One sequence's first ``seq_len`` tokens, made contiguous: [seq_len, num_kv_heads, head_dim].

    cache [num_blocks, block_size, num_kv_heads, head_dim]; block_table [max_blocks_per_seq].
    """
    block_size = cache.shape[1]
    num_used = -(-seq_len // block_size)  # blocks holding the sequence, the last maybe partial
    blocks = block_table[:num_used].long()  # [num_used] physical block ids
    return cache[blocks].flatten(0, 1)[:seq_len]  # [num_used * block_size, H, D] -> [seq_len, H, D]


def paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, *, scale=None, check_values=True
):
    """One decode step: each sequence's query attends to its ``seq_lens[i]`` cached tokens.

    query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim] in query's dtype.
    Query head h reads KV head h // (num_heads // num_kv_heads) (MHA, GQA and MQA alike).
    ``check_values=False`` skips the checks that read seq_lens and block_tables, for a caller
    that built them (every function here takes it, as the Triton ones do).

    The whole batch at once: every sequence's blocks are gathered through its table into a
    padded [num_seqs, tokens, ...] tensor, and the slots past each sequence's length masked
    out (their keys and values may be anything, NaN included).
    """
    scale = check_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, check_values=check_values
    )
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_seqs == 0:
        return query.new_empty(query.shape)
    lens = seq_lens.long()  # [num_seqs]
    width = -(-int(lens.max()) // block_size)  # blocks of the longest sequence
    used = torch.arange(width, device=lens.device) < -(-lens[:, None] // block_size)  # [S, W]
    blocks = torch.where(used, block_tables[:, :width].long(), 0)  # [S, W]; unused: block 0
    keys = key_cache[blocks].flatten(1, 2).float()  # [S, T, num_kv_heads, D], T = W * block_size
    values = value_cache[blocks].flatten(1, 2).float()
    valid = torch.arange(keys.shape[1], device=lens.device) < lens[:, None]  # [S, T]
    invalid = ~valid[:, :, None, None]  # unused slots may hold anything, NaN too: zero them
    keys.masked_fill_(invalid, 0)  # (in place: the gathers made fresh tensors) since 0 * NaN
    values.masked_fill_(invalid, 0)  # would be NaN
    out = F.scaled_dot_product_attention(
        query.float()[:, :, None, :],  # [S, num_heads, 1, D]
        keys.transpose(1, 2), values.transpose(1, 2),  # [S, num_kv_heads, T, D]
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
    )  # [S, num_heads, 1, D]: softmax over each sequence's own tokens, in fp32
    return out[:, :, 0].to(query.dtype)


def reshape_and_cache(
    key, value, key_cache, value_cache, slot_mapping, *, check_values=True
) -> None:
    """Write each new token's key and value into its cache slot; a negative slot is skipped.

    key, value [num_tokens, num_kv_heads, head_dim]; slot_mapping int64 [num_tokens] with
    slot = block * block_size + offset (negative for padding tokens that own no slot).
    """
    check_reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, check_values=check_values
    )
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep]  # [num_kept]
    blocks, offsets = slots // block_size, slots % block_size  # [num_kept] each
    key_cache[blocks, offsets] = key[keep]  # [num_kept, num_kv_heads, head_dim]
    value_cache[blocks, offsets] = value[keep]


def copy_blocks(key_caches, value_caches, block_mapping, *, check_values=True) -> None:
    """Copy whole blocks within each layer's caches: copy-on-write for forked sequences.

    key_caches, value_caches: lists of per-layer caches; block_mapping int64 [num_pairs, 2] of
    (src, dst). Destinations are fresh blocks, so the order of the copies does not matter.
    """
    check_copy_blocks(key_caches, value_caches, block_mapping, check_values=check_values)
    src, dst = block_mapping.unbind(1)  # [num_pairs] each
    for key_cache, value_cache in zip(key_caches, value_caches):
        key_cache[dst] = key_cache[src]  # [num_pairs, block_size, num_kv_heads, head_dim]
        value_cache[dst] = value_cache[src]


def swap_blocks(src_cache, dst_cache, block_mapping, *, check_values=True) -> None:
    """Copy blocks from one cache to another, e.g. GPU to CPU when a sequence is swapped out.

    src_cache [num_src_blocks, ...], dst_cache [num_dst_blocks, ...] (same block shape, any
    devices); block_mapping int64 [num_pairs, 2] of (src block, dst block).
    """
    check_swap_blocks(src_cache, dst_cache, block_mapping, check_values=check_values)
    for src, dst in block_mapping.tolist():
        dst_cache[dst].copy_(src_cache[src])
