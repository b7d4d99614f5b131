"""The Triton paged_attention against the torch reference (itself checked against torch's SDPA in
test_kernels_reference.py). On a CPU the kernel runs through Triton's interpreter.

The CPU grid is a covering selection of dtype x num_seqs x (query heads, KV heads) x head_dim
x block size: every pair of values appears in some case (checked below), the 7-sequence cases
hold every length edge case (1, B-1, B, B+1 and several tiles), and every unused slot of every
cache holds NaN. Errors are measured against the reference run in fp32 on the same inputs.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from pagedlab.device import DEVICE
from pagedlab.kernels import paged_attention, reshape_and_cache
from pagedlab.kernels import reference as ref
from pagedlab.kernels.decode import MIN_TOKENS_PER_SPLIT, TILE_TOKENS, choose_num_splits
from pagedlab.kernels.inputs import PagedDecodeInputs, random_paged_inputs

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {FP32: 2e-6, FP16: 2e-3, BF16: 2e-2}  # max abs error vs the fp32 reference


def make_inputs(lens, heads, head_dim, block_size, dtype=FP32, **kw) -> PagedDecodeInputs:
    num_heads, num_kv_heads = heads
    return random_paged_inputs(
        lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        **kw,
    )


def fp32_reference(x: PagedDecodeInputs, **kw):
    """The reference on fp32 copies of the inputs: the exact answer to compare any dtype with."""
    args = [t.float() if t.is_floating_point() else t for t in x.args()]
    return ref.paged_attention(*args, **kw)


def max_error(x: PagedDecodeInputs, tol_dtype=None, **kw) -> float:
    """Max abs error of the kernel against the fp32 reference; the output must have no NaN."""
    out = paged_attention(*x.args(), **kw)
    assert out.dtype == x.query.dtype and out.shape == x.query.shape
    assert not out.isnan().any()
    return (out.float() - fp32_reference(x, scale=kw.get("scale"))).abs().max().item()


def edge_lengths(block_size: int) -> list[int]:
    """1, B-1, B, B+1, then lengths spanning several blocks and several token tiles."""
    b = block_size
    return [1, b - 1, b, b + 1, 2 * b + 3, 3 * b + 1, 2 * TILE_TOKENS + 3]


# (dtype, num_seqs, (heads, kv heads), head_dim, block_size): rows 1-9 are an orthogonal array
# over num_seqs x heads x block size; its fourth column picks (dtype, head_dim), and row 10
# adds the missing (fp32, 128).
GRID = [
    (FP32, 1, (4, 4), 64, 8),
    (FP16, 1, (8, 2), 64, 16),
    (FP16, 1, (8, 1), 128, 32),
    (FP16, 3, (4, 4), 128, 16),
    (FP32, 3, (8, 2), 64, 32),
    (FP16, 3, (8, 1), 64, 8),
    (FP16, 7, (4, 4), 64, 32),
    (FP16, 7, (8, 2), 128, 8),
    (FP32, 7, (8, 1), 64, 16),
    (FP32, 7, (8, 2), 128, 16),
]


def test_grid_covers_every_pair_of_values():
    values = [set(column) for column in zip(*GRID)]
    assert values == [{FP32, FP16}, {1, 3, 7}, {(4, 4), (8, 2), (8, 1)}, {64, 128}, {8, 16, 32}]
    for i, j in itertools.combinations(range(5), 2):
        assert {(row[i], row[j]) for row in GRID} == set(itertools.product(values[i], values[j]))


@pytest.mark.parametrize("case", range(len(GRID)))
def test_matches_reference(case):
    dtype, num_seqs, heads, head_dim, block_size = GRID[case]
    lens = {1: [3 * block_size + 1], 3: [block_size - 1, block_size + 1, 2 * block_size + 3]}
    lens = lens.get(num_seqs, edge_lengths(block_size))
    layout = ("permuted", "random")[case % 2]
    x = make_inputs(lens, heads, head_dim, block_size, dtype, layout=layout, seed=case)
    assert max_error(x) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [FP32, FP16])
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_agrees_with_one_pass(dtype, num_splits):
    """Splits may be empty (8 splits of 1 token) or uneven; the merge must not care."""
    x = make_inputs([1, 9, 100, 131], (8, 2), 64, 16, dtype, layout="random")
    one_pass = paged_attention(*x.args(), num_splits=1)
    split = paged_attention(*x.args(), num_splits=num_splits)
    assert (split.float() - one_pass.float()).abs().max().item() <= TOL[dtype]
    assert max_error(x, num_splits=num_splits) <= TOL[dtype]


def repage(x: PagedDecodeInputs, block_size: int, seed: int = 0) -> PagedDecodeInputs:
    """The same sequences in a new cache of ``block_size`` blocks, dealt out in random order."""
    lens = x.seq_lens.tolist()
    heads = (x.query.shape[1], x.key_cache.shape[2])
    y = make_inputs(lens, heads, x.query.shape[2], block_size, x.query.dtype, seed=seed)
    for i, n in enumerate(lens):
        tokens = torch.arange(n, device=y.block_tables.device)
        blocks = y.block_tables[i, tokens // block_size].long()
        slots = blocks * block_size + tokens % block_size  # [n]
        k = ref.gather_kv(x.key_cache, x.block_tables[i], n)  # [n, num_kv_heads, head_dim]
        v = ref.gather_kv(x.value_cache, x.block_tables[i], n)
        ref.reshape_and_cache(k, v, y.key_cache, y.value_cache, slots)
    y.query = x.query
    return y


def test_block_size_8_and_16_agree_on_the_same_logical_cache():
    x16 = make_inputs([1, 8, 17, 40, 77], (8, 2), 64, 16)
    x8 = repage(x16, 8, seed=1)
    out16, out8 = paged_attention(*x16.args()), paged_attention(*x8.args())
    assert (out16 - out8).abs().max().item() <= TOL[FP32]


@pytest.mark.parametrize(
    "heads, head_dim, block_size, lens",
    [
        ((6, 2), 80, 1, [1, 2, 35]),  # block size 1, a head_dim and a group that are not 2^k
        ((32, 1), 64, 128, [1, 127, 128, 129]),  # block size 128, a group past 16 rows
        ((16, 1), 128, 12, [11, 12, 13, 50]),  # a block size that is not a power of two
    ],
)
def test_odd_shapes(heads, head_dim, block_size, lens):
    x = make_inputs(lens, heads, head_dim, block_size, layout="random")
    assert max_error(x) <= TOL[FP32]


def test_strided_query_and_scale():
    """A query sliced out of a packed [num_seqs, num_heads, 3 * head_dim] projection."""
    x = make_inputs([5, 23], (4, 2), 32, 8)
    packed = torch.randn(2, 4, 96, device=DEVICE)
    x.query = packed[:, :, 32:64]
    assert max_error(x, scale=0.3) <= TOL[FP32]


def test_large_logits():
    """Logits near ±100: the running max jumps between tiles and exp must never overflow.

    fp32 rounds such a logit by up to 100 * 2**-24 = 6e-6, which moves its weight by as much,
    relative: the bound grows to 2e-5 (the reference itself is 1.3e-6 from float64 here).
    """
    x = make_inputs([1, 40, 100], (8, 2), 64, 16, layout="random")
    x.query *= 30.0
    assert max_error(x) <= 2e-5
    assert max_error(x, num_splits=3) <= 2e-5


def test_bf16():
    """In the interpreter the kernel multiplies bf16 as fp32; the interpreter's fp32 -> bf16
    rounding differs from torch's by up to one bf16 ulp, hence the bound."""
    x = make_inputs([1, 17, 40], (8, 2), 64, 16, BF16)
    assert max_error(x) <= TOL[BF16]
    assert max_error(x, num_splits=2) <= TOL[BF16]


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 32768, num_sms=132) == 1  # the grid fills the GPU
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 32  # 33 wanted, capped
    assert choose_num_splits(8, 8, 32768, num_sms=132) == 5  # 5 * 64 programs >= 2 * 132
    assert choose_num_splits(1, 8, 3 * MIN_TOKENS_PER_SPLIT, num_sms=132) == 3  # by length
    assert choose_num_splits(1, 8, 100, num_sms=132) == 1  # too short to split


