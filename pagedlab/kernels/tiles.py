"""What every decode kernel shares: tile sizes, tl.dot's operand dtype, and the loop's steps.

The host-side pieces (``TILE_TOKENS``, ``dot_pad``, ``dot_dtype``) serve every kernel. The
``@triton.jit`` steps serve chapter 11's kernels (two-pass, fp8, MLA), so that each reads as its
own idea (a second pass, scales, a latent cache) around the same few calls: find a tile's slots
through the block table, compute a group's logits, fold a tile into the online softmax.
:mod:`pagedlab.kernels.decode` spells the same steps out inline on purpose: chapter 7 reads that
kernel top to bottom as the book's one complete example.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedlab.device import INTERPRET
from pagedlab.dtypes import dtype_name
__all__ = [
    "TILE_TOKENS", "MIN_DOT", "check_launchable", "dot_dtype", "dot_pad", "decode_meta",
    "decode_strides",
]

TILE_TOKENS = 32  # tokens per loop iteration, whatever the cache's block size
MIN_DOT = 16  # smallest tl.dot dimension the GPU compiler accepts for 16-bit inputs


def check_launchable(tensor: torch.Tensor) -> None:
    """Raise before a launch that cannot run here, with what to do instead.

    Without the interpreter a Triton kernel needs CUDA tensors (a CPU tensor on a machine with
    a GPU would otherwise fail deep in the launcher). With it, Triton's library functions
    (tl.sum, tl.max, ...) must have been decorated after TRITON_INTERPRET=1 was set, which
    fails when triton was imported before pagedlab set the flag.
    """
    if not INTERPRET and not tensor.is_cuda:
        raise ValueError(
            f"Triton kernels need CUDA tensors, got tensors on {tensor.device}: move them to "
            "CUDA, call pagedlab.kernels.reference, or set TRITON_INTERPRET=1 before "
            "importing pagedlab"
        )
    if INTERPRET and not isinstance(tl.sum, InterpretedFunction):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its library functions "
            "cannot run in the interpreter: import pagedlab before triton (and before anything "
            "that imports it, such as torch.compile), or set TRITON_INTERPRET=1 in the environment"
        )


def dot_pad(n: int) -> int:
    """``n`` rounded up to a power of two >= 16: a tile dimension that ``tl.dot`` accepts."""
    return max(MIN_DOT, triton.next_power_of_2(n))


def dot_dtype(dtype: torch.dtype) -> tuple:
    """``tl.dot``'s operand dtype and input precision for queries of ``dtype``.

    The query's own dtype, except fp32 for bf16 in the interpreter (whose dot multiplies bf16
    bit patterns as integers); fp32 operands use "ieee", so no TF32 rounding.
    """
    fp32 = dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16)
    return (tl.float32, "ieee") if fp32 else (tl.dtype(dtype_name(dtype)), "tf32")



def decode_meta(query, key_cache) -> dict:
    """Compile-time constants of a decode kernel over a [blocks, block_size, kv_heads, dim]
    cache for queries [num_seqs, num_heads, dim]: one place, so every kernel pads alike."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads  # query heads per KV head
    dot, precision = dot_dtype(query.dtype)
    return dict(
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        GROUP_PAD=dot_pad(group),
        DIM_PAD=dot_pad(head_dim),
        TILE=TILE_TOKENS,
        DOT_DTYPE=dot,
        PRECISION=precision,
    )


def decode_strides(query, key_cache, block_tables) -> tuple:
    """The strides a decode kernel takes, in its argument order: query (seq, head), cache
    (block, token, head), block table (seq, entry), so that views of any of them read right."""
    return (*query.stride()[:2], *key_cache.stride()[:3], *block_tables.stride())

@triton.jit
def tile_slots(
    table_row,  # pointer to this sequence's row of block_tables
    stride_entry,  # block_tables' stride between a row's entries
    tile_start,
    end,  # tokens at or past `end` are masked
    stride_block,
    stride_token,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    """Cache offsets [TILE] of tokens tile_start ... tile_start + TILE - 1, and which exist."""
    tokens = tile_start + tl.arange(0, TILE)  # [TILE] logical positions
    tok_ok = tokens < end
    # Block ids become int64 before the multiply: num_blocks * stride can exceed 2**31.
    entries = table_row + (tokens // BLOCK_SIZE) * stride_entry
    block_ids = tl.load(entries, mask=tok_ok, other=0).to(tl.int64)
    return block_ids * stride_block + (tokens % BLOCK_SIZE) * stride_token, tok_ok


@triton.jit
def group_logits(q, k, scale, tok_ok, PRECISION: tl.constexpr):
    """Scaled logits [ROWS, TILE] of queries q [ROWS, D] against keys k [TILE, D], fp32;
    tokens that do not exist get -inf, so their softmax weight is exactly 0."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    return tl.where(tok_ok[None, :], s, float("-inf"))


@triton.jit
def online_softmax_step(m, l, acc, s, v, PRECISION: tl.constexpr):
    """Fold a tile of logits s [ROWS, TILE] and values v [TILE, D] into the running max m
    [ROWS], sum l [ROWS] and weighted sum acc [ROWS, D] (chapter 3's online softmax)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile holds a token
    alpha = tl.exp(m - m_new)  # rescales what was accumulated against the old max
    p = tl.exp(s - m_new[:, None])  # [ROWS, TILE]
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc
