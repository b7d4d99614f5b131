"""Writing to and moving blocks of the paged KV cache: reshape_and_cache, copy_blocks, swap_blocks.

- :func:`reshape_and_cache` scatters a step's new keys and values into their slots (Triton,
  one program per token).
- :func:`copy_blocks` copies blocks for copy-on-write, every layer and every pair in ONE launch:
  the per-layer caches are separate tensors, so the kernel receives their addresses as an int64
  tensor and casts each to a typed pointer (the interpreter supports this too). The alternative,
  stacking the layers into one tensor, would copy every cache on every call.
- :func:`swap_blocks` moves blocks between a GPU and a CPU cache with torch copies, not Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlab.dtypes import dtype_name
from pagedlab.kernels.tiles import check_launchable
from pagedlab.kernels.validate import (
    check_copy_blocks,
    check_reshape_and_cache,
    check_swap_blocks,
)

__all__ = ["reshape_and_cache", "copy_blocks", "swap_blocks"]

COPY_CHUNK = 1024  # elements each copy_blocks program moves per iteration


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # same shape and strides as key
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides as key_cache
    slot_mapping_ptr,  # int64 [num_tokens]
    stride_kv_token,
    stride_kv_head,
    stride_c_block,
    stride_c_token,
    stride_c_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_KV_HEADS and HEAD_DIM rounded up to powers of two
    DIM_PAD: tl.constexpr,
):
    # Grid: (num_tokens,). Program `token` copies that token's [num_kv_heads, head_dim] key and
    # value into slot slot_mapping[token] = block * BLOCK_SIZE + offset.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if slot < 0:  # a padding token: it owns no slot
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
    dims = tl.arange(0, DIM_PAD)[None, :]  # [1, DIM_PAD]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)  # [HEADS_PAD, DIM_PAD]
    src = token * stride_kv_token + heads * stride_kv_head + dims
    dst = block * stride_c_block + offset * stride_c_token + heads * stride_c_head + dims
    tl.store(key_cache_ptr + dst, tl.load(key_ptr + src, mask=mask), mask=mask)
    tl.store(value_cache_ptr + dst, tl.load(value_ptr + src, mask=mask), mask=mask)


def cache_write_strides(key, key_cache) -> tuple:
    """Strides a cache-write kernel takes: key/value (token, head), cache (block, token, head)."""
    return (*key.stride()[:2], *key_cache.stride()[:3])


def cache_write_meta(key, key_cache) -> dict:
    """Compile-time constants of a kernel writing keys [tokens, kv_heads, dim] into a cache."""
    _, num_kv_heads, head_dim = key.shape
    return dict(
        BLOCK_SIZE=key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, check_values=True):
    """Write each token's key and value into its cache slot; same contract as the reference.

    ``check_values=False`` skips checking that every slot lies in the cache (a device sync).
    """
    check_reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, check_values=check_values
    )
    check_launchable(key)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *cache_write_strides(key, key_cache),
        **cache_write_meta(key, key_cache),
    )


@triton.jit
def _copy_blocks_kernel(
    cache_addrs_ptr,  # int64 [2 * num_layers]: the address of every key and value cache
    block_mapping_ptr,  # int64 [num_pairs, 2] of (src, dst)
    stride_m_pair,
    stride_m_col,
    CACHE_DTYPE: tl.constexpr,
    BLOCK_NUMEL: tl.constexpr,  # elements per block: block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,
):
    # Grid: (num_pairs, 2 * num_layers). Program (pair, cache) copies one block of one cache.
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    # An address from the table becomes a pointer to the caches' element type.
    base = tl.load(cache_addrs_ptr + cache).to(tl.pointer_type(CACHE_DTYPE))
    src = tl.load(block_mapping_ptr + pair * stride_m_pair)  # int64
    dst = tl.load(block_mapping_ptr + pair * stride_m_pair + stride_m_col)
    # A contiguous cache stores block b as the run [b * BLOCK_NUMEL, (b + 1) * BLOCK_NUMEL).
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        chunk = tl.load(base + src * BLOCK_NUMEL + offs, mask=mask)
        tl.store(base + dst * BLOCK_NUMEL + offs, chunk, mask=mask)


def copy_blocks(key_caches, value_caches, block_mapping, *, check_values=True):
    """Copy blocks (src, dst) in every layer's key and value cache, in one launch.

    Same contract as the reference. ``check_values=False`` skips checking that the block ids
    exist and that destinations are distinct fresh blocks (a device sync).
    """
    check_copy_blocks(key_caches, value_caches, block_mapping, check_values=check_values)
    check_launchable(key_caches[0])
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    caches = [*key_caches, *value_caches]
    first = caches[0]
    addrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
    block_numel = first[0].numel()
    _copy_blocks_kernel[(num_pairs, len(caches))](
        addrs,
        block_mapping,
        *block_mapping.stride(),
        CACHE_DTYPE=tl.dtype(dtype_name(first.dtype)),
        BLOCK_NUMEL=block_numel,
        CHUNK=min(COPY_CHUNK, triton.next_power_of_2(block_numel)),
    )


def swap_blocks(src_cache, dst_cache, block_mapping, *, check_values=True):
    """Copy blocks (src, dst) from ``src_cache`` to ``dst_cache``, e.g. GPU <-> CPU.

    Not a Triton kernel: a Triton program addresses device memory only, and moving data between
    host and device is the job of the GPU's copy engines (DMA over PCIe or NVLink-C2C), not of
    its SMs. So: gather the blocks on the source device, move them in one transfer, scatter them
    on the destination; three calls whatever the number of blocks (vLLM issues one
    cudaMemcpyAsync per block instead, with no staging buffer). On a CPU-only machine both
    caches are on the CPU and this is a plain copy.
    """
    check_swap_blocks(src_cache, dst_cache, block_mapping, check_values=check_values)
    if block_mapping.shape[0] == 0:
        return
    src_ids = block_mapping[:, 0].to(src_cache.device)  # [num_pairs]
    dst_ids = block_mapping[:, 1].to(dst_cache.device)
    blocks = src_cache.index_select(0, src_ids)  # [num_pairs, *block_shape] on the source
    # Host-to-device may run asynchronously: the scatter below follows it on the same CUDA
    # stream. Device-to-host may not: the CPU scatter would read the buffer before it lands.
    blocks = blocks.to(dst_cache.device, non_blocking=dst_cache.is_cuda)
    dst_cache.index_copy_(0, dst_ids, blocks)
