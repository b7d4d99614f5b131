"""The model runner: owns the KV cache tensors and runs a scheduled step on the model.

The scheduler hands it a :class:`~pagedlab.engine.step.Step`; the runner makes the step's
block copies (swaps, then copy-on-write), turns the step's chunks into a
:class:`~pagedlab.model.ForwardBatch` (token ids, positions, slots, block tables), runs the
model and samples, and returns a :class:`~pagedlab.engine.step.StepOutput`. The simulator of
chapter 10 replaces exactly this class with a cost model that returns the same type.

``kv_cache_dtype="fp8"`` (vLLM's name) keeps the caches in e4m3, one byte per value, with one
scale ``kv_scale`` for keys and values (vLLM's default 1.0: no calibration); "auto" keeps them
in the model's dtype.
"""

from __future__ import annotations

import itertools
import math
import os

import torch
from torch import Tensor

from pagedlab.dtypes import FP8
from pagedlab.engine.batch import PersistentBatch
from pagedlab.engine.graphs import DecodeGraphs
from pagedlab.engine.sampling import Sampler
from pagedlab.engine.step import Step, StepOutput
from pagedlab.footprint import kv_bytes_per_token
from pagedlab.model import ForwardBatch, PagedLlama, Prefill
from pagedlab.profiling import scope

CPU_KVCACHE_SPACE = "PAGEDLAB_CPU_KVCACHE_SPACE"  # GiB of KV cache on a CPU (vLLM's CPU backend
DEFAULT_CPU_KVCACHE_GIB = 1.0  # reads VLLM_CPU_KVCACHE_SPACE the same way); 1 GiB if unset
KV_CACHE_DTYPES = ("auto", "fp8")


def cache_dtype(model: PagedLlama, kv_cache_dtype: str) -> torch.dtype:
    """The caches' torch dtype: the model's for "auto", e4m3 for "fp8"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} must be one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return model.dtype if kv_cache_dtype == "auto" else FP8


def block_bytes(model: PagedLlama, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block: keys and values of ``block_size`` tokens in every layer (chapter 1's
    KV bytes per token, for the model's shape and the cache's dtype)."""
    dtype = cache_dtype(model, kv_cache_dtype)
    return block_size * kv_bytes_per_token(model.args.footprint(), dtype)


def cpu_kv_cache_bytes() -> int:
    """The KV budget on a CPU: ``$PAGEDLAB_CPU_KVCACHE_SPACE`` GiB, else 1 GiB."""
    text = os.environ.get(CPU_KVCACHE_SPACE, "").strip()
    try:
        gib = float(text) if text else DEFAULT_CPU_KVCACHE_GIB
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"{CPU_KVCACHE_SPACE}={text!r} must be a positive number of GiB")
    return int(gib * (1 << 30))


