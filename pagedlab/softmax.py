"""Softmax and attention computed block by block: the references the paged decode kernel follows.

Three softmaxes over the last dimension, each a readable spec rather than a fast path:

- :func:`naive_softmax`: ``exp(x) / sum(exp(x))`` with no max subtracted; overflows in fp16.
- :func:`blockwise_softmax`: per-block max and sum, all blocks at once, combined afterwards.
- :func:`online_softmax`: one pass over the blocks with a running max and a running sum.

and their attention counterparts for one query against ``n`` keys (:func:`blockwise_attention`,
:func:`online_attention`), plus :func:`merge_attention_states`, the log-sum-exp merge of two
partial results that split-KV (flash-decoding) kernels use. Chapter 3 derives and proves them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedlab._arith import cdiv

__all__ = [
    "naive_softmax",
    "block_stats",
    "blockwise_softmax",
    "online_softmax",
    "blockwise_attention",
    "online_attention",
    "merge_attention_states",
]


# ---------------------------------------------------------------------------------------------
# Validation


def _check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _check_logits(x: Tensor) -> None:
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q [..., d], k [..., n, d], v [..., n, dv] with the same leading dims and n >= 1."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() == 0 or q.shape[-1] == 0:
        raise ValueError(f"q must have shape [..., d] with d >= 1, got {shapes}")
    if k.dim() != q.dim() + 1 or k.shape[:-2] != q.shape[:-1] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have shape [..., n, d] matching q [..., d], got {shapes}")
    if k.shape[-2] == 0:
        raise ValueError(f"k must hold at least one key (n >= 1), got {shapes}")
    if v.dim() != k.dim() or v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v must have shape [..., n, dv] matching k [..., n, d], got {shapes}")


# ---------------------------------------------------------------------------------------------
# Shared pieces


def _exp_sub(x: Tensor, m: Tensor) -> Tensor:
    """exp(x - m) for a max m of x; a max of -inf (every logit masked) gives 0, not nan."""
    return torch.exp(x - torch.where(m == -math.inf, 0.0, m))


def _upcast(t: Tensor, compute_dtype: torch.dtype | None) -> Tensor:
    """t in ``compute_dtype``, by default float64: a reference computes the exact math.

    Pass ``torch.float32`` to see what a kernel's fp32 running statistics do (Chapter 3's figure).
    """
    return t.to(compute_dtype or torch.float64)


def _split_blocks(x: Tensor, block_size: int, dim: int, fill: float) -> Tensor:
    """View dimension ``dim`` (negative) of length n as [num_blocks, block_size], padding the end.

    Padding with -inf (logits) or 0 (values) makes the padded slots contribute nothing.
    """
    n = x.shape[dim]
    num_blocks = cdiv(n, block_size)
    pad = [0, 0] * (-dim - 1) + [0, num_blocks * block_size - n]
    return F.pad(x, pad, value=fill).unflatten(dim, (num_blocks, block_size))


def _logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Attention logits q·k_j·scale for every key j: q [..., d], k [..., n, d] -> [..., n]."""
    return (k @ q.unsqueeze(-1)).squeeze(-1) * scale


def _block_weights(s: Tensor):
    """Per-block max m_b [..., nb] and weights p = exp(s - m_b) [..., nb, B] of blocked logits."""
    m_b = s.amax(-1)  # [..., nb]
    return m_b, _exp_sub(s, m_b.unsqueeze(-1))


def _global_max(m_b: Tensor):
    """Global max m [...] of the block maxima m_b [..., nb], and each block's exp(m_b - m)."""
    m = m_b.amax(-1)  # [...]
    return m, _exp_sub(m_b, m.unsqueeze(-1))


