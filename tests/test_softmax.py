"""pagedlab.softmax against torch: every form of softmax and attention, the log-sum-exp merge,
numerical stability, and argument checks.

References are torch's own functions evaluated in float64 (``torch.softmax``,
``scaled_dot_product_attention``, ``torch.logsumexp``), never pagedlab code.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlab import softmax as sm

U32 = 2.0**-24  # fp32 unit roundoff
SOFTMAXES = [sm.blockwise_softmax, sm.online_softmax]
ATTENTIONS = [sm.blockwise_attention, sm.online_attention]


def logits(n: int, scale: float = 1.0, seed: int = 0, rows: int = 2, order: str = "random"):
    """[rows, n] fp32 Gaussian logits times ``scale``; "ascending" raises the max at every step."""
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * scale
    if order == "ascending":
        x = x.sort(-1).values
    elif order == "descending":
        x = x.sort(-1, descending=True).values
    return x


def re_shape(shape) -> str:
    """A shape as printed in the error messages, escaped for pytest.raises(match=...)."""
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def max_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (y.double() - ref.double()).abs().max().item()


def softmax_tol(fn, n: int, block_size: int, compute_dtype=None) -> float:
    """1e-6 for the references (float64 statistics by default). With fp32 statistics, as a
    kernel keeps them, the online form adds the worst case of its T sequential fp32 updates of
    the running sum (one add and one rescale per block: 2·T·u relative), about 1e-5 at
    T = 4096 blocks; the block-wise form sums its blocks with torch and stays within 1e-6.
    """
    fp32_online = fn is sm.online_softmax and compute_dtype == torch.float32
    return 1e-6 + (2 * math.ceil(n / block_size) * U32 if fp32_online else 0.0)


def attention_inputs(lead, n, d, dv, q_scale, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, d, generator=g) * q_scale  # [..., d]
    k = torch.randn(*lead, n, d, generator=g)  # [..., n, d]
    v = torch.randn(*lead, n, dv, generator=g)  # [..., n, dv]
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sdpa(q, k, v, scale=None):
    """torch's attention for one query per row, in float64: q [..., d] -> [..., dv]."""
    q, k, v = q.double(), k.double(), v.double()
    return F.scaled_dot_product_attention(q.unsqueeze(-2), k, v, scale=scale).squeeze(-2)


def attention_tol(v, n, block_size):
    """Softmax's budget (1e-5 covering fp32 rounding of the logits), scaled by the largest value."""
    return (1e-5 + 2 * math.ceil(n / block_size) * U32) * v.abs().max().item()


# --------------------------------------------------------------------------------------------
# Softmax


length_and_block = st.integers(1, 4096).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(1, n + 16))
)


