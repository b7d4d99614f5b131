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


def _check_logits(x: Tensor, name: str = "x") -> None:
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {tuple(x.shape)}")


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


def _split_blocks(x: Tensor, block_size: int, dim: int, fill: float) -> Tensor:
    """View dimension ``dim`` of length n as [num_blocks, block_size], padding the last block.

    Padding with -inf (logits) or 0 (values) makes the padded slots contribute nothing.
    """
    n = x.shape[dim]
    num_blocks = -(-n // block_size)
    pad = [0, 0] * (-dim - 1) + [0, num_blocks * block_size - n]
    return F.pad(x, pad, value=fill).unflatten(dim, (num_blocks, block_size))


def _logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Attention logits q·k_j·scale for every key j: q [..., d], k [..., n, d] -> [..., n]."""
    return (k @ q.unsqueeze(-1)).squeeze(-1) * scale


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


def block_stats(x: Tensor, block_size: int, *, compute_dtype=torch.float32):
    """Per-block max m_b and per-block sum l_b = sum_j exp(x_j - m_b) over the last dimension.

    x [..., n] -> (m_b, l_b), each [..., num_blocks]; the last block may be partial.
    """
    _check_logits(x)
    _check_block_size(block_size)
    xb = _split_blocks(x.to(compute_dtype), block_size, dim=-1, fill=-math.inf)  # [..., nb, B]
    m_b = xb.amax(-1)  # [..., nb]
    l_b = _exp_sub(xb, m_b.unsqueeze(-1)).sum(-1)  # [..., nb]
    return m_b, l_b


def blockwise_softmax(x: Tensor, block_size: int, *, compute_dtype=torch.float32) -> Tensor:
    """Softmax from independent block statistics, combined through the global max.

    m = max_b m_b and l = sum_b exp(m_b - m) * l_b; the output is exp(x - m) / l.
    ``compute_dtype`` is the arithmetic's dtype (fp32, as a kernel would); the result has x's.
    """
    m_b, l_b = block_stats(x, block_size, compute_dtype=compute_dtype)  # [..., nb] each
    m = m_b.amax(-1, keepdim=True)  # [..., 1], the global max
    l = (_exp_sub(m_b, m) * l_b).sum(-1, keepdim=True)  # [..., 1]
    return (_exp_sub(x.to(compute_dtype), m) / l).to(x.dtype)


def online_softmax(x: Tensor, block_size: int, *, compute_dtype=torch.float32) -> Tensor:
    """Softmax with one pass over the blocks for the normaliser (Milakov & Gimelshein, 2018).

    Keeps a running max m and a running sum l; when a block raises the max, l is rescaled by
    exp(m_old - m_new). A second, elementwise pass writes exp(x - m) / l.
    """
    _check_logits(x)
    _check_block_size(block_size)
    xc = x.to(compute_dtype)
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
    compute_dtype=torch.float32,
):
    """softmax(q·kᵀ·scale)·v from independent key blocks, combined through the global max.

    q [..., d], k [..., n, d], v [..., n, dv] -> [..., dv] in q's dtype (and the fp32
    log-sum-exp [...] of the logits if ``return_lse``). Each block b yields its max m_b,
    its sum l_b and its unnormalised output o_b = sum_j exp(s_j - m_b) v_j; then
    out = sum_b exp(m_b - m) o_b / sum_b exp(m_b - m) l_b.
    """
    _check_qkv(q, k, v)
    _check_block_size(block_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    s = _split_blocks(_logits(q, k, scale), block_size, dim=-1, fill=-math.inf)  # [..., nb, B]
    vb = _split_blocks(v, block_size, dim=-2, fill=0.0)  # [..., nb, B, dv]
    m_b = s.amax(-1)  # [..., nb]
    p = _exp_sub(s, m_b.unsqueeze(-1))  # [..., nb, B]
    l_b = p.sum(-1)  # [..., nb]
    o_b = (p.unsqueeze(-2) @ vb).squeeze(-2)  # [..., nb, dv]
    m = m_b.amax(-1, keepdim=True)  # [..., 1]
    w = _exp_sub(m_b, m)  # [..., nb], each block's rescaling factor exp(m_b - m)
    acc = (w.unsqueeze(-1) * o_b).sum(-2)  # [..., dv]
    return _finish(acc, m.squeeze(-1), (w * l_b).sum(-1), k.new_empty(0).dtype if False else _out_dtype(q), return_lse)
