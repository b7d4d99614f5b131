"""Triton reshape_and_cache and copy_blocks, and swap_blocks, against the torch references.

Each test runs the kernel and the reference on clones of the same caches and expects them to be
bit-identical: these operations only move values.
"""

import pytest
import torch

from pagedlab.device import DEVICE
from pagedlab.kernels import copy_blocks, reference, reshape_and_cache, swap_blocks


def randn(*shape, dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype, device=device)


def assert_all_equal(got, expected):
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize(
    "dtype, block_size, heads, head_dim",
    [(torch.float32, 8, 2, 64), (torch.float16, 16, 4, 128), (torch.bfloat16, 16, 3, 80)],
)
def test_reshape_and_cache_matches_reference(dtype, block_size, heads, head_dim, device=DEVICE):
    """Negative slots are skipped; key and value are strided views of one packed tensor."""
    shape = (6, block_size, heads, head_dim)
    caches = [randn(*shape, dtype=dtype, device=device, seed=s) for s in (1, 2)]
    kv = randn(7, 2, heads, head_dim, dtype=dtype, device=device, seed=3)  # [tokens, k|v, H, D]
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([0, -1, 5 * block_size + 3, 7, -9, 2 * block_size, 6 * block_size - 1])
    slots = slots.to(device)
    expected = [c.clone() for c in caches]
    reference.reshape_and_cache(key, value, *expected, slots)
    reshape_and_cache(key, value, *caches, slots)
    assert_all_equal(caches, expected)
    assert torch.equal(caches[0][5, 3], key[2]) and torch.equal(caches[1][0, 7], value[3])


def copy_blocks_case(dtype=torch.float32, device=DEVICE, num_layers=3):
    layers = [randn(8, 4, 2, 16, dtype=dtype, device=device, seed=s) for s in range(2 * num_layers)]
    mapping = torch.tensor([[0, 5], [0, 6], [3, 7], [1, 2]], device=device)  # a fork: 0 twice
    return layers[:num_layers], layers[num_layers:], mapping


def test_copy_blocks_matches_reference_in_every_layer():
    keys, values, mapping = copy_blocks_case()
    before = [c.clone() for c in keys + values]
    expected_k, expected_v = [c.clone() for c in keys], [c.clone() for c in values]
    reference.copy_blocks(expected_k, expected_v, mapping)
    copy_blocks(keys, values, mapping)
    assert_all_equal(keys + values, expected_k + expected_v)
    for cache, old in zip(keys + values, before):
        assert torch.equal(cache[[5, 6, 7, 2]], old[[0, 0, 3, 1]])
        assert torch.equal(cache[[0, 1, 3, 4]], old[[0, 1, 3, 4]])  # the rest is untouched


def test_copy_blocks_with_no_pairs_is_a_no_op():
    keys, values, _ = copy_blocks_case()
    before = [c.clone() for c in keys + values]
    copy_blocks(keys, values, torch.empty(0, 2, dtype=torch.int64, device=DEVICE))
    assert_all_equal(keys + values, before)


@pytest.mark.parametrize("pairs", [[[5, 0], [2, 3], [0, 1]], []])
def test_swap_blocks_matches_reference(pairs):
    src = randn(6, 4, 2, 16, seed=1)
    dst, expected = randn(4, 4, 2, 16, seed=2), randn(4, 4, 2, 16, seed=2)
    mapping = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    reference.swap_blocks(src, expected, mapping)
    swap_blocks(src, dst, mapping)
    assert torch.equal(dst, expected)


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_gpu_reshape_and_cache():
    test_reshape_and_cache_matches_reference(torch.bfloat16, 16, 8, 128, device=DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_copy_blocks(dtype):
    keys, values, mapping = copy_blocks_case(dtype, DEVICE, num_layers=4)
    expected_k, expected_v = [c.clone() for c in keys], [c.clone() for c in values]
    reference.copy_blocks(expected_k, expected_v, mapping)
    copy_blocks(keys, values, mapping)
    assert_all_equal(keys + values, expected_k + expected_v)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["out", "in"])
def test_gpu_swap_blocks_between_gpu_and_cpu(direction):
    gpu, cpu = randn(8, 16, 8, 128, device=DEVICE, seed=1), randn(5, 16, 8, 128, seed=2)
    src, dst = (gpu, cpu) if direction == "out" else (cpu, gpu)
    mapping = torch.tensor([[1, 4], [3, 0], [4, 2]])
    expected = dst.clone()
    reference.swap_blocks(src, expected, mapping)
    swap_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)
