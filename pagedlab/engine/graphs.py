"""Decode steps replayed from CUDA graphs (chapters 7 and 8).

A small decode batch on a GPU spends more time launching kernels than running them: each of
SmolLM2's 30 layers launches a dozen. A CUDA graph records the launches of one forward pass
once and replays them with a single call (``torch.cuda.CUDAGraph``; vLLM V1 captures decode
batches this way, at the sizes ``cudagraph_capture_sizes`` lists). What a graph records, it
replays exactly, which sets three rules:

- every tensor the pass reads or writes stays at one address: the step's inputs are copied
  into static buffers, sized once for the largest captured batch;
- every shape is fixed: the batch is padded with dummy decodes to a captured size (the runner
  does this, ``decode_batch_sizes``) and each block table to the widest row a sequence of
  ``max_model_len`` tokens needs;
- nothing inside may wait for the host (no ``.item()``, no tensor built from a Python list).

On a CPU there is nothing to capture: :meth:`DecodeGraphs.run` calls the same function on the
same static buffers, so the CPU tests check the padding and the buffers, and greedy outputs
that do not change.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedlab.model import ForwardBatch, PagedLlama

__all__ = ["DEFAULT_SIZES", "DecodeGraphs"]

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode batch sizes captured by default


class DecodeGraphs:
    """Decode-only forward passes at fixed batch ``sizes``, captured as CUDA graphs on a GPU
    and run eagerly on a CPU, through static buffers: logits for each padded row."""

    def __init__(self, model: PagedLlama, kv_caches: list, kv_scale: Tensor | None,
                 sizes: tuple[int, ...], max_blocks: int):
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one batch size to capture")
        self.model, self.kv_caches, self.kv_scale = model, kv_caches, kv_scale
        self.sizes = tuple(sorted(sizes))
        largest, dev = self.sizes[-1], model.device

        def static(*shape, dtype, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=dev)

        # Dummy rows until a step fills them: token 0 at position 0, written nowhere (slot -1)
        # and reading one key through block 0, as the runner's padding does.
        self.input_ids = static(largest, dtype=torch.int64)
        self.positions = static(largest, dtype=torch.int64)
        self.slot_mapping = static(largest, dtype=torch.int64, fill=-1)
        self.block_tables = static(largest, max_blocks, dtype=torch.int32)
        self.seq_lens = static(largest, dtype=torch.int32, fill=1)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        if dev.type == "cuda":
            self._capture()

    def fits(self, num_decodes: int) -> bool:
        """Can a decode-only step of ``num_decodes`` (padded) rows run here?"""
        return num_decodes in self.sizes

    def run(self, batch: ForwardBatch) -> Tensor:
        """fp32 logits [rows, vocab] of a decode-only ``batch`` padded to a captured size."""
        rows, width = batch.block_tables.shape
        if not self.fits(rows) or batch.prefills:
            raise ValueError(f"a decode-only batch of {rows} rows cannot replay: the sizes "
                             f"captured are {self.sizes}, and prefills never replay")
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {width} blocks is wider than the "
                             f"{self.block_tables.shape[1]} captured (max_model_len)")
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.slot_mapping[:rows].copy_(batch.slot_mapping)
        self.seq_lens[:rows].copy_(batch.seq_lens)
        self.block_tables[:rows, :width].copy_(batch.block_tables)  # entries past: never read
        if rows in self.graphs:
            graph, logits = self.graphs[rows]
            graph.replay()
            return logits
        return self._forward(rows)

    def _forward(self, rows: int) -> Tensor:
        """The pass a graph records: the first ``rows`` static rows through the model."""
        batch = ForwardBatch(
            input_ids=self.input_ids[:rows], positions=self.positions[:rows],
            slot_mapping=self.slot_mapping[:rows], prefills=[],
            block_tables=self.block_tables[:rows], seq_lens=self.seq_lens[:rows],
        )
        hidden = self.model(batch, self.kv_caches, self.kv_scale)
        return self.model.compute_logits(hidden)

    def _capture(self) -> None:
        """Record a graph per size, the largest first so the others reuse its memory pool;
        each after warm-up runs on a side stream (Triton compiles, allocators settle), as
        torch's CUDA-graph notes require. The dummy rows write nothing."""
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for rows in reversed(self.sizes):
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(rows)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(rows)
            pool = graph.pool()
            self.graphs[rows] = (graph, logits)