def profile_num_blocks(
    model: PagedLlama, block_size: int, gpu_memory_utilization: float,
    kv_cache_dtype: str = "auto", kv_cache_memory_bytes: int | None = None,
) -> int:
    """GPU blocks the engine allocates once, at start-up: ``kv_cache_memory_bytes`` if given;
    else, on CUDA, the free memory above a ``1 - utilization`` headroom left for activations
    and other processes; on a CPU, :func:`cpu_kv_cache_bytes`."""
    per_block = block_bytes(model, block_size, kv_cache_dtype)
    if kv_cache_memory_bytes is not None:
        kv_bytes, where = kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif model.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(model.device)
        kv_bytes = free - (1 - gpu_memory_utilization) * total
        where = (f"gpu_memory_utilization={gpu_memory_utilization}: {free / 2**30:.1f} GiB "
                 f"free of {total / 2**30:.1f} GiB on {model.device}")
    else:
        kv_bytes, where = cpu_kv_cache_bytes(), f"{CPU_KVCACHE_SPACE} on a CPU"
    if kv_bytes < per_block:
        raise ValueError(
            f"{where} leaves {max(kv_bytes, 0) / 2**20:.1f} MiB, no room for one KV block of "
            f"{per_block:,} bytes: give more, or pass num_gpu_blocks"
        )
    return int(kv_bytes // per_block)


def _movable(cache: Tensor) -> Tensor:
    """``cache`` as block copies take it. A copy moves bytes, not values, but copy_blocks takes
    only fp32/fp16/bf16 (and the CPU has no fp8 ``index_copy_`` for swap_blocks), so an fp8
    cache is viewed as fp16: two e4m3 bytes per element (head_dim is even), copied bit for bit.
    uint8 would be the natural view, but copy_blocks rejects it too."""
    return cache.view(torch.float16) if cache.dtype == FP8 else cache


class ModelRunner:
    """Per-layer key and value caches on the model's device, their CPU swap space, and the
    forward pass of a step; ``decode_batch_sizes`` pads each step's decodes to one of those
    sizes (the shapes CUDA graphs are captured at; padding must change no token). With
    ``cuda_graphs``, decode-only steps of those sizes run through :class:`DecodeGraphs`
    (replayed on a GPU, eager on a CPU), block tables padded to ``max_blocks`` entries."""

    def __init__(
        self,
        model: PagedLlama,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        kv_cache_dtype: str = "auto",
        kv_scale: float = 1.0,
        decode_batch_sizes: tuple[int, ...] = (),
        cuda_graphs: bool = False,
        max_blocks: int | None = None,
    ):
        self.model = model
        self.samples = True  # False on a tensor-parallel worker: rank 0 alone samples
        self.decode_batch_sizes = tuple(sorted(decode_batch_sizes))
        a = model.args
        shape = (block_size, a.num_kv_heads, a.head_dim)  # one block
        dev, pin = model.device, model.device.type == "cuda"
        dtype = cache_dtype(model, kv_cache_dtype)
        # fp32 []: what tells the model its caches are fp8; None when they are not
        self.kv_scale = (
            None if kv_cache_dtype == "auto"
            else torch.tensor(kv_scale, dtype=torch.float32, device=dev)
        )

        def caches(num_blocks, device, pin_memory=False):  # empty: pages cost when first written
            return [
                tuple(torch.empty(num_blocks, *shape, dtype=dtype, device=device,
                                  pin_memory=pin_memory) for _ in "kv")
                for _ in range(a.num_layers)
            ]  # per layer: [num_blocks, block_size, num_kv_heads, head_dim] twice

        self.kv_caches = caches(num_gpu_blocks, dev)
        self.cpu_caches = caches(num_cpu_blocks, "cpu", pin)
        self.batch = PersistentBatch(dev)  # the block tables of the sequences in the batch
        self.sampler = Sampler()
        self.graphs = None
        if cuda_graphs:
            if max_blocks is None:
                raise ValueError("cuda_graphs needs max_blocks: the widest block table a "
                                 "sequence of max_model_len tokens has")
            self.graphs = DecodeGraphs(model, self.kv_caches, self.kv_scale,
                                       self.decode_batch_sizes, max_blocks)

    def execute(self, step: Step) -> StepOutput:
        """Run ``step`` and sample from the logits of each chunk that reaches its sequence's
        end (a partial prompt chunk samples nothing)."""
        if step.is_empty:
            return StepOutput([])
        with scope("pagedlab::prepare"):  # scopes pagedlab.profiling reads
            batch, last, rows = self.prepare(step)
        with scope("pagedlab::forward"):
            self._move_blocks(step)
            graphs = self.graphs
            if graphs is not None and not step.multi_token and graphs.fits(len(batch.seq_lens)):
                logits = graphs.run(batch)[last]  # [num_logits, vocab], fp32
            else:
                hidden = self.model(batch, self.kv_caches, self.kv_scale)  # [num_tokens, hidden]
                if not self.samples:
                    return StepOutput([])
                logits = self.model.compute_logits(hidden[last])  # [num_logits, vocab], fp32
        with scope("pagedlab::sample"):
            drafts = {c.seq.seq_id: c.draft for c in step.decodes if c.draft}
            return StepOutput(self.sampler(step.sampled_groups, rows, logits, drafts))

    def _move_blocks(self, step: Step) -> None:
        """Swaps first, then copy-on-write: the order the manager's docstring requires."""
        ops = self.model.ops
        for pairs, src, dst in (
            (step.swap_out, self.kv_caches, self.cpu_caches),
            (step.swap_in, self.cpu_caches, self.kv_caches),
        ):
            if pairs:
                mapping = torch.tensor(pairs, dtype=torch.int64)  # [num_pairs, 2]
                for src_layer, dst_layer in zip(src, dst):
                    for src_cache, dst_cache in zip(src_layer, dst_layer):
                        ops.swap_blocks(_movable(src_cache), _movable(dst_cache), mapping,
                                        check_values=False)  # the manager's own pairs
        if step.copies:
            mapping = torch.tensor(step.copies, dtype=torch.int64, device=self.model.device)
            keys, values = zip(*self.kv_caches)
            ops.copy_blocks([_movable(k) for k in keys], [_movable(v) for v in values], mapping,
                            check_values=False)

    def prepare(self, step: Step) -> tuple[ForwardBatch, Tensor, dict[int, int]]:
        """The step as tensors; the token rows whose logits are needed (each sampling chunk's
        last, and a speculative decode's proposals too), and each sampled sequence's first row
        among those logits. Everything comes from the step's chunks: the runner never asks
        the manager. Block tables come from the persistent batch, which writes only what
        changed.

        Chunks of several query tokens (prefill chunks, then speculative decodes) attend like
        prefills, causal within the chunk; one-token decodes go to the decode kernel.
        """
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.model.device)

        multi, decodes = step.multi_token, step.single_token
        ids, positions, slots, last, first_row = [], [], [], [], {}
        for chunk in multi + decodes:
            ids += chunk.token_ids
            positions += range(chunk.start, chunk.context_len)
            slots += chunk.slots
            if chunk.is_sampled:
                first_row[chunk.seq.seq_id] = len(last)
                last += range(len(ids) - 1 - len(chunk.draft), len(ids))
        rows = self.batch.update(multi + decodes)
        num_prefills, seq_lens = len(multi), [c.context_len for c in decodes]
        decode_tables = self.batch.gather(rows[num_prefills:])  # [num_decodes, longest]
        pad = self._padding(len(decodes))
        if pad:  # dummy decodes: token 0 at position 0, written nowhere, reading one slot
            ids, positions, slots = ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
            seq_lens += [1] * pad
            decode_tables = torch.cat([decode_tables,
                                       decode_tables.new_zeros(pad, decode_tables.shape[1])])
        prefill_tables = self.batch.gather(rows[:num_prefills])  # [num_prefills, longest]
        starts = [0, *itertools.accumulate(c.num_tokens for c in multi)]  # rows
        prefills = [Prefill(starts[i], starts[i + 1], c.start, prefill_tables[i])
                    for i, c in enumerate(multi)]
        batch = ForwardBatch(
            input_ids=tensor(ids, torch.int64),  # [num_tokens]
            positions=tensor(positions, torch.int64),  # [num_tokens]
            slot_mapping=tensor(slots, torch.int64),  # [num_tokens]
            prefills=prefills,
            block_tables=decode_tables,  # [num_decodes (+ padding), longest]
            seq_lens=tensor(seq_lens, torch.int32),  # [num_decodes (+ padding)]
        )
        return batch, tensor(last, torch.int64), first_row

    def _padding(self, num_decodes: int) -> int:
        """Dummy decodes that bring the batch to the smallest of ``decode_batch_sizes`` that
        holds it (none if no size does): the fixed shapes a captured CUDA graph replays at."""
        if num_decodes == 0:
            return 0
        size = next((s for s in self.decode_batch_sizes if s >= num_decodes), num_decodes)
        return size - num_decodes
