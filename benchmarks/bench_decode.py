"""Decode attention on the paged KV cache: achieved bandwidth, and speed against torch baselines.

On CUDA: batch {1, 8, 64, 256} x context {512, 4096, 32768} tokens, 32 query heads, 8 KV heads,
head_dim 128, bf16, blocks of 16 tokens. For each point it reports the Triton kernel's
achieved bandwidth (KV bytes read per second) as a share of the device's copy bandwidth,
measured in the same run (bytes read + written by a large device-to-device copy), and the
kernel's speed-up over

- the torch reference (``pagedlab.kernels.reference``, a loop over sequences),
- SDPA on the same tokens laid out contiguously ([batch, kv_heads, context, head_dim]),
- compiled flex_attention on torch's ``PagedAttention`` layout, where torch ships it.

Each baseline's output is compared with the kernel's (``max_abs_diff``). A baseline that does
not fit in free memory, fails, or (for the slow ones) comes after ``--budget-s`` seconds is
skipped, and the results say why. On a CPU the kernel runs through Triton's interpreter: a small
problem runs in seconds, flex_attention runs eagerly, and the times measure the interpreter.

    python benchmarks/bench_decode.py [--out PATH] [--budget-s SECONDS]
"""

from __future__ import annotations

import argparse
import json
import re
import time
import warnings
from functools import partial
from pathlib import Path

import pagedlab  # noqa: F401  (first: on a CPU it switches Triton to its interpreter)
import torch
import torch.nn.functional as F
import triton

from pagedlab.device import HAS_CUDA, INTERPRET, describe
from pagedlab.kernels import paged_attention, reference
from pagedlab.kernels.decode import choose_num_splits
from pagedlab.kernels.inputs import random_paged_inputs
from pagedlab.timing import copy_bandwidth, seconds_per_call

try:
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask
except ImportError:  # an older torch: the flex column is skipped
    PagedAttention = None

SHAPES = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
GPU = dict(batches=(1, 8, 64, 256), contexts=(512, 4096, 32768), **SHAPES)
CPU = dict(SHAPES, batches=(1, 4), contexts=(64, 256), num_heads=8, num_kv_heads=2, head_dim=64)
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
BASELINES = ("reference", "sdpa", "flex")


def free_bytes() -> float:
    return torch.cuda.mem_get_info()[0] if HAS_CUDA else float("inf")


def contiguous_kv(cache, block_tables, context):
    """The paged cache as [batch, kv_heads, context, head_dim], as a non-paged server holds it."""
    blocks = cache[block_tables.long()]  # [batch, blocks_per_seq, block_size, kv_heads, D]
    return blocks.flatten(1, 2)[:, :context].transpose(1, 2).contiguous()


def flex_paged(q4, k, v, block_size):
    """flex_attention (compiled on CUDA) on torch's PagedAttention layout, same tokens as k, v."""
    batch, kv_heads, context, head_dim = k.shape
    n_pages = batch * context // block_size
    pages = PagedAttention(n_pages, block_size, batch, device=DEVICE)
    k_cache = k.new_empty(1, kv_heads, n_pages * block_size, head_dim)  # torch's paged layout
    v_cache = torch.empty_like(k_cache)
    positions = torch.arange(context, device=DEVICE)[None]  # [1, context]
    for b in range(batch):
        idx = torch.tensor([b], device=DEVICE)
        pages.reserve(idx, torch.tensor(context, device=DEVICE))
        pages.assign(idx, positions, k[b : b + 1], v[b : b + 1], k_cache, v_cache)
    mask = create_block_mask(noop_mask, batch, 1, 1, context, device=DEVICE, BLOCK_SIZE=block_size)
    mask = pages.convert_logical_block_mask(mask)
    score_mod = pages.get_score_mod(None)
    if HAS_CUDA:
        torch._dynamo.reset()  # one fresh compile per shape, never dynamo's eager fallback
        flex = torch.compile(flex_attention, fullgraph=True)
    else:  # eager: compiling would take longer than the whole CPU run
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        flex = flex_attention
    return lambda: flex(q4, k_cache, v_cache, block_mask=mask, score_mod=score_mod, enable_gqa=True)


