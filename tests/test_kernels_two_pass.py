"""The two-pass decode kernel against the torch reference, and the bytes it loads.

Through the interpreter on a CPU; each case's unused cache slots hold NaN, so a kernel that reads
a slot it should not shows it. The load counts compare what the interpreter executed with
``traffic.decode_traffic``'s formulas, byte for byte.
"""

import pytest
import torch

from pagedlab.device import DEVICE
from pagedlab.kernels import paged_attention, paged_attention_two_pass
from pagedlab.kernels import reference as ref
from pagedlab.kernels import two_pass
from pagedlab.kernels.inputs import random_paged_inputs
from pagedlab.kernels.traffic import CAN_COUNT, WHY_NOT, count_traffic, decode_traffic

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {FP32: 2e-6, FP16: 2e-3, BF16: 2e-2}  # max abs error vs the fp32 reference
MODES = ("recompute", "scratch")


def make_inputs(lens, heads, head_dim, block_size, dtype=FP32, **kw):
    num_heads, num_kv_heads = heads
    return random_paged_inputs(
        lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, **kw,
    )


def max_error(x, **kw) -> float:
    out = paged_attention_two_pass(*x.args(), **kw)
    assert out.dtype == x.query.dtype and out.shape == x.query.shape
    exact = ref.paged_attention(*[t.float() if t.is_floating_point() else t for t in x.args()])
    return (out.float() - exact).abs().max().item()


@pytest.mark.parametrize("logits", MODES)
@pytest.mark.parametrize(
    "dtype, heads, head_dim, block_size, lens",
    [
        (FP32, (4, 4), 64, 8, [1, 7, 8, 9, 70]),  # MHA, lengths around a block and two tiles
        (FP16, (8, 2), 64, 16, [15, 16, 17, 33]),  # GQA
        (FP16, (8, 1), 128, 32, [1, 100]),  # MQA
        (FP32, (6, 2), 80, 1, [2, 35]),  # block size 1, a head_dim and group that are not 2^k
    ],
)
def test_matches_reference(logits, dtype, heads, head_dim, block_size, lens):
    x = make_inputs(lens, heads, head_dim, block_size, dtype, layout="random")
    assert max_error(x, logits=logits) <= TOL[dtype]


def test_both_modes_agree_with_the_single_pass_kernel():
    """Same logits either way (stored or recomputed in fp32), so the same output; and the
    single-pass kernel's online rescaling reaches it to rounding."""
    x = make_inputs([5, 40, 77], (8, 2), 64, 16, layout="random", seed=1)
    recompute, scratch = (paged_attention_two_pass(*x.args(), logits=m) for m in MODES)
    assert torch.equal(recompute, scratch)
    assert (recompute - paged_attention(*x.args(), num_splits=1)).abs().max() <= TOL[FP32]


def test_large_logits_and_strided_query():
    x = make_inputs([1, 40, 100], (8, 2), 64, 16, layout="random")
    x.query = torch.randn(3, 8, 192, device=DEVICE)[:, :, 64:128] * 30.0  # a slice of a packed projection
    assert max_error(x, scale=0.125) <= 2e-5


def test_bf16():
    """bf16 in, fp32 dot in the interpreter; the interpreter's fp32 -> bf16 rounding differs
    from torch's by up to one bf16 ulp."""
    x = make_inputs([1, 17, 40], (8, 2), 64, 16, BF16)
    assert max_error(x) <= TOL[BF16]


def test_bad_logits_mode_raises_before_launch(monkeypatch):
    # A launch would now raise "'NoneType' object is not subscriptable", which no match accepts.
    monkeypatch.setattr(two_pass, "_two_pass_kernel", None)
    x = make_inputs([3], (4, 4), 16, 8)
    with pytest.raises(ValueError, match="logits='twice'"):
        paged_attention_two_pass(*x.args(), logits="twice")
    with pytest.raises(TypeError, match="key_cache"):
        paged_attention_two_pass(x.query, x.key_cache.half(), x.value_cache, *x.args()[3:])


# ---------------------------------------------------------------------------------------------
# Bytes loaded: the interpreter's count against the formula


def counted(x, run):
    names = dict(zip(("query", "key_cache", "value_cache", "block_tables", "seq_lens"), x.args()))
    with count_traffic(**names) as traffic:
        run()
    return traffic


RUNS = {
    "one_pass": lambda x: paged_attention(*x.args(), num_splits=1),
    "two_pass": lambda x: paged_attention_two_pass(*x.args(), logits="recompute"),
    "two_pass_scratch": lambda x: paged_attention_two_pass(*x.args(), logits="scratch"),
}


@pytest.mark.skipif(not CAN_COUNT, reason=f"loads cannot be counted: {WHY_NOT}")
@pytest.mark.parametrize("kernel", RUNS)
def test_load_count_matches_the_formula(kernel):
    x = make_inputs([1, 15, 16, 17, 70], (8, 2), 64, 16, FP16, layout="random")
    traffic = counted(x, lambda: RUNS[kernel](x))
    formula = decode_traffic(kernel, x.seq_lens, num_heads=8, num_kv_heads=2, head_dim=64)
    scratch = formula.loaded.pop("logits", 0)  # the scratch buffer is no argument: "other"
    assert {n: traffic.loaded[n] for n in formula.loaded} == formula.loaded
    assert traffic.loaded["other"] == scratch
    assert traffic.stored["other"] == sum(formula.stored.values())  # out (+ scratch logits)
    assert all(traffic.stored[n] == 0 for n in formula.loaded)  # the kernel writes no input


@pytest.mark.skipif(not CAN_COUNT, reason=f"loads cannot be counted: {WHY_NOT}")
def test_two_pass_reads_the_key_cache_twice_and_the_values_once():
    x = make_inputs([9, 40, 64], (4, 1), 32, 8, FP16)
    one, two = (counted(x, lambda: RUNS[k](x)) for k in ("one_pass", "two_pass"))
    used = sum(x.seq_lens.tolist()) * 32 * 2  # bytes of keys the sequences hold (1 KV head)
    assert one.loaded["key_cache"] == used and two.loaded["key_cache"] == 2 * used
    assert one.loaded["value_cache"] == two.loaded["value_cache"] == used


# ---------------------------------------------------------------------------------------------
# GPU: longer sequences, bf16, both modes


@pytest.mark.gpu
@pytest.mark.parametrize("logits", MODES)
@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_gpu_matches_reference(logits, dtype):
    x = make_inputs([1, 15, 1000, 4099], (32, 8), 128, 16, dtype, device=DEVICE, layout="random")
    assert max_error(x, logits=logits) <= {FP16: 2e-3, BF16: 2e-2}[dtype]
