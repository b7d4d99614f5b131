"""pagedlab.kernels.reference against torch: the spec, checked independently of the kernels.

The reference paged_attention is compared with torch's scaled_dot_product_attention in float64
on keys and values gathered token by token (not with reference.gather_kv); the cache
operations are compared with loops over tokens and pairs.
"""

import pytest
import torch
import torch.nn.functional as F

from pagedlab.kernels import reference as ref
from pagedlab.kernels.inputs import random_paged_inputs


def gather_tokens(cache, table, seq_len):
    """[seq_len, num_kv_heads, head_dim]: token t read from block table[t // B], slot t % B."""
    block_size = cache.shape[1]
    return torch.stack([cache[table[t // block_size], t % block_size] for t in range(seq_len)])


def sdpa_decode(x, scale=None):
    """Each sequence's query against its gathered keys and values, in float64, by torch."""
    outs = []
    for i, n in enumerate(x.seq_lens.tolist()):
        k = gather_tokens(x.key_cache, x.block_tables[i], n).double()  # [n, num_kv_heads, D]
        v = gather_tokens(x.value_cache, x.block_tables[i], n).double()
        q = x.query[i].double()[:, None, :]  # [num_heads, 1, head_dim]
        o = F.scaled_dot_product_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), scale=scale, enable_gqa=True
        )  # [num_heads, 1, head_dim]
        outs.append(o[:, 0])
    return torch.stack(outs)  # [num_seqs, num_heads, head_dim]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize(
    "heads, head_dim, block_size, lens, layout",
    [
        ((4, 4), 64, 8, [1, 7, 8, 9], "permuted"),
        ((8, 2), 128, 16, [15, 16, 17], "random"),
        ((8, 1), 64, 32, [1, 31, 32, 33, 100], "random"),
        ((6, 3), 80, 1, [1, 2, 5], "permuted"),
    ],
)
def test_reference_matches_sdpa(dtype, tol, heads, head_dim, block_size, lens, layout):
    num_heads, num_kv_heads = heads
    x = random_paged_inputs(
        lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        layout=layout,
    )
    out = ref.paged_attention(*x.args())
    assert out.dtype == dtype and out.shape == x.query.shape
    assert (out.double() - sdpa_decode(x)).abs().max().item() <= tol


def test_reference_scale():
    x = random_paged_inputs([3, 20], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    out = ref.paged_attention(*x.args(), scale=0.3)
    assert (out.double() - sdpa_decode(x, scale=0.3)).abs().max().item() <= 2e-6


def test_reference_gather_kv_reads_the_table():
    x = random_paged_inputs([13], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4)
    got = ref.gather_kv(x.key_cache, x.block_tables[0], 13)
    assert torch.equal(got, gather_tokens(x.key_cache, x.block_tables[0], 13))


def test_reference_reshape_and_cache_matches_a_token_loop():
    g = torch.Generator().manual_seed(0)
    key_cache = torch.randn(5, 4, 2, 8, generator=g)
    value_cache = torch.randn_like(key_cache)
    key, value = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    slots = torch.tensor([0, -1, 19, 6, -7, 11])
    expect_k, expect_v = key_cache.clone(), value_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // 4, slot % 4] = key[t]
            expect_v[slot // 4, slot % 4] = value[t]
    ref.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expect_k) and torch.equal(value_cache, expect_v)


def test_reference_copy_and_swap_blocks_match_a_pair_loop():
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(6, 4, 2, 8, generator=g) for _ in range(4)]
    before = [c.clone() for c in layers]
    mapping = torch.tensor([[0, 3], [0, 4], [2, 5]])
    ref.copy_blocks(layers[:2], layers[2:], mapping)
    for cache, old in zip(layers, before):
        expect = old.clone()
        for src, dst in mapping.tolist():
            expect[dst] = old[src]
        assert torch.equal(cache, expect)

    dst_cache = torch.zeros(3, 4, 2, 8)
    ref.swap_blocks(layers[0], dst_cache, torch.tensor([[5, 2], [1, 0]]))
    assert torch.equal(dst_cache[2], layers[0][5]) and torch.equal(dst_cache[0], layers[0][1])
    assert not dst_cache[1].any()