def bench_point(cfg: dict, batch: int, context: int, slow_skip: str | None) -> dict:
    """Time the kernel and each baseline on ``batch`` sequences of ``context`` tokens."""
    shapes = {k: cfg[k] for k in SHAPES}
    x = random_paged_inputs(
        [context] * batch, device=DEVICE, spare_blocks=0, spare_table_entries=0, **shapes
    )
    kv_bytes = 2 * x.key_cache.numel() * x.key_cache.element_size()  # K and V, each slot read once
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if HAS_CUDA else None
    row = dict(batch=batch, context=context, kv_bytes=kv_bytes, skipped={}, max_abs_diff={})
    row["num_splits"] = choose_num_splits(batch, cfg["num_kv_heads"], context, sms) if sms else 1
    out = paged_attention(*x.args(), check_values=False)  # [batch, num_heads, head_dim]
    row["triton_s"] = seconds_per_call(lambda: paged_attention(*x.args(), check_values=False))

    def measure(name, setup):
        """setup() returns the baseline's call: check its output against the kernel's, time it."""
        try:
            fn = setup()
            row["max_abs_diff"][name] = (fn().reshape(out.shape) - out).float().abs().max().item()
            row[f"{name}_s"] = seconds_per_call(fn)
        except Exception as e:  # a baseline's failure is a result, not the end of the run
            row["skipped"][name] = f"failed: {type(e).__name__}: {e}"[:300]

    def skip(name, reason):
        row["skipped"][name] = reason

    if slow_skip:
        skip("reference", slow_skip)
    else:
        measure("reference", lambda: partial(reference.paged_attention, *x.args()))
    if free_bytes() < 1.2 * kv_bytes:  # contiguous K and V are a second copy of the cache
        for name in ("sdpa", "flex"):
            skip(name, f"contiguous KV needs {kv_bytes / 1e9:.1f} GB; too little memory free")
        return row
    k = contiguous_kv(x.key_cache, x.block_tables, context)  # [batch, kv_heads, context, D]
    v = contiguous_kv(x.value_cache, x.block_tables, context)
    q4 = x.query[:, :, None]  # [batch, num_heads, 1, head_dim]
    measure("sdpa", lambda: partial(F.scaled_dot_product_attention, q4, k, v, enable_gqa=True))
    if PagedAttention is None:
        skip("flex", "torch.nn.attention.experimental._paged_attention is not importable")
    elif slow_skip:
        skip("flex", slow_skip)
    elif free_bytes() < 1.2 * kv_bytes:  # its paged layout is a third copy
        skip("flex", f"its paged cache needs {kv_bytes / 1e9:.1f} GB; too little memory free")
    else:
        measure("flex", partial(flex_paged, q4, k, v, cfg["block_size"]))
    return row


def markdown(results: dict) -> str:
    """The results as a markdown table, with the reasons for skipped cells below it."""
    lines = [
        f"Decode attention on {results['device']} ({results['note']})",
        "",
        f"Copy bandwidth: {results['copy_bandwidth'] / 1e9:.0f} GB/s (read + write). "
        "Speed-up: the baseline's time over the Triton kernel's.",
        "",
        "| batch | context | KV MB | splits | Triton µs | GB/s | % of copy "
        "| speed-up over reference | over SDPA | over flex |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in results["points"]:
        speedups = [
            f"{r[f'{name}_s'] / r['triton_s']:.2f}" if f"{name}_s" in r else "—"
            for name in BASELINES
        ]
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['kv_bytes'] / 1e6:.3g} | {r['num_splits']} "
            f"| {r['triton_s'] * 1e6:.1f} | {r['bandwidth'] / 1e9:.3g} "
            f"| {100 * r['share_of_copy']:.3g} | {' | '.join(speedups)} |"
        )
        notes += [f"- {r['batch']}x{r['context']} {k}: {why}" for k, why in r["skipped"].items()]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def save(out: Path, results: dict, table: str) -> None:
    """The results as JSON at ``out`` and as a markdown table beside it; print the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table, f"\nwrote {out} and {out.with_suffix('.md')}", sep="")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="JSON path (a .md table is written beside it)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="after this many seconds, skip the slow baselines (reference, flex)",
    )
    args = parser.parse_args()

    cfg = GPU if HAS_CUDA else CPU
    device = torch.cuda.get_device_name(DEVICE) if HAS_CUDA else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    out = args.out or Path("benchmarks/results") / f"decode-{slug}.json"
    note = "GPU" if HAS_CUDA else "CPU, interpreter-sized: times measure Triton's interpreter"
    print(describe(), "|", note, flush=True)

    copy_bw = copy_bandwidth(2**30 if HAS_CUDA else 2**26)
    points, start = [], time.perf_counter()
    for batch in cfg["batches"]:
        for context in cfg["contexts"]:
            spent = time.perf_counter() - start > args.budget_s
            row = bench_point(cfg, batch, context, "time budget spent" if spent else None)
            row["bandwidth"] = row["kv_bytes"] / row["triton_s"]
            row["share_of_copy"] = row["bandwidth"] / copy_bw
            points.append(row)
            print(
                f"batch {batch:4d} context {context:6d}: {row['triton_s'] * 1e6:9.1f} µs, "
                f"{100 * row['share_of_copy']:5.1f}% of copy bandwidth",
                flush=True,
            )
            if HAS_CUDA:
                torch.cuda.empty_cache()

    results = dict(
        device=device,
        note=note,
        torch=torch.__version__,
        triton=triton.__version__,
        interpreter=INTERPRET,
        config={k: str(v) for k, v in cfg.items()},
        copy_bandwidth=copy_bw,
        seconds=time.perf_counter() - start,
        points=points,
    )
    save(out, results, markdown(results))


if __name__ == "__main__":
    main()