# ---------------------------------------------------------------------------------------------
# GPU: longer sequences, bf16, every block size, the heuristic's own choice of splits.

GPU_GRID = [
    (dtype, heads, head_dim, block_size)
    for dtype, (heads, head_dim) in itertools.product(
        [FP32, FP16, BF16], [((32, 8), 128), ((8, 1), 64), ((4, 4), 128)]
    )
    for block_size in (1, 8, 16, 32, 128)
    if (block_size in (8, 16) or dtype == BF16)
]
GPU_TOL = {FP32: 1e-5, FP16: 2e-3, BF16: 2e-2}  # tl.exp is approximate on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, head_dim, block_size", GPU_GRID)
def test_gpu_matches_reference(dtype, heads, head_dim, block_size):
    lens = [1, block_size - 1 or 2, block_size + 1, 1000, 4099]
    x = make_inputs(lens, heads, head_dim, block_size, dtype, device=DEVICE, layout="random")
    for num_splits in (None, 1, 7):
        assert max_error(x, num_splits=num_splits) <= GPU_TOL[dtype], num_splits


@pytest.mark.gpu
def test_gpu_heuristic_splits_a_single_long_sequence():
    x = make_inputs([20000], (32, 8), 128, 16, BF16, device=DEVICE)
    max_context = x.block_tables.shape[1] * 16
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert choose_num_splits(1, 8, max_context, sms) > 1
    assert max_error(x) <= GPU_TOL[BF16]


@pytest.mark.gpu
def test_gpu_offsets_past_2_31_elements():
    """A sequence in the last blocks of a cache of 2.3e9 elements: block id * block stride
    overflows int32, so both kernels must widen block ids (and slots) to int64 first."""
    num_blocks, seq_len = 140_000, 100
    key_cache = torch.empty(num_blocks, 16, 8, 128, dtype=FP16, device=DEVICE)  # 4.6 GB
    value_cache = torch.empty_like(key_cache)
    blocks = torch.arange(num_blocks - 7, num_blocks, device=DEVICE)  # [7]
    slots = (blocks[:, None] * 16 + torch.arange(16, device=DEVICE)).flatten()[:seq_len]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    k, v = torch.randn(2, seq_len, 8, 128, generator=g, device=DEVICE, dtype=FP16)
    query = torch.randn(1, 32, 128, generator=g, device=DEVICE, dtype=FP16)
    reshape_and_cache(k, v, key_cache, value_cache, slots)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    out = paged_attention(query, key_cache, value_cache, blocks.int()[None], seq_lens)
    q4 = query[:, :, None].float()  # [1, 32, 1, 128]
    k4, v4 = (t.transpose(0, 1)[None].float() for t in (k, v))  # [1, 8, seq_len, 128]
    expected = F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)[:, :, 0]
    assert (out.float() - expected).abs().max().item() <= TOL[FP16]
