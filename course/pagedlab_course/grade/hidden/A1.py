"""Hidden checks of A1: random shapes, block sizes and logit scales against float64 torch."""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedlab import softmax as lib
from pagedlab_course.grade import task
from pagedlab_course.grade.checks import GRADING

shapes = st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 17))  # rows, n, block


def logits(rows, n, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=g) * scale  # [rows, n]


def close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs().max().item()
    assert torch.isfinite(actual).all() and err < 1e-5, f"{what}: max error {err:.3g} (allowed 1e-5)"


scales = st.sampled_from([1.0, 30.0, 1000.0])  # 1000: exp overflows without the max


def equals_softmax(softmax, shape, scale, seed):
    rows, n, bs = shape
    x = logits(rows, n, scale, seed)
    close(softmax(x, bs), torch.softmax(x.double(), -1),
          f"{rows}x{n} logits (scale {scale}), blocks of {bs}")


@task("A1.1")
@GRADING
@given(shapes, scales, st.integers(0, 10**6))
def check_block_stats(nb, shape, scale, seed):
    """Block statistics for any length, block size and logit scale (a partial last block)."""
    rows, n, bs = shape
    x = logits(rows, n, scale, seed)
    m, l = nb.block_stats(x, bs)
    m_ref, l_ref = lib.block_stats(x, bs)
    close(m, m_ref, f"block maxima of {rows}x{n} logits in blocks of {bs}")
    close(l, l_ref, f"block sums of {rows}x{n} logits in blocks of {bs}")


@task("A1.2")
@GRADING
@given(shapes, scales, st.integers(0, 10**6))
def check_blockwise_softmax(nb, shape, scale, seed):
    """Block-wise softmax equals softmax for any length, block size and logit scale."""
    equals_softmax(nb.blockwise_softmax, shape, scale, seed)


@task("A1.3")
@GRADING
@given(shapes, scales, st.integers(0, 10**6))
def check_online_softmax(nb, shape, scale, seed):
    """Online softmax equals softmax for any length, block size and logit scale."""
    equals_softmax(nb.online_softmax, shape, scale, seed)



@task("A1.4")
@GRADING
@given(st.integers(1, 30), st.integers(1, 9), st.sampled_from([1, 4, 8]), scales, st.integers(0, 10**6))
def check_online_attention(nb, n, bs, d, scale, seed):
    """Online attention equals softmax(k q / sqrt(d)) v for any length, block size, width and scale."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=g) * math.sqrt(scale)
    k = torch.randn(n, d, generator=g) * math.sqrt(scale)
    v = torch.randn(n, d + 1, generator=g)
    expected = torch.softmax(k.double() @ q.double() / math.sqrt(d), -1) @ v.double()  # [d + 1]
    close(nb.online_attention(q, k, v, bs), expected, f"{n} keys of width {d} (scale {scale}), blocks of {bs}")
