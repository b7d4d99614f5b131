"""Multi-head latent attention (MLA) on a paged latent cache, in plain torch: the spec for
:mod:`pagedlab.kernels.mla`.

MLA (DeepSeek-V2) caches one row per token, ``[c_kv ‖ k_rope]``: a latent c of width
kv_lora_rank, from which every head's key and value are projected, and a small RoPE key shared
by all heads. The cache has no separate keys and values::

    latent_cache  [num_blocks, block_size, kv_lora_rank + rope_dim]

For query head h, with up-projections w_uk[h] [nope_dim, kv_lora_rank] and w_uv[h]
[v_head_dim, kv_lora_rank], token j has key [w_uk[h] c_j ‖ k_rope_j] and value w_uv[h] c_j.
Two ways to compute attention over it, which must agree:

- :func:`mla_attention` expands: it builds every head's keys and values from the latents and
  runs plain softmax attention. Nothing is absorbed; it checks the kernel's algebra.
- :func:`mla_decode` is the absorbed form the kernel runs. Since q_nope·(w_uk[h] c) =
  (w_uk[h]ᵀ q_nope)·c, the query moves into latent space once per step; logits are
  q_latent·c + q_rope·k_rope; the output stays in latent space, sum_j p_j c_j, and w_uv[h]
  is applied to it once, outside the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedlab._checks import check_positive
from pagedlab.kernels.batch_checks import check_decode_batch, check_slot_mapping
from pagedlab.kernels.inputs import random_paged_inputs
from pagedlab.kernels.reference import gather_kv
from pagedlab.kernels.validate import FLOAT_DTYPES, _check_device, _check_like, _check_tensor

__all__ = [
    "cache_latent",
    "mla_decode",
    "mla_attention",
    "check_cache_latent",
    "check_mla_decode",
    "check_mla_attention",
    "MLADecodeInputs",
    "random_mla_inputs",
]


def check_cache_latent(c_kv, k_rope, latent_cache, slot_mapping, *, check_values=True) -> None:
    """c_kv [num_tokens, kv_lora_rank] and k_rope [num_tokens, rope_dim] of the cache's dtype
    and device; latent_cache [num_blocks, block_size, kv_lora_rank + rope_dim]."""
    _check_tensor("c_kv", c_kv, 2, FLOAT_DTYPES)
    _check_like("k_rope", k_rope, "c_kv", c_kv, shape=False)
    _check_like("latent_cache", latent_cache, "c_kv", c_kv, shape=False)
    if latent_cache.dim() != 3:
        raise ValueError(f"latent_cache must have 3 dimensions, got {tuple(latent_cache.shape)}")
    if k_rope.dim() != 2 or k_rope.shape[0] != c_kv.shape[0]:
        raise ValueError(
            f"k_rope must have shape [num_tokens={c_kv.shape[0]}, rope_dim], "
            f"got {tuple(k_rope.shape)}"
        )
    width = c_kv.shape[1] + k_rope.shape[1]
    if latent_cache.shape[2] != width:
        raise ValueError(
            f"latent_cache rows hold {latent_cache.shape[2]} values but c_kv ‖ k_rope has "
            f"{c_kv.shape[1]} + {k_rope.shape[1]} = {width}"
        )
    capacity = latent_cache.shape[0] * latent_cache.shape[1]
    check_slot_mapping(
        slot_mapping, c_kv.shape[0], capacity, c_kv.device, check_values=check_values
    )


def check_mla_decode(
    query, latent_cache, block_tables, seq_lens, kv_lora_rank, scale, *, check_values=True
) -> float:
    """query [num_seqs, num_heads, kv_lora_rank + rope_dim] (absorbed), a latent cache of its
    dtype and width, 0 < kv_lora_rank < width, scale > 0 (no default: it is 1/sqrt of the
    *un-absorbed* head dim, which the latent shapes do not tell). Returns the scale."""
    check_decode_batch(
        query, "latent_cache", latent_cache, block_tables, seq_lens,
        cache_ndim=3, check_values=check_values,
    )
    width = latent_cache.shape[2]
    if query.shape[2] != width:
        raise ValueError(
            f"query rows hold {query.shape[2]} values but latent_cache rows hold {width}"
        )
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int):
        raise ValueError(f"kv_lora_rank={kv_lora_rank!r} must be an integer")
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be in [1, {width - 1}]")
    check_positive("scale", scale)
    return float(scale)


def check_mla_attention(
    q_nope, q_rope, latent_cache, block_tables, seq_lens, w_uk, w_uv, scale, *, check_values=True
) -> float:
    """q_nope [num_seqs, H, nope_dim], q_rope [num_seqs, H, rope_dim], w_uk [H, nope_dim,
    kv_lora_rank], w_uv [H, v_head_dim, kv_lora_rank], a latent cache of q_nope's dtype whose
    rows hold kv_lora_rank + rope_dim values. Returns the scale."""
    check_decode_batch(
        q_nope, "latent_cache", latent_cache, block_tables, seq_lens,
        cache_ndim=3, check_values=check_values,
    )
    _check_like("q_rope", q_rope, "q_nope", q_nope, shape=False)
    num_seqs, num_heads, nope_dim = q_nope.shape
    if q_rope.dim() != 3 or q_rope.shape[:2] != (num_seqs, num_heads):
        raise ValueError(
            f"q_rope must have shape [{num_seqs}, {num_heads}, rope_dim], "
            f"got {tuple(q_rope.shape)}"
        )
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        _check_tensor(name, w, 3, FLOAT_DTYPES)
        _check_device(name, w, q_nope.device)
    rank = latent_cache.shape[2] - q_rope.shape[2]
    if w_uk.shape != (num_heads, nope_dim, rank):
        raise ValueError(
            f"w_uk must have shape [num_heads, nope_dim, kv_lora_rank] = "
            f"{(num_heads, nope_dim, rank)}, got {tuple(w_uk.shape)}"
        )
    if w_uv.shape[0] != num_heads or w_uv.shape[2] != rank:
        raise ValueError(
            f"w_uv must have shape [num_heads={num_heads}, v_head_dim, kv_lora_rank={rank}], "
            f"got {tuple(w_uv.shape)}"
        )
    check_positive("scale", scale)
    return float(scale)


def cache_latent(c_kv, k_rope, latent_cache, slot_mapping) -> None:
    """Write each new token's row [c_kv ‖ k_rope] into its slot; a negative slot is skipped.

    c_kv [num_tokens, kv_lora_rank], k_rope [num_tokens, rope_dim], slot_mapping int64
    [num_tokens]. Plain torch indexing: writing a row is not what this chapter is about.
    """
    check_cache_latent(c_kv, k_rope, latent_cache, slot_mapping)
    block_size = latent_cache.shape[1]
    keep = slot_mapping >= 0
    blocks, offsets = slot_mapping[keep] // block_size, slot_mapping[keep] % block_size
    latent_cache[blocks, offsets] = torch.cat([c_kv[keep], k_rope[keep]], dim=-1)


def mla_decode(query, latent_cache, block_tables, seq_lens, *, kv_lora_rank: int, scale):
    """Absorbed MLA decode: softmax(scale * query·row) over each sequence's cached rows, times
    the rows' latent part. query [num_seqs, H, kv_lora_rank + rope_dim] = [q_latent ‖ q_rope]
    -> [num_seqs, H, kv_lora_rank] in query's dtype, still in latent space."""
    scale = check_mla_decode(query, latent_cache, block_tables, seq_lens, kv_lora_rank, scale)
    out = query.new_empty(*query.shape[:2], kv_lora_rank)  # [num_seqs, H, kv_lora_rank]
    for i, seq_len in enumerate(seq_lens.tolist()):
        rows = gather_kv(latent_cache, block_tables[i], seq_len).float()  # [seq_len, C + R]
        probs = (query[i].float() @ rows.T * scale).softmax(dim=-1)  # [H, seq_len]
        out[i] = (probs @ rows[:, :kv_lora_rank]).to(query.dtype)  # [H, C]
    return out


