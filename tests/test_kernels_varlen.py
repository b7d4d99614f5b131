"""The mixed-batch kernel paged_attention_varlen against its torch spec and against SDPA.

SDPA runs per sequence on K/V gathered slot by slot into contiguous tensors, with torch's own
bottom-right causal mask (``causal_lower_right``: the last query sees every key), so it checks
the spec's positions and mask as well as the kernel. Every unused slot of every cache holds NaN.
On a CPU the kernel runs through Triton's interpreter: the batches are a few hundred tokens.
"""

import re

import pagedlab  # noqa: F401  (first: torch.nn.attention.bias imports triton)
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from pagedlab.device import DEVICE
from pagedlab.kernels import paged_attention, paged_attention_varlen
from pagedlab.kernels import varlen_reference as ref
from pagedlab.kernels.inputs import PagedVarlenInputs, random_varlen_inputs
from pagedlab.kernels import varlen
from pagedlab.kernels.varlen import QUERY_ROWS, choose_query_tile
from pagedlab.kernels.varlen_checks import check_paged_attention_varlen

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {FP32: 2e-6, FP16: 2e-3, BF16: 2e-2}  # max abs error vs the fp32 answer


def make_inputs(seq_lens, q_lens, heads, head_dim, block_size, dtype=FP32, **kw):
    num_heads, num_kv_heads = heads
    return random_varlen_inputs(
        seq_lens, q_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, **kw,
    )


def fp32(x: PagedVarlenInputs) -> tuple:
    return tuple(t.float() if t.is_floating_point() else t for t in x.args())


def sdpa(x: PagedVarlenInputs, scale=None) -> torch.Tensor:
    """SDPA in fp32, one sequence at a time, on its K/V copied out of the cache slot by slot."""
    query, key_cache, value_cache, tables, starts, seq_lens = fp32(x)
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    for i, n in enumerate(seq_lens.tolist()):
        a, b = starts[i].item(), starts[i + 1].item()
        if a == b:
            continue
        t = torch.arange(n, device=query.device)  # [n] positions
        blocks, offsets = tables[i, t // block_size].long(), t % block_size
        k = key_cache[blocks, offsets].transpose(0, 1)[None]  # [1, num_kv_heads, n, D]
        v = value_cache[blocks, offsets].transpose(0, 1)[None]
        q = query[a:b].transpose(0, 1)[None]  # [1, num_heads, q_len, D]
        mask = causal_lower_right(b - a, n)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1)  # [q_len, num_heads, D]
    return out


def check(x: PagedVarlenInputs, tol: float, **kw) -> torch.Tensor:
    """Kernel vs the fp32 spec and vs SDPA, spec vs SDPA; the kernel's output has no NaN."""
    out = paged_attention_varlen(*x.args(), **kw)
    assert out.dtype == x.query.dtype and out.shape == x.query.shape
    assert not out.isnan().any()
    scale = kw.get("scale")
    expected = ref.paged_attention_varlen(*fp32(x), scale=scale)
    baseline = sdpa(x, scale)
    assert (expected - baseline).abs().max().item() <= TOL[FP32]
    assert (out.float() - expected).abs().max().item() <= tol
    assert (out.float() - baseline).abs().max().item() <= tol + TOL[FP32]
    return out


# (chunk, (heads, kv heads), head_dim, block size, dtype). Each batch holds a prompt's chunk
# with no cached prefix, the same chunk after a prefix of several blocks, and a decode.
CHUNKS = [
    (1, (4, 4), 32, 1, FP32),  # MHA, one token per block
    (3, (8, 2), 64, 8, FP16),  # GQA
    (16, (8, 1), 64, 32, FP32),  # MQA, a chunk inside one block
    (100, (6, 2), 80, 16, FP32),  # a group of 3 and a head_dim that are not powers of two
    ("whole", (8, 2), 64, 16, FP16),  # whole prompts: the chunk is the sequence
]


@pytest.mark.parametrize("case", range(len(CHUNKS)))
def test_chunks_with_and_without_cached_prefix(case):
    chunk, heads, head_dim, block_size, dtype = CHUNKS[case]
    if chunk == "whole":
        seq_lens, q_lens = [77, 33, 40], [77, 33, 1]
    else:
        prefix = 3 * block_size + 1  # several blocks, the last one partly filled
        seq_lens, q_lens = [chunk, prefix + chunk, 40], [chunk, chunk, 1]
    layout = ("permuted", "random")[case % 2]
    x = make_inputs(seq_lens, q_lens, heads, head_dim, block_size, dtype, layout=layout, seed=case)
    check(x, TOL[dtype])