@settings(deadline=None, max_examples=60)
@given(
    nb=length_and_block,
    log_scale=st.floats(-3, 4),  # logit magnitudes from 1e-3 to 1e4
    order=st.sampled_from(["random", "ascending", "descending"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_softmax_matches_torch(nb, log_scale, order, seed):
    n, block_size = nb
    x = logits(n, 10.0**log_scale, seed, order=order)
    ref = torch.softmax(x.double(), -1)
    for fn in SOFTMAXES:
        for compute_dtype in (None, torch.float32):  # the reference's and a kernel's statistics
            y = fn(x, block_size, compute_dtype=compute_dtype)
            assert y.dtype == torch.float32 and y.shape == x.shape
            assert max_err(y, ref) <= softmax_tol(fn, n, block_size, compute_dtype), fn.__name__
        assert max_err(fn(x, block_size), torch.softmax(x, -1)) <= 1e-6  # torch's own fp32


@pytest.mark.parametrize("fn", SOFTMAXES)
def test_softmax_every_small_length_and_block_size(fn):
    """Exhaustive for n <= 64: every block size from 1 to past the length."""
    x = logits(64, scale=8.0)
    for n in range(1, 65):
        ref = torch.softmax(x[:, :n].double(), -1)
        for block_size in range(1, n + 3):
            err = max_err(fn(x[:, :n], block_size), ref)
            assert err <= softmax_tol(fn, n, block_size), (n, block_size, err)


@pytest.mark.parametrize(
    "fn, block_sizes", [(sm.blockwise_softmax, (1, 16, 4096)), (sm.online_softmax, (256,))]
)
def test_softmax_every_length_to_4096(fn, block_sizes):
    """Every length 1..4096 for a few block sizes (the online loop is slow at small blocks;
    the hypothesis test above draws the block size for any length)."""
    x = logits(4096, scale=5.0, rows=1)
    for n in range(1, 4097):
        ref = torch.softmax(x[:, :n].double(), -1)
        for block_size in block_sizes:
            err = max_err(fn(x[:, :n], block_size), ref)
            assert err <= softmax_tol(fn, n, block_size), (n, block_size, err)


@pytest.mark.parametrize("fn", SOFTMAXES)
def test_softmax_extreme_logits_and_masks(fn):
    x = torch.tensor([[1e4, -1e4, 0.0, 9999.0, -3e4], [-1e4] * 5])
    x_masked = torch.tensor([[-math.inf] * 5 + [1.0, 2.0, -math.inf, 0.5]])  # whole blocks masked
    for block_size in (1, 2, 3, 5, 9):
        for xx in (x, x_masked):
            assert max_err(fn(xx, block_size), torch.softmax(xx.double(), -1)) <= 1e-6


@pytest.mark.parametrize("fn", SOFTMAXES)
def test_softmax_leading_dims_and_dtypes(fn):
    x = logits(37, scale=3.0, rows=6).reshape(2, 3, 37)
    assert max_err(fn(x, 8), torch.softmax(x.double(), -1)) <= 1e-6
    x64 = x.double()
    assert fn(x64, 8).dtype == torch.float64  # upcast never downcasts
    assert max_err(fn(x64, 8), torch.softmax(x64, -1)) <= 1e-14
    for dtype, tol in ((torch.float16, 1e-3), (torch.bfloat16, 8e-3)):
        xd = x.to(dtype)
        y = fn(xd, 8)
        assert y.dtype == dtype
        assert max_err(y, torch.softmax(xd.double(), -1)) <= tol


@pytest.mark.parametrize("fn", SOFTMAXES)
@pytest.mark.parametrize("dtype, u", [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)])
def test_low_precision_inputs_are_rounded_once(fn, dtype, u):
    """fp16/bf16 in, statistics in fp32: only the final rounding (half an ulp) remains."""
    x = logits(1024, scale=5.0).to(dtype)
    ref = torch.softmax(x.double(), -1)
    for block_size in (1, 16):
        err = (fn(x, block_size).double() - ref).abs()  # [2, 1024]
        assert (err <= ref * u + 1e-6).all(), (block_size, err.max().item())


def test_block_stats_match_definition():
    x = logits(10, scale=4.0)
    m_b, l_b = sm.block_stats(x, 4)  # blocks [0:4], [4:8], [8:10], in float64
    for b, blk in enumerate(x.double().split(4, dim=-1)):
        assert torch.equal(m_b[:, b], blk.amax(-1))
        assert torch.allclose(l_b[:, b], torch.exp(blk - blk.amax(-1, keepdim=True)).sum(-1))


# --------------------------------------------------------------------------------------------
# Numerical stability


def test_naive_softmax_overflows_in_fp16_where_stable_forms_do_not():
    x = torch.tensor([[3.0, 8.0, 12.0, 15.0], [0.5, 11.5, 2.0, 1.0]])  # exp(12) > 65504
    naive = sm.naive_softmax(x.half())
    assert not torch.isfinite(naive[0]).all()
    ref = torch.softmax(x.double(), -1)
    for fn in SOFTMAXES:
        for compute_dtype in (None, torch.float16):  # stable even with fp16 arithmetic
            y = fn(x.half(), 2, compute_dtype=compute_dtype)
            assert torch.isfinite(y).all() and max_err(y, ref) <= 1e-3
    assert max_err(sm.naive_softmax(x), ref) <= 1e-6  # the formula is right, only its range fails


def test_naive_softmax_overflows_in_fp32_too():
    x = torch.tensor([10.0, 89.0, 100.0])  # exp(89) > fp32 max
    assert torch.isnan(sm.naive_softmax(x)).any()
    for fn in SOFTMAXES:
        assert max_err(fn(x, 1), torch.softmax(x.double(), -1)) <= 1e-6


def test_attention_with_fp16_logits_beyond_exp_range():
    q, k, v = attention_inputs((2,), n=50, d=16, dv=8, q_scale=20.0, seed=1)
    s = (k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(16)  # [2, 50]
    assert s.abs().max() > 12  # exp(logit) would overflow fp16
    for fn in ATTENTIONS:
        y = fn(q.half(), k.half(), v.half(), 16)
        assert y.dtype == torch.float16 and torch.isfinite(y).all()
        assert max_err(y, sdpa(q.half(), k.half(), v.half())) <= 2e-2


# --------------------------------------------------------------------------------------------
# Attention


@settings(deadline=None, max_examples=40)
@given(
    n=st.integers(1, 512),
    block_size=st.integers(1, 64),
    d=st.sampled_from([1, 8, 64]),
    dv=st.sampled_from([1, 16]),
    q_scale=st.floats(0.1, 5.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_attention_matches_sdpa(n, block_size, d, dv, q_scale, seed):
    q, k, v = attention_inputs((2, 3), n, d, dv, q_scale, seed)
    ref = sdpa(q, k, v)
    for fn in ATTENTIONS:
        out = fn(q, k, v, block_size)
        assert out.shape == (2, 3, dv) and out.dtype == torch.float32
        assert max_err(out, ref) <= attention_tol(v, n, block_size), fn.__name__


@pytest.mark.parametrize("fn", ATTENTIONS)
def test_attention_scale_lse_and_dtypes(fn):
    q, k, v = attention_inputs((4,), n=40, d=32, dv=32, q_scale=1.0, seed=2)
    out, lse = fn(q, k, v, 16, scale=0.3, return_lse=True)
    assert max_err(out, sdpa(q, k, v, scale=0.3)) <= 1e-5
    ref_lse = torch.logsumexp((k.double() @ q.double().unsqueeze(-1)).squeeze(-1) * 0.3, -1)
    assert max_err(lse, ref_lse) <= 1e-5
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        y = fn(qd, kd, vd, 16)
        assert y.dtype == dtype and max_err(y, sdpa(qd, kd, vd)) <= tol


# --------------------------------------------------------------------------------------------
# Log-sum-exp merge (split-KV)


@settings(deadline=None, max_examples=40)
@given(
    n=st.integers(2, 300),
    cuts=st.lists(st.floats(0, 1), min_size=1, max_size=4),
    block_size=st.integers(1, 32),
    seed=st.integers(0, 2**31 - 1),
)
def test_merge_of_any_split_equals_unsplit(n, cuts, block_size, seed):
    q, k, v = attention_inputs((3,), n, 16, 8, 2.0, seed)
    bounds = sorted({0, n, *(1 + int(c * (n - 1)) for c in cuts)})
    out = lse = None
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        fn = ATTENTIONS[i % 2]  # mix the two forms across splits
        o, s = fn(q, k[..., lo:hi, :], v[..., lo:hi, :], block_size, return_lse=True)
        out, lse = (o, s) if out is None else sm.merge_attention_states(out, lse, o, s)
    assert max_err(out, sdpa(q, k, v)) <= attention_tol(v, n, block_size)
    ref_lse = torch.logsumexp((k.double() @ q.double().unsqueeze(-1)).squeeze(-1) / 4, -1)
    assert max_err(lse, ref_lse) <= 1e-5


def test_merge_of_torch_partials():
    """The merge alone, fed by torch's attention and logsumexp on the two halves."""
    q, k, v = attention_inputs((5,), n=30, d=8, dv=4, q_scale=3.0, seed=4)
    s = (k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(8)  # [5, 30]
    parts = [
        (sdpa(q, k[:, a:b], v[:, a:b]).float(), torch.logsumexp(s[:, a:b], -1))
        for a, b in ((0, 11), (11, 30))
    ]
    out, lse = sm.merge_attention_states(*parts[0], *parts[1])
    assert max_err(out, sdpa(q, k, v)) <= 1e-6
    assert max_err(lse, torch.logsumexp(s.double(), -1)) <= 1e-5
    swapped, _ = sm.merge_attention_states(*parts[1], *parts[0])
    assert max_err(swapped, out) <= 1e-6


# --------------------------------------------------------------------------------------------
# Argument checks


@pytest.mark.parametrize("fn", SOFTMAXES + [sm.block_stats])
@pytest.mark.parametrize("block_size", [0, -3, 2.5, True])
def test_bad_block_size(fn, block_size):
    with pytest.raises(ValueError, match="block_size"):
        fn(torch.randn(2, 8), block_size)


@pytest.mark.parametrize("fn", SOFTMAXES + [sm.block_stats])
@pytest.mark.parametrize("shape", [(3, 0), ()])
def test_empty_last_dimension(fn, shape):
    with pytest.raises(ValueError, match=rf"x .*{re_shape(shape)}"):
        fn(torch.randn(shape), 4)


def test_naive_softmax_empty_last_dimension():
    with pytest.raises(ValueError, match=r"x .*\(2, 0\)"):
        sm.naive_softmax(torch.randn(2, 0))


@pytest.mark.parametrize("fn", ATTENTIONS)
@pytest.mark.parametrize(
    "shapes, name",
    [
        (((2, 8), (2, 5, 7), (2, 5, 7)), "k"),  # head dims differ
        (((2, 8), (3, 5, 8), (3, 5, 8)), "k"),  # leading dims differ
        (((8,), (2, 5, 8), (2, 5, 8)), "k"),  # k has an extra dim
        (((2, 8), (2, 0, 8), (2, 0, 8)), "k"),  # no keys
        (((2, 8), (2, 5, 8), (2, 4, 8)), "v"),  # v has a different n
        (((2, 0), (2, 5, 0), (2, 5, 0)), "q"),  # empty head dim
    ],
)
def test_attention_shape_mismatch(fn, shapes, name):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=rf"^{name} must .*{re_shape(shapes[0])}"):
        fn(q, k, v, 4)


def test_attention_bad_block_size():
    q, k, v = attention_inputs((2,), 5, 4, 4, 1.0, 0)
    for fn in ATTENTIONS:
        with pytest.raises(ValueError, match="block_size"):
            fn(q, k, v, 0)


@pytest.mark.parametrize(
    "shapes, name",
    [
        (((2, 4), (2,), (3, 4), (3,)), "out_b"),
        (((2, 4), (2, 1), (2, 4), (2,)), "lse_a"),
        (((2, 4), (2,), (2, 4), (4,)), "lse_b"),
    ],
)
def test_merge_shape_mismatch(shapes, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        sm.merge_attention_states(*(torch.randn(s) for s in shapes))