def mla_attention(q_nope, q_rope, latent_cache, block_tables, seq_lens, w_uk, w_uv, *, scale):
    """MLA decode without absorption: expand each cached latent to every head's key and value,
    then plain attention. q_nope [num_seqs, H, nope_dim], q_rope [num_seqs, H, rope_dim]
    -> [num_seqs, H, v_head_dim] in q_nope's dtype."""
    scale = check_mla_attention(
        q_nope, q_rope, latent_cache, block_tables, seq_lens, w_uk, w_uv, scale
    )
    rank = w_uk.shape[2]
    w_uk, w_uv = w_uk.float(), w_uv.float()
    out = q_nope.new_empty(*q_nope.shape[:2], w_uv.shape[1])  # [num_seqs, H, v_head_dim]
    for i, seq_len in enumerate(seq_lens.tolist()):
        rows = gather_kv(latent_cache, block_tables[i], seq_len).float()  # [seq_len, C + R]
        c, k_rope = rows[:, :rank], rows[:, rank:]  # [seq_len, C], [seq_len, R]
        k_nope = torch.einsum("hnc,tc->htn", w_uk, c)  # [H, seq_len, nope_dim]
        v = torch.einsum("hvc,tc->htv", w_uv, c)  # [H, seq_len, v_head_dim]
        logits = torch.einsum("hn,htn->ht", q_nope[i].float(), k_nope)  # [H, seq_len]
        logits += q_rope[i].float() @ k_rope.T  # the RoPE key, shared by every head
        probs = (logits * scale).softmax(dim=-1)  # [H, seq_len]
        out[i] = torch.einsum("ht,htv->hv", probs, v).to(q_nope.dtype)  # [H, v_head_dim]
    return out


