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

from pagedlab._arith import cdiv
from pagedlab.kernels.validate import (
    check_copy_blocks,
    check_paged_attention,
    check_reshape_and_cache,
    check_swap_blocks,
)

__all__ = [
    "gather_kv", "token_slots", "decode_layout", "attend_by_slot", "paged_attention",
    "reshape_and_cache", "copy_blocks", "swap_blocks",
]


def gather_kv(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """One sequence's first ``seq_len`` tokens, made contiguous: [seq_len, num_kv_heads, head_dim].

    cache [num_blocks, block_size, num_kv_heads, head_dim]; block_table [max_blocks_per_seq].
    """
    block_size = cache.shape[1]
    num_used = cdiv(seq_len, block_size)  # blocks holding the sequence, the last maybe partial
    blocks = block_table[:num_used].long()  # [num_used] physical block ids
    return cache[blocks].flatten(0, 1)[:seq_len]  # [num_used * block_size, H, D] -> [seq_len, H, D]


def token_slots(block_tables: Tensor, seq_lens: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Each sequence's token slots, padded to the longest: (slots int64 [S, T], valid bool [S, T]).

    Token t of sequence s lives in slot ``block_tables[s, t // block_size] * block_size +
    t % block_size``; a padding position (t >= seq_lens[s]) repeats the slot of the sequence's
    token 0, so it reads a key and a value the sequence wrote: finite, whatever the cache
    held before (a fresh cache is ``torch.empty``).
    """
    lens = seq_lens.long()  # [S]
    t = torch.arange(int(lens.max()), device=lens.device)  # [T]
    valid = t < lens[:, None]  # [S, T]
    t = torch.where(valid, t, 0)  # [S, T]: padding reads token 0
    slots = block_tables.long().gather(1, t // block_size) * block_size + t % block_size
    return slots, valid


def decode_layout(block_tables: Tensor, seq_lens: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """What a decode step's attention reads, the same in every layer, so a model builds it once
    per step: each sequence's token slots padded to the longest (int64 [S, T], as
    :func:`token_slots`) and an additive mask, fp32 [S, 1, 1, T]: 0 on its tokens, -inf on the
    padding (SDPA on a CPU takes it as it is; a boolean mask it converts in every call)."""
    slots, valid = token_slots(block_tables, seq_lens, block_size)  # [S, T] each
    bias = torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf"))
    return slots, bias[:, None, None, :]


def attend_by_slot(query, key_cache, value_cache, slots, bias, scale: float) -> Tensor:
    """Decode attention given :func:`decode_layout`'s ``slots`` and ``bias``; no checks.

    Every sequence's tokens are gathered by slot (one ``index_select`` per cache, viewed as
    [num_slots, num_kv_heads, head_dim]) into a [num_seqs, T, ...] batch padded to the longest,
    the padding masked out of the softmax. The query heads that share a KV head stand where
    SDPA expects query positions, so each KV head is read once for its whole group.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    keys, values = (
        cache.flatten(0, 1).index_select(0, slots.view(-1))  # a view unless cache is strided
        .view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2).float()
        for cache in (key_cache, value_cache)
    )  # [S, num_kv_heads, T, D] each
    out = F.scaled_dot_product_attention(
        query.float().view(num_seqs, num_kv_heads, -1, head_dim),  # a group's heads as rows
        keys, values, attn_mask=bias, scale=scale,
    )  # [S, num_kv_heads, group, D]: softmax over each sequence's own tokens, in fp32
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, *, scale=None, check_values=True
):
    """One decode step: each sequence's query attends to its ``seq_lens[i]`` cached tokens.

    query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim] in query's dtype.
    Query head h reads KV head h // (num_heads // num_kv_heads) (MHA, GQA and MQA alike).
    ``check_values=False`` skips the checks that read seq_lens and block_tables, for a caller
    that built them (every function here takes it, as the Triton ones do). The whole batch at
    once: :func:`decode_layout`, then :func:`attend_by_slot`.
    """
    scale = check_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, check_values=check_values
    )
    if query.shape[0] == 0:
        return query.new_empty(query.shape)
    layout = decode_layout(block_tables, seq_lens, key_cache.shape[1])
    return attend_by_slot(query, key_cache, value_cache, *layout, scale)


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
    keep = slot_mapping >= 0  # [num_tokens]: padding tokens own no slot
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]  # [num_kept, ...]
    num_blocks, block_size = key_cache.shape[:2]
    for cache, new in ((key_cache, key), (value_cache, value)):
        if cache.stride(0) == block_size * cache.stride(1):  # slots merge into one dim: a view
            cache.view(num_blocks * block_size, *cache.shape[2:]).index_copy_(0, slot_mapping, new)
        else:
            cache[slot_mapping // block_size, slot_mapping % block_size] = new  # [num_kept, H, D]


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