def test_mixed_batch_of_decodes_chunks_and_an_idle_sequence():
    """Decodes between chunks, in a cache whose blocks the tables share at random, and one
    sequence with no new token (its offsets repeat: it owns no row of the output)."""
    seq_lens = [9, 50, 1, 70, 12, 33, 64]
    q_lens = [1, 17, 1, 0, 12, 1, 5]
    x = make_inputs(seq_lens, q_lens, (8, 2), 64, 8, FP16, layout="random", seed=7)
    check(x, TOL[FP16], scale=0.2)


@pytest.mark.parametrize("query_tile", [1, 3, 64])
def test_any_query_tile_gives_the_same_answer(query_tile):
    """One token per program, a tile of 3 (6 rows padded to 16), and one tile per chunk."""
    x = make_inputs([5, 40, 61], [5, 33, 1], (8, 2), 32, 16, seed=3)
    check(x, TOL[FP32], query_tile=query_tile, check_values=False)


def test_decode_only_batch_equals_the_decode_kernel():
    """A batch of one-token queries runs with one token per program: the decode kernel's
    tiles and the same online softmax, so in the interpreter the results are bitwise equal."""
    x = make_inputs([1, 15, 16, 17, 70], [1] * 5, (8, 2), 64, 16, layout="random", seed=4)
    out = check(x, TOL[FP32])
    decode = paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens)
    assert torch.equal(out, decode)


def test_choose_query_tile():
    assert choose_query_tile(num_tokens=5, num_seqs=5, group=4) == 1  # decodes only
    assert choose_query_tile(num_tokens=4, num_seqs=5, group=4) == 1  # an idle sequence too
    assert choose_query_tile(100, 3, group=4) * 4 == QUERY_ROWS  # chunks: fill the rows
    assert choose_query_tile(100, 3, group=3) == QUERY_ROWS // 3  # 63 rows, padded to 64
    assert choose_query_tile(100, 3, group=2 * QUERY_ROWS) == 1  # a group wider than the rows


def test_bf16():
    """bf16 multiplies as fp32 in the interpreter; its fp32 -> bf16 rounding differs from torch's
    by up to one bf16 ulp, hence the bound (as for the decode kernel)."""
    x = make_inputs([20, 45], [20, 8], (8, 2), 64, 16, BF16, seed=5)
    check(x, TOL[BF16])


def test_strided_views_of_every_tensor_argument():
    """query sliced out of a fused QKV projection; K and V caches two halves of one tensor
    laid out [blocks, kv_heads, block_size, D] and transposed; block_tables column-major and
    a slice with step 2. The kernel must follow every stride it is given."""
    x = make_inputs([30, 19], [12, 1], (4, 2), 32, 8, seed=6)
    contiguous = ref.paged_attention_varlen(*x.args())
    fused = torch.randn(x.query.shape[0], 4, 3 * 32, device=DEVICE)
    fused[:, :, 32:64] = x.query
    x.query = fused[:, :, 32:64]  # [num_tokens, 4, 32], token stride 384
    kv = torch.stack([x.key_cache, x.value_cache], 1).transpose(2, 3).contiguous()
    x.key_cache, x.value_cache = (kv[:, i].transpose(1, 2) for i in (0, 1))  # strided views
    assert not x.key_cache.is_contiguous()
    wide = torch.full((2, 2 * x.block_tables.shape[1]), -1, dtype=torch.int32, device=DEVICE)
    wide[:, ::2] = x.block_tables
    for tables in (x.block_tables.t().contiguous().t(), wide[:, ::2]):
        x.block_tables = tables
        out = check(x, TOL[FP32])
        assert torch.equal(out, paged_attention_varlen(*x.args(), check_values=False))
        assert (out - contiguous).abs().max().item() <= TOL[FP32]


# ---------------------------------------------------------------------------------------------
# Bad arguments: each raises before any launch, naming the argument, in kernel and spec alike.


def _set(name, value):
    return lambda x: setattr(x, name, value(getattr(x, name)))