def _online_step(m: Tensor, l: Tensor, s: Tensor):
    """Fold one block of logits s [..., B] into the running max m and running sum l [...].

    Returns the new (m, l), the factor alpha = exp(m_old - m_new) [...] that rescales whatever
    was accumulated against the old max, and the block's weights p = exp(s - m_new) [..., B].
    """
    m_new = torch.maximum(m, s.amax(-1))  # [...]
    alpha = _exp_sub(m, m_new)  # [...], <= 1
    p = _exp_sub(s, m_new.unsqueeze(-1))  # [..., B], every exponent <= 0
    return m_new, l * alpha + p.sum(-1), alpha, p


# ---------------------------------------------------------------------------------------------
# Softmax over the last dimension


def naive_softmax(x: Tensor) -> Tensor:
    """The textbook formula exp(x) / sum(exp(x)) in x's own dtype: overflows for large logits.

    Kept only to show why every other form subtracts a max first.
    """
    _check_logits(x)
    e = torch.exp(x)  # [..., n], inf once x > log(dtype max)
    return e / e.sum(-1, keepdim=True)


def block_stats(x: Tensor, block_size: int, *, compute_dtype: torch.dtype | None = None):
    """Per-block max m_b and per-block sum l_b = sum_j exp(x_j - m_b) over the last dimension.

    x [..., n] -> (m_b, l_b), each [..., num_blocks]; the last block may be partial.
    """
    _check_logits(x)
    _check_block_size(block_size)
    xc = _upcast(x, compute_dtype)
    xb = _split_blocks(xc, block_size, dim=-1, fill=-math.inf)  # [..., nb, B]
    m_b, p = _block_weights(xb)  # [..., nb], [..., nb, B]
    return m_b, p.sum(-1)


def blockwise_softmax(
    x: Tensor, block_size: int, *, compute_dtype: torch.dtype | None = None
) -> Tensor:
    """Softmax from independent block statistics, combined through the global max.

    m = max_b m_b and l = sum_b exp(m_b - m) * l_b; the output is exp(x - m) / l.
    The arithmetic runs in ``compute_dtype`` (default float64); the result has x's dtype.
    """
    m_b, l_b = block_stats(x, block_size, compute_dtype=compute_dtype)  # [..., nb] each
    m, w = _global_max(m_b)  # [...], [..., nb]
    l = (w * l_b).sum(-1)  # [...]
    return (_exp_sub(_upcast(x, compute_dtype), m.unsqueeze(-1)) / l.unsqueeze(-1)).to(x.dtype)


def online_softmax(
    x: Tensor, block_size: int, *, compute_dtype: torch.dtype | None = None
) -> Tensor:
    """Softmax with one pass over the blocks for the normaliser (Milakov & Gimelshein, 2018).

    Keeps a running max m and a running sum l; when a block raises the max, l is rescaled by
    exp(m_old - m_new). A second, elementwise pass writes exp(x - m) / l.
    """
    _check_logits(x)
    _check_block_size(block_size)
    xc = _upcast(x, compute_dtype)
    m = xc.new_full(x.shape[:-1], -math.inf)  # [...], running max
    l = xc.new_zeros(x.shape[:-1])  # [...], running sum of exp(x_j - m)
    for xb in xc.split(block_size, dim=-1):  # xb [..., B]
        m, l, _, _ = _online_step(m, l, xb)
    return (_exp_sub(xc, m.unsqueeze(-1)) / l.unsqueeze(-1)).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Attention of one query over n keys: softmax(q·kᵀ·scale)·v


def _finish(acc: Tensor, m: Tensor, l: Tensor, dtype, return_lse: bool):
    """Normalise the accumulated values; the log-sum-exp of the logits is m + log l."""
    out = (acc / l.unsqueeze(-1)).to(dtype)  # [..., dv]
    return (out, m + torch.log(l)) if return_lse else out


def blockwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_size: int,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype | None = None,
):
    """softmax(q·kᵀ·scale)·v from independent key blocks, combined through the global max.

    q [..., d], k [..., n, d], v [..., n, dv] -> [..., dv] in q's dtype (and, if
    ``return_lse``, the log-sum-exp of the logits [...] in ``compute_dtype``). Block b yields
    its max m_b, sum l_b and unnormalised output o_b = sum_j exp(s_j - m_b) v_j; then
    out = sum_b exp(m_b - m) o_b / sum_b exp(m_b - m) l_b with m = max_b m_b.
    """
    _check_qkv(q, k, v)
    _check_block_size(block_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc, vc = (_upcast(t, compute_dtype) for t in (q, k, v))
    s = _split_blocks(_logits(qc, kc, scale), block_size, dim=-1, fill=-math.inf)  # [..., nb, B]
    vb = _split_blocks(vc, block_size, dim=-2, fill=0.0)  # [..., nb, B, dv]
    m_b, p = _block_weights(s)  # [..., nb], [..., nb, B]
    o_b = (p.unsqueeze(-2) @ vb).squeeze(-2)  # [..., nb, dv]
    m, w = _global_max(m_b)  # [...], [..., nb]
    l = (w * p.sum(-1)).sum(-1)  # [...]
    acc = (w.unsqueeze(-1) * o_b).sum(-2)  # [..., dv]
    return _finish(acc, m, l, q.dtype, return_lse)


def online_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_size: int,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype | None = None,
):
    """softmax(q·kᵀ·scale)·v in one pass over the key blocks: the paged decode kernel's loop.

    Same shapes and result as :func:`blockwise_attention`. The state is a running max m, a
    running sum l and a running weighted sum of values acc; all of it is rescaled by
    exp(m_old - m_new) whenever a block raises the max.
    """
    _check_qkv(q, k, v)
    _check_block_size(block_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc, vc = (_upcast(t, compute_dtype) for t in (q, k, v))
    m = qc.new_full(q.shape[:-1], -math.inf)  # [...], running max
    l = qc.new_zeros(q.shape[:-1])  # [...], running sum of exp(s_j - m)
    acc = vc.new_zeros(v.shape[:-2] + v.shape[-1:])  # [..., dv], running sum of exp(s_j - m) v_j
    for kb, vb in zip(kc.split(block_size, dim=-2), vc.split(block_size, dim=-2)):
        # kb [..., B, d], vb [..., B, dv]
        m, l, alpha, p = _online_step(m, l, _logits(qc, kb, scale))
        acc = acc * alpha.unsqueeze(-1) + (p.unsqueeze(-2) @ vb).squeeze(-2)  # [..., dv]
    return _finish(acc, m, l, q.dtype, return_lse)


def merge_attention_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor):
    """Merge attention over two disjoint key sets from their outputs and log-sum-exps.

    out_* [..., dv], lse_* [...] -> (out [..., dv] in out_a's dtype, lse [...] in float64):
    lse = log(exp(lse_a) + exp(lse_b)) and out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
    This is how split-KV (flash-decoding) kernels combine the splits of a long context.
    """
    if out_b.shape != out_a.shape:
        raise ValueError(
            f"out_b must have out_a's shape {tuple(out_a.shape)}, got {tuple(out_b.shape)}"
        )
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.shape != out_a.shape[:-1]:
            raise ValueError(
                f"{name} must have shape {tuple(out_a.shape[:-1])} (out_a's without its last "
                f"dimension), got {tuple(lse.shape)}"
            )
    lse_a, lse_b = _upcast(lse_a, None), _upcast(lse_b, None)
    m = torch.maximum(lse_a, lse_b)  # [...]
    w_a, w_b = _exp_sub(lse_a, m), _exp_sub(lse_b, m)  # [...], each <= 1
    total = w_a + w_b  # [...], exp(lse - m)
    out = w_a.unsqueeze(-1) * _upcast(out_a, None) + w_b.unsqueeze(-1) * _upcast(out_b, None)
    return (out / total.unsqueeze(-1)).to(out_a.dtype), m + torch.log(total)
