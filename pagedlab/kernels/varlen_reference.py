"""Attention for a mixed batch of prefill chunks and decodes, in plain torch: the varlen spec.

One step of a chunked-prefill scheduler gives each sequence some new query tokens: one for a
decode, a chunk of its prompt for a prefill. Their keys and values are already in the paged
cache, after the sequence's earlier tokens. Query token j of sequence i (of q_len_i new
tokens) sits at position ``seq_lens[i] - q_len_i + j`` and attends causally to cache
positions ``0 ... that position``: everything cached before the chunk, and the chunk's tokens
up to itself. :func:`pagedlab.kernels.paged_attention_varlen` is the Triton kernel.
"""

from __future__ import annotations

import torch

from pagedlab.kernels.reference import gather_kv
from pagedlab.kernels.varlen_checks import check_paged_attention_varlen

__all__ = ["paged_attention_varlen"]


def paged_attention_varlen(
    query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, *, scale=None,
    check_values=True,
):
    """Causal attention of each sequence's new tokens over its paged cache.

    query [num_tokens, num_heads, head_dim]: the sequences' new tokens, packed in order;
    sequence i owns rows ``query_start_loc[i] : query_start_loc[i + 1]`` (int32
    [num_seqs + 1]). seq_lens int32 [num_seqs]: each sequence's context length, its new tokens
    included. block_tables int32 [num_seqs, max_blocks_per_seq]; caches as in
    ``paged_attention``. Returns [num_tokens, num_heads, head_dim] in query's dtype.
    """
    scale = check_paged_attention_varlen(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        check_values=check_values,
    )
    group = query.shape[1] // key_cache.shape[2]  # query heads per KV head
    out = query.new_empty(query.shape)  # [num_tokens, num_heads, head_dim]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        q = query[rows].float()  # [q_len, num_heads, D]
        q_len = q.shape[0]
        k = gather_kv(key_cache, block_tables[i], seq_len).float()  # [seq_len, num_kv_heads, D]
        v = gather_kv(value_cache, block_tables[i], seq_len).float()
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, D]
        v = v.repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [q_len]
        visible = torch.arange(seq_len, device=q.device) <= positions[:, None]  # [q_len, seq_len]
        probs = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [H, q_len, seq_len]
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)  # [q_len, H, D]
    return out