BAD = [
    ("query 2-D", _set("query", lambda q: q[:, 0]), ValueError, "query must have 3 dimensions"),
    ("query int", _set("query", lambda q: q.int()), TypeError, "query must be"),
    ("cache dtype", _set("key_cache", lambda c: c.half()), TypeError, "key_cache must have"),
    ("head_dim", _set("query", lambda q: q[..., :16]), ValueError, "head_dim"),
    ("group", _set("query", lambda q: q[:, :3]), ValueError, "multiple of key_cache's"),
    ("tables int64", _set("block_tables", lambda t: t.long()), TypeError, "block_tables must"),
    ("tables rows", _set("block_tables", lambda t: t[:2]), ValueError, "block_tables must have 3"),
    ("starts rows", _set("query_start_loc", lambda s: s[:3]), ValueError, "query_start_loc must"),
    ("starts int64", _set("query_start_loc", lambda s: s.long()), TypeError, "query_start_loc"),
    ("lens int64", _set("seq_lens", lambda s: s.long()), TypeError, "seq_lens must be"),
    (
        "starts strided",
        _set("query_start_loc", lambda s: torch.stack([s, s], 1)[:, 0]),
        ValueError,
        "query_start_loc must be contiguous",
    ),
    (
        "lens strided",
        _set("seq_lens", lambda s: torch.stack([s, s], 1)[:, 1]),
        ValueError,
        "seq_lens must be contiguous",
    ),
    ("start not 0", _set("query_start_loc", lambda s: s + 1), ValueError, "run from 0 to"),
    (
        "end short",
        _set("query_start_loc", lambda s: torch.cat([s[:-1], s[-1:] - 1])),
        ValueError,
        "run from 0 to query's num_tokens=19",
    ),
    (
        "starts fall",
        _set("query_start_loc", lambda s: torch.tensor([0, 12, 11, 19], dtype=s.dtype)),
        ValueError,
        "query_start_loc[2] = 11 < query_start_loc[1] = 12",
    ),
    (
        "context < chunk",
        _set("seq_lens", lambda s: torch.tensor([30, 5, 9], dtype=s.dtype)),
        ValueError,
        "seq_lens[1] = 5 is less than the sequence's 6 query tokens",
    ),
    (
        "past capacity",
        _set("seq_lens", lambda s: torch.tensor([30, 9, 999], dtype=s.dtype)),
        ValueError,
        "seq_lens[2] = 999",
    ),
    (
        "missing block",
        _set("block_tables", lambda t: t.index_fill(1, torch.tensor([0]), 10_000)),
        ValueError,
        "block_tables[0, 0] = 10000 is not a block of key_cache",
    ),
]


class Trap:
    """Stands in for the Triton kernel: launching it fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("the kernel was launched despite a bad argument")


def bad_inputs() -> PagedVarlenInputs:
    return make_inputs([30, 9, 9], [12, 6, 1], (4, 2), 32, 8, device="cpu")


@pytest.mark.parametrize(
    "fn", [paged_attention_varlen, ref.paged_attention_varlen], ids=["triton", "reference"]
)
@pytest.mark.parametrize("name, corrupt, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments(fn, name, corrupt, error, message, monkeypatch):
    monkeypatch.setattr(varlen, "_varlen_attention_kernel", Trap())
    x = bad_inputs()
    check_paged_attention_varlen(*x.args(), None)  # the batch is valid before it is corrupted
    corrupt(x)
    with pytest.raises(error, match=re.escape(message)):
        fn(*x.args())


@pytest.mark.parametrize("kw, message", [({"scale": 0.0}, "scale"), ({"query_tile": 0}, "tile")])
def test_bad_keywords(kw, message, monkeypatch):
    monkeypatch.setattr(varlen, "_varlen_attention_kernel", Trap())
    with pytest.raises(ValueError, match=message):
        paged_attention_varlen(*bad_inputs().args(), **kw)


# ---------------------------------------------------------------------------------------------
# GPU: long contexts and chunks, bf16, block size 8 (tl.dot's K stays >= 16 whatever the block).

GPU_TOL = {FP32: 1e-5, FP16: 2e-3, BF16: 2e-2}  # tl.exp is approximate on a GPU
GPU_CASES = [
    (dtype, heads, head_dim, block_size)
    for dtype in (FP32, FP16, BF16)
    for heads, head_dim in (((32, 8), 128), ((9, 3), 64))  # Llama-3-8B's, SmolLM2's
    for block_size in (8, 16, 1, 32)
    if block_size in (8, 16) or dtype == BF16
]  # 16 cases x 2 query tiles: each a compilation, so the list stays short


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, head_dim, block_size", GPU_CASES)
def test_gpu_mixed_batch(dtype, heads, head_dim, block_size):
    seq_lens = [1, 1000, 512, 1512, 4099, 700, 3 * block_size + 2]
    q_lens = [1, 1, 512, 512, 1, 700, 3]
    x = make_inputs(seq_lens, q_lens, heads, head_dim, block_size, dtype, device=DEVICE,
                    layout="random")
    for query_tile in (None, 1):
        check(x, GPU_TOL[dtype], query_tile=query_tile)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_gpu_decode_only_matches_the_decode_kernel(dtype):
    lens = [1, 17, 1000, 4099, 20000]
    x = make_inputs(lens, [1] * len(lens), (32, 8), 128, 16, dtype, device=DEVICE)
    out = check(x, GPU_TOL[dtype])
    decode = paged_attention(x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens)
    assert (out.float() - decode.float()).abs().max().item() <= GPU_TOL[dtype]
