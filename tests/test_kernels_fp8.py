"""The fp8 (e4m3) KV cache: the quantising writer, the decode kernel, and what fp8 costs.

The writer must produce torch's bytes exactly (it rounds in fp32 before its cast, so the
interpreter's own fp32 -> fp8 rounding never decides anything). The decode kernel is held to
the torch reference that dequantises the same bytes; against the unquantised fp16 cache it is
held to the issue's 5e-2 on unit-scale inputs, and its key and value loads to half of fp16's.
"""

import pytest
import torch

from pagedlab.device import DEVICE
from pagedlab.kernels import fp8, paged_attention, paged_attention_fp8, reshape_and_cache_fp8
from pagedlab.kernels import fp8_reference as ref
from pagedlab.kernels.inputs import random_paged_inputs
from pagedlab.kernels.traffic import CAN_COUNT, WHY_NOT, count_traffic

FP32, FP16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, ref.FP8


def make_inputs(lens, heads=(8, 2), head_dim=64, block_size=16, dtype=FP16, **kw):
    return random_paged_inputs(
        lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
        block_size=block_size, dtype=dtype, **kw,
    )


def bits(t):
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Writing


def test_e4m3_rounding_matches_torch_on_every_hard_case():
    """Ties (to even), carries into the exponent (7.9 -> 8), subnormals, saturation, ±0."""
    e4m3 = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(FP8).float()
    e4m3 = e4m3[e4m3.isfinite()].unique()  # every finite e4m3 value
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # exact ties
    near = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    x = torch.cat([e4m3, mids, near, torch.tensor([500.0, -1e6, 2**-12, -0.0, 7.9, 15.9], device=DEVICE)])
    key = x[: len(x) // 8 * 8].reshape(-1, 1, 8)  # [num_tokens, 1 head, 8]
    key_cache = torch.zeros(len(key), 1, 1, 8, dtype=FP8, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    one = torch.ones((), device=DEVICE)
    slots = torch.arange(len(key), device=DEVICE)
    reshape_and_cache_fp8(key, key, key_cache, value_cache, slots, one, one)
    assert torch.equal(bits(key_cache), bits(ref.quantize(key, one)[:, None]))
    assert torch.equal(bits(value_cache), bits(key_cache))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
def test_writer_matches_reference_bytes(per_head, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    spread = torch.tensor([1, 3, 0.1, 8], device=DEVICE)[:, None]
    key = (torch.randn(40, 4, 32, generator=g, device=DEVICE) * spread).to(dtype)
    value = torch.randn(40, 4, 32, generator=g, device=DEVICE).to(dtype)
    k_scale, v_scale = ref.kv_scale(key, per_head=per_head), ref.kv_scale(value, per_head=per_head)
    slots = torch.randperm(6 * 16, generator=g, device=DEVICE)[:40]
    slots[[3, 17]] = -1  # padding tokens own no slot
    caches = [torch.zeros(6, 16, 4, 32, dtype=FP8, device=DEVICE) for _ in range(4)]
    reshape_and_cache_fp8(key, value, *caches[:2], slots, k_scale, v_scale)
    ref.reshape_and_cache_fp8(key, value, *caches[2:], slots, k_scale, v_scale)
    assert torch.equal(bits(caches[0]), bits(caches[2]))
    assert torch.equal(bits(caches[1]), bits(caches[3]))


def test_scales_map_the_largest_magnitude_to_fp8_max():
    x = torch.randn(10, 3, 16) * torch.tensor([1.0, 5.0, 0.5])[:, None]
    assert ref.kv_scale(x).shape == () and ref.kv_scale(x, per_head=True).shape == (3,)
    per_head = ref.kv_scale(x, per_head=True)
    assert torch.allclose(per_head * ref.FP8_MAX, x.abs().amax(dim=(0, 2)))
    assert ref.quantize(x, per_head).float().abs().amax() == ref.FP8_MAX  # saturates nothing


# ---------------------------------------------------------------------------------------------
# Decoding


def max_error_vs_reference(args, **kw) -> float:
    out = paged_attention_fp8(*args, **kw)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape and not out.isnan().any()
    return (out.float() - ref.paged_attention_fp8(*args, **kw).float()).abs().max().item()


@pytest.mark.parametrize(
    "dtype, heads, head_dim, block_size, lens, per_head, tol",
    [
        (FP32, (4, 4), 64, 8, [1, 7, 8, 9, 70], False, 2e-6),
        (FP16, (8, 2), 64, 16, [15, 16, 17, 33], True, 2e-3),
        (FP16, (8, 1), 128, 32, [1, 100], False, 2e-3),
        (FP32, (6, 2), 80, 1, [2, 35], True, 2e-6),
        (BF16, (8, 2), 64, 16, [1, 40], True, 2e-2),  # one bf16 ulp: the output's rounding
    ],
)
def test_decode_matches_reference_on_the_same_bytes(
    dtype, heads, head_dim, block_size, lens, per_head, tol
):
    x = make_inputs(lens, heads, head_dim, block_size, dtype, layout="random")
    assert max_error_vs_reference(ref.quantize_inputs(x, per_head=per_head)) <= tol


def test_fp8_stays_within_5e_2_of_fp16():
    """Unit-scale inputs, sequences of 64 tokens and more: the issue's acceptance bound. The
    error is the quantisation error of the values, averaged over the attended tokens; a
    sequence of one token has nothing to average (its output is one value row, up to half an
    e4m3 step, 6.25%, off), hence the bound holds only once softmax averages."""
    x = make_inputs([64, 100, 257], seed=3)
    fp16 = paged_attention(*x.args())
    for per_head in (False, True):
        out = paged_attention_fp8(*ref.quantize_inputs(x, per_head=per_head))
        assert (out.float() - fp16.float()).abs().max().item() <= 5e-2


def relative_error_of_small_head(ratio: float, per_head: bool) -> float:
    """KV head 1 is ``ratio`` times smaller than KV head 0: error of its outputs, relative."""
    x = make_inputs([100, 100], heads=(4, 2), dtype=FP32, seed=4)
    x.key_cache[:, :, 1] /= ratio
    x.value_cache[:, :, 1] /= ratio
    exact = paged_attention(*x.args())[:, 2:]  # the query heads of KV head 1
    out = paged_attention_fp8(*ref.quantize_inputs(x, per_head=per_head))[:, 2:]
    return ((out - exact).abs().max() / exact.abs().max()).item()


def test_per_head_scales_matter_only_past_e4m3s_exponent_range():
    """e4m3 is floating point: a shared scale costs a head that is 20x smaller nothing, since
    its values keep their 3 mantissa bits lower in the exponent range. Only a head so small that
    its values fall below e4m3's smallest normal (2**-6 of the scale, 448 / 2**-6 = 28,672x
    below the largest) loses precision, and per-head scales restore it."""
    small = {ph: relative_error_of_small_head(20, ph) for ph in (False, True)}
    tiny = {ph: relative_error_of_small_head(30_000, ph) for ph in (False, True)}
    assert small[False] < 1.5 * small[True] and small[True] < 0.05
    assert tiny[False] > 4 * tiny[True]


@pytest.mark.skipif(not CAN_COUNT, reason=f"loads cannot be counted: {WHY_NOT}")
def test_fp8_halves_the_bytes_loaded():
    x = make_inputs([9, 40, 64])
    query, k8, v8, tables, lens, k_scale, v_scale = ref.quantize_inputs(x)
    with count_traffic(key_cache=x.key_cache, value_cache=x.value_cache) as fp16:
        paged_attention(*x.args(), num_splits=1)
    with count_traffic(key_cache=k8, value_cache=v8) as fp8_bytes:
        paged_attention_fp8(query, k8, v8, tables, lens, k_scale, v_scale)
    used = sum(lens.tolist()) * 2 * 64  # one byte per value: tokens x KV heads x head_dim
    assert fp8_bytes.loaded["key_cache"] == fp8_bytes.loaded["value_cache"] == used
    assert fp16.loaded["key_cache"] == fp16.loaded["value_cache"] == 2 * used


# ---------------------------------------------------------------------------------------------
# Errors, before any launch


@pytest.fixture
def no_launch(monkeypatch):
    # A launch would raise "'NoneType' object is not subscriptable", which no match accepts.
    for name in ("_paged_attention_fp8_kernel", "_reshape_and_cache_fp8_kernel"):
        monkeypatch.setattr(fp8, name, None)


@pytest.mark.parametrize(
    "change, error, name",
    [
        (lambda a: {1: a[1].half()}, TypeError, "key_cache must be torch.float8_e4m3fn"),
        (lambda a: {2: a[2][:, :8]}, ValueError, "value_cache"),
        (lambda a: {5: torch.ones(3)}, ValueError, "k_scale must have shape"),
        (lambda a: {6: -a[6]}, ValueError, "v_scale must be finite and > 0"),
        (lambda a: {6: a[6].double()}, TypeError, "v_scale must be torch.float32"),
        (lambda a: {4: a[4] * 100}, ValueError, "seq_lens"),
    ],
)
def test_decode_errors_name_the_argument(no_launch, change, error, name):
    args = list(ref.quantize_inputs(make_inputs([3, 20])))
    for i, bad in change(args).items():
        args[i] = bad
    for impl in (paged_attention_fp8, ref.paged_attention_fp8):
        with pytest.raises(error, match=name):
            impl(*args)


def test_writer_errors_name_the_argument(no_launch):
    key = torch.randn(4, 2, 16)
    cache = torch.zeros(2, 8, 2, 16, dtype=FP8)
    one, slots = torch.ones(()), torch.arange(4)
    cases = [
        ((key, key, cache.float(), cache, slots, one, one), TypeError, "key_cache"),
        ((key, key, cache, cache, slots * 10, one, one), ValueError, "slot_mapping\\[2\\] = 20"),
        ((key, key, cache, cache, slots, torch.ones(2, 1), one), ValueError, "k_scale"),
    ]
    for args, error, name in cases:
        for impl in (reshape_and_cache_fp8, ref.reshape_and_cache_fp8):
            with pytest.raises(error, match=name):
                impl(*args)
    assert not bits(cache).any()  # nothing was written


# ---------------------------------------------------------------------------------------------
# GPU: the compiled conversions (fp8 -> fp16/bf16 in the dot, fp32 -> e4m3 in the writer)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP16, BF16])
@pytest.mark.parametrize("per_head", [False, True])
def test_gpu_decode_matches_reference(dtype, per_head):
    x = make_inputs([1, 15, 1000, 4099], (32, 8), 128, 16, dtype, device=DEVICE, layout="random")
    tol = {FP16: 2e-3, BF16: 2e-2}[dtype]
    assert max_error_vs_reference(ref.quantize_inputs(x, per_head=per_head)) <= tol


@pytest.mark.gpu
def test_gpu_writer_matches_reference_bytes():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    key, value = torch.randn(2, 500, 8, 128, generator=g, device=DEVICE, dtype=BF16)
    k_scale, v_scale = ref.kv_scale(key, per_head=True), ref.kv_scale(value)
    slots = torch.randperm(64 * 16, generator=g, device=DEVICE)[:500]
    caches = [torch.zeros(64, 16, 8, 128, dtype=FP8, device=DEVICE) for _ in range(4)]
    reshape_and_cache_fp8(key, value, *caches[:2], slots, k_scale, v_scale)
    ref.reshape_and_cache_fp8(key, value, *caches[2:], slots, k_scale, v_scale)
    assert torch.equal(bits(caches[0]), bits(caches[2]))
    assert torch.equal(bits(caches[1]), bits(caches[3]))
