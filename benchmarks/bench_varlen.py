"""The mixed-batch kernel (paged_attention_varlen) against the kernels a step would use without it.

Two questions, each answered as a ratio of times measured in the same run:

- decode steps: is varlen on a batch of one-token queries as fast as the decode kernel
  (``paged_attention``, with its split-KV heuristic)? If not, an engine keeps the decode kernel
  for decode-only steps.
- prefill chunks: how does varlen on ``batch`` chunks of ``chunk`` tokens, each after a cached
  prefix of ``prefix`` tokens, compare with SDPA on the same tokens laid out contiguously
  ([batch, kv_heads, prefix + chunk, head_dim]) with a bottom-right causal mask? SDPA is
  handed its contiguous K/V for free (the gather is not timed): the baseline a non-paged
  engine would run.

On CUDA: 32 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16 tokens. On a CPU the
sizes are interpreter-sized and the times measure Triton's interpreter, not the kernel.

    python benchmarks/bench_varlen.py [--out PATH]
"""

from __future__ import annotations

import argparse
import re
import time
from functools import partial
from pathlib import Path

import pagedlab  # noqa: F401  (first: on a CPU it switches Triton to its interpreter)
import torch
import torch.nn.functional as F
import triton
from bench_decode import DEVICE, contiguous_kv, save, seconds_per_call
from torch.nn.attention.bias import causal_lower_right

from pagedlab.device import HAS_CUDA, INTERPRET, describe
from pagedlab.kernels import paged_attention, paged_attention_varlen
from pagedlab.kernels.inputs import random_varlen_inputs

SHAPES = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
GPU = dict(
    SHAPES,
    decode=[(b, c) for b in (1, 8, 64, 256) for c in (512, 4096)],  # (batch, context)
    chunks=[(4, p, c) for p in (0, 4096) for c in (256, 2048)],  # (batch, prefix, chunk)
)
CPU = dict(
    SHAPES, num_heads=8, num_kv_heads=2, head_dim=64,
    decode=[(1, 64), (4, 64)],
    chunks=[(2, 0, 32), (2, 64, 32)],
)


def inputs(cfg: dict, batch: int, prefix: int, chunk: int):
    shapes = {k: cfg[k] for k in SHAPES}
    return random_varlen_inputs(
        [prefix + chunk] * batch, [chunk] * batch, device=DEVICE, spare_blocks=0,
        spare_table_entries=0, **shapes,
    )


def decode_point(cfg: dict, batch: int, context: int) -> dict:
    """varlen and the decode kernel on ``batch`` one-token queries after ``context`` - 1 tokens."""
    x = inputs(cfg, batch, context - 1, 1)
    varlen = partial(paged_attention_varlen, *x.args(), check_values=False)
    decode = partial(
        paged_attention, x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens,
        check_values=False,
    )
    diff = (varlen() - decode()).float().abs().max().item()
    return dict(
        batch=batch, context=context, max_abs_diff=diff,
        varlen_s=seconds_per_call(varlen), decode_s=seconds_per_call(decode),
    )


def chunk_point(cfg: dict, batch: int, prefix: int, chunk: int) -> dict:
    """varlen and SDPA on ``batch`` chunks of ``chunk`` tokens after ``prefix`` cached ones."""
    x = inputs(cfg, batch, prefix, chunk)
    context = prefix + chunk
    k = contiguous_kv(x.key_cache, x.block_tables, context)  # [batch, kv_heads, context, D]
    v = contiguous_kv(x.value_cache, x.block_tables, context)
    q = x.query.view(batch, chunk, *x.query.shape[1:]).transpose(1, 2)  # [batch, H, chunk, D]
    mask = causal_lower_right(chunk, context)
    sdpa = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, enable_gqa=True)
    varlen = partial(paged_attention_varlen, *x.args(), check_values=False)
    diff = (varlen() - sdpa().transpose(1, 2).flatten(0, 1)).float().abs().max().item()
    visible = batch * (chunk * prefix + chunk * (chunk + 1) // 2)  # (query, key) pairs computed
    flops = 4 * visible * cfg["num_heads"] * cfg["head_dim"]  # QK^T and PV, 2 FLOPs per MAC
    row = dict(batch=batch, prefix=prefix, chunk=chunk, flops=flops, max_abs_diff=diff)
    row.update(varlen_s=seconds_per_call(varlen), sdpa_s=seconds_per_call(sdpa))
    return row


def markdown(results: dict) -> str:
    lines = [
        f"Mixed-batch attention on {results['device']} ({results['note']})",
        "",
        "Decode-only steps: speed-up of varlen over the decode kernel (above 1: varlen faster).",
        "",
        "| batch | context | varlen µs | decode kernel µs | speed-up | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["decode"]:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['varlen_s'] * 1e6:.1f} "
            f"| {r['decode_s'] * 1e6:.1f} | {r['decode_s'] / r['varlen_s']:.2f} "
            f"| {r['max_abs_diff']:.2g} |"
        )
    lines += [
        "",
        "Prefill chunks after a cached prefix: speed-up of varlen over SDPA on contiguous K/V.",
        "",
        "| batch | prefix | chunk | varlen µs | TFLOP/s | SDPA µs | speed-up | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["chunks"]:
        lines.append(
            f"| {r['batch']} | {r['prefix']} | {r['chunk']} | {r['varlen_s'] * 1e6:.1f} "
            f"| {r['flops'] / r['varlen_s'] / 1e12:.3g} | {r['sdpa_s'] * 1e6:.1f} "
            f"| {r['sdpa_s'] / r['varlen_s']:.2f} | {r['max_abs_diff']:.2g} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="JSON path (a .md table is written beside it)")
    args = parser.parse_args()

    cfg = GPU if HAS_CUDA else CPU
    device = torch.cuda.get_device_name(DEVICE) if HAS_CUDA else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    out = args.out or Path("benchmarks/results") / f"varlen-{slug}.json"
    note = "GPU" if HAS_CUDA else "CPU, interpreter-sized: times measure Triton's interpreter"
    print(describe(), "|", note, flush=True)

    start = time.perf_counter()
    decode = []
    for batch, context in cfg["decode"]:
        decode.append(decode_point(cfg, batch, context))
        print(f"decode {batch}x{context}: {decode[-1]}", flush=True)
    chunks = []
    for batch, prefix, chunk in cfg["chunks"]:
        chunks.append(chunk_point(cfg, batch, prefix, chunk))
        print(f"chunks {batch}x({prefix}+{chunk}): {chunks[-1]}", flush=True)

    results = dict(
        device=device, note=note, torch=torch.__version__, triton=triton.__version__,
        interpreter=INTERPRET, config={k: str(v) for k, v in cfg.items()},
        seconds=time.perf_counter() - start, decode=decode, chunks=chunks,
    )
    save(out, results, markdown(results))


if __name__ == "__main__":
    main()