@dataclass
class MLADecodeInputs:
    """The arguments of ``mla_attention`` for one decode step."""

    q_nope: Tensor  # [num_seqs, num_heads, nope_dim]
    q_rope: Tensor  # [num_seqs, num_heads, rope_dim]
    latent_cache: Tensor  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_tables: Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: Tensor  # int32 [num_seqs]
    w_uk: Tensor  # [num_heads, nope_dim, kv_lora_rank]
    w_uv: Tensor  # [num_heads, v_head_dim, kv_lora_rank]
    scale: float  # 1 / sqrt(nope_dim + rope_dim): the un-absorbed query's head dim

    def args(self) -> tuple[Tensor, ...]:
        return (
            self.q_nope, self.q_rope, self.latent_cache, self.block_tables, self.seq_lens,
            self.w_uk, self.w_uv,
        )


def random_mla_inputs(
    seq_lens, *, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int,
    v_head_dim: int, block_size: int, dtype=torch.float32, device=None, layout="permuted",
    seed: int = 0,
) -> MLADecodeInputs:
    """Gaussian queries and latent rows in a paged cache laid out as by
    :func:`~pagedlab.kernels.inputs.random_paged_inputs` (unused slots hold NaN), and
    up-projections scaled by 1/sqrt(kv_lora_rank), so that keys and values have unit scale."""
    width = kv_lora_rank + rope_dim
    x = random_paged_inputs(
        seq_lens, num_heads=1, num_kv_heads=1, head_dim=width, block_size=block_size,
        dtype=dtype, device=device, layout=layout, seed=seed,
    )
    g = torch.Generator(device=x.seq_lens.device).manual_seed(seed + 1)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=g.device) * std).to(dtype)

    num_seqs = len(x.seq_lens)
    return MLADecodeInputs(
        q_nope=randn(num_seqs, num_heads, nope_dim),
        q_rope=randn(num_seqs, num_heads, rope_dim),
        latent_cache=x.key_cache[:, :, 0],  # one "KV head" as wide as a row: [blocks, B, width]
        block_tables=x.block_tables,
        seq_lens=x.seq_lens,
        w_uk=randn(num_heads, nope_dim, kv_lora_rank, std=kv_lora_rank**-0.5),
        w_uv=randn(num_heads, v_head_dim, kv_lora_rank, std=kv_lora_rank**-0.5),
        scale=(nope_dim + rope_dim) ** -0.5,
    )
