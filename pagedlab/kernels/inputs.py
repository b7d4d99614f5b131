"""Random paged batches (decode steps and mixed steps) for tests, benchmarks and chapters.

Slots that no sequence uses are filled with NaN (by default), so a kernel that reads past a
sequence's last token, or through a table entry past its last block, shows it in its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedlab.device import DEVICE

__all__ = ["PagedDecodeInputs", "random_paged_inputs", "PagedVarlenInputs", "random_varlen_inputs"]

LAYOUTS = ("permuted", "random")


@dataclass
class PagedDecodeInputs:
    """The arguments of ``paged_attention`` for one decode step."""

    query: Tensor  # [num_seqs, num_heads, head_dim]
    key_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor  # same shape as key_cache
    block_tables: Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: Tensor  # int32 [num_seqs]

    def args(self) -> tuple[Tensor, ...]:
        return self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens


def random_paged_inputs(
    seq_lens,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device=None,
    layout: str = "permuted",
    spare_blocks: int = 2,
    spare_table_entries: int = 1,
    fill: float = float("nan"),
    seed: int = 0,
) -> PagedDecodeInputs:
    """Gaussian queries, keys and values for sequences of the given lengths, in blocks of a cache.

    ``layout="permuted"``: the blocks the batch needs, shuffled and dealt out, each owned once.
    ``layout="random"``: each table entry drawn from the whole cache, so sequences may share
    blocks (as after a fork). The cache has ``spare_blocks`` blocks beyond what the batch needs;
    each table has ``spare_table_entries`` columns past the longest sequence's last block, all
    pointing at random blocks. Every slot no sequence reads holds ``fill``. The tensors live on
    ``device``, by default :data:`pagedlab.device.DEVICE`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    device = torch.device(device or DEVICE)
    g = torch.Generator(device=device).manual_seed(seed)
    lens = torch.tensor(list(seq_lens), dtype=torch.int64)  # [num_seqs]
    needed = (lens + block_size - 1) // block_size  # [num_seqs] blocks per sequence
    max_blocks = int(needed.max()) + spare_table_entries
    num_blocks = int(needed.sum()) + spare_blocks

    def randint(high, shape):
        return torch.randint(high, shape, generator=g, device=device)

    # Table entries, the spare columns included: random blocks, or a permutation dealt in order.
    tables = randint(num_blocks, (len(lens), max_blocks))  # [num_seqs, max_blocks]
    if layout == "permuted":
        perm = torch.randperm(num_blocks, generator=g, device=device)
        used = torch.arange(max_blocks) < needed[:, None]  # [num_seqs, max_blocks], on the CPU
        tables[used.to(device)] = perm[: int(needed.sum())]

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    query = randn(len(lens), num_heads, head_dim)
    key_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)

    # Slots read by some sequence: token t of sequence i is in slot tables[i, t // B] * B + t % B.
    tok = torch.arange(max_blocks * block_size, device=device)  # [capacity]
    slots = tables[:, tok // block_size] * block_size + tok % block_size  # [num_seqs, capacity]
    read = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    read[slots[tok < lens.to(device)[:, None]]] = True
    for cache in (key_cache, value_cache):
        cache.view(-1, num_kv_heads, head_dim)[~read] = fill

    return PagedDecodeInputs(
        query, key_cache, value_cache, tables.to(torch.int32), lens.to(device, torch.int32)
    )


@dataclass
class PagedVarlenInputs:
    """The arguments of ``paged_attention_varlen`` for one mixed step."""

    query: Tensor  # [num_tokens, num_heads, head_dim], every sequence's new tokens, packed
    key_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor  # same shape as key_cache
    block_tables: Tensor  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: Tensor  # int32 [num_seqs + 1], where each sequence's tokens start
    seq_lens: Tensor  # int32 [num_seqs], context lengths, the new tokens included

    def args(self) -> tuple[Tensor, ...]:
        return (
            self.query, self.key_cache, self.value_cache, self.block_tables,
            self.query_start_loc, self.seq_lens,
        )


def random_varlen_inputs(seq_lens, query_lens, *, seed: int = 0, **kw) -> PagedVarlenInputs:
    """A mixed step: sequence i has ``seq_lens[i]`` tokens in the cache, of which the last
    ``query_lens[i]`` are this step's queries (1 for a decode, a chunk for a prefill).

    The cache and tables are :func:`random_paged_inputs`' (``kw`` as there: heads, head_dim,
    block_size, dtype, device, layout, fill ...), so every slot no sequence reads holds NaN.
    """
    x = random_paged_inputs(seq_lens, seed=seed, **kw)
    q_lens = torch.tensor(list(query_lens), dtype=torch.int32)  # [num_seqs]
    if q_lens.shape != x.seq_lens.shape or bool((q_lens > x.seq_lens.cpu()).any()):
        raise ValueError(f"query_lens {q_lens.tolist()} must give each sequence <= seq_lens")
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)  # [num_seqs + 1]
    starts[1:] = q_lens.cumsum(0)
    _, num_heads, head_dim = x.query.shape
    g = torch.Generator(device=x.query.device).manual_seed(seed + 1)
    query = torch.randn(  # [num_tokens, num_heads, head_dim]
        int(starts[-1]), num_heads, head_dim, generator=g, device=x.query.device,
        dtype=x.query.dtype,
    )
    return PagedVarlenInputs(
        query, x.key_cache, x.value_cache, x.block_tables, starts.to(query.device), x.seq_lens
    )
