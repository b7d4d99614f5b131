"""How long a serving step takes on a GPU, from the model's shape and the GPU's datasheet.

A step reads the weights once and every batched sequence's cached keys and values, writes the
new tokens' keys and values, and does ``2 * params`` FLOPs per new token plus the attention
products. Its time is a roofline with achievable (not datasheet) rates, plus a fixed overhead:

    time = max(FLOPs / (peak * compute_efficiency), bytes / (bandwidth * bandwidth_efficiency))
           + step_overhead

Moving blocks between GPU and CPU (swapping) goes over PCIe, one copy per block, layer and
K/V: ``bytes / pcie_bandwidth + copies * copy_latency``. The defaults, and where they come
from, are in :class:`CostModel`.

On several GPUs (tensor parallelism), an optional ``interconnect`` prices the two all-reduces
each layer makes of the step's hidden states, added to the step's time (chapter 14):

    time += 2 * layers * (2(N-1)/N * tokens * d_model * bytes / link_bandwidth + link_latency)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedlab._arith import cdiv
from pagedlab._checks import check_positive
from pagedlab.dtypes import dtype_bytes
from pagedlab.footprint import (
    ModelConfig,
    attention_flops_per_pair,
    get_model,
    kv_bytes_per_token,
    kv_capacity,
    weight_bytes,
)
from pagedlab.hardware import GPU, Interconnect, get_gpu, get_interconnect


def prefill_pairs(prefill_lens: Sequence[int], prefill_starts: Sequence[int]) -> int:
    """Causal (query, key) pairs of prompt chunks: a chunk of ``n`` tokens after ``s`` cached
    ones has its i-th token see the prefix and the chunk up to itself, ``n*s + n(n+1)/2``."""
    return sum(n * s + n * (n + 1) // 2 for n, s in zip(prefill_lens, prefill_starts))


@dataclass(frozen=True)
class CostModel:
    """Seconds per step and per swap for ``model`` on ``num_gpus`` ``gpu`` s (tensor parallel).

    Defaults, and which have a source (chapter 10 prints this and boxes the same table):

    - ``bandwidth_efficiency=0.8``: measured on another GPU only. Our decode kernel moved
      3.79 TB/s on an H200 at batch 64 x 4,096 tokens, 79% of the datasheet's 4.8 TB/s
      (benchmarks/results/decode-gpu.md). For the A100 it is an assumption.
    - ``compute_efficiency=0.6``: an assumption, the share of the datasheet's dense fp16 peak
      that a serving step's matrix products reach.
    - ``step_overhead=0.005`` s: an assumption, not calibrated (the paper reports no step
      times): scheduling, sampling, kernel launches and Python per step. The least certain
      number here; chapter 10's exercise 1 measures how much the results depend on it.
    - ``pcie_bandwidth=25e9`` B/s: an assumption, about 80% of the 31.5 GB/s per direction
      that PCIe 4.0 x16 (16 GT/s a lane, 128b/130b coding) carries.
    - ``copy_latency=5e-6`` s per copy: an assumption. The paper's vLLM (V0) swapped with one
      ``cudaMemcpyAsync`` per block for keys and values in every layer; this is the fixed
      cost of each, and what makes swapping small blocks slow (Fig. 19).
    - ``kv_tile_tokens=16``: an assumption. An attention kernel reads each block as at least a
      tile of this many tokens, so blocks smaller than a tile waste bandwidth: our stand-in
      for the paper's "small blocks underuse the GPU's parallelism" (Fig. 18).
    - ``interconnect=None``: communication is free, as it was before chapter 14 gave the model
      a link, so chapter 10's results (which run on one GPU, or on several with this default)
      do not change. A preset name (``"NVLink-4"``, ``"PCIe-4-x16"``, ...) or an
      :class:`~pagedlab.hardware.Interconnect` prices, on ``num_gpus > 1``, the two
      all-reduces per layer of Megatron-LM's split (after the attention's output projection
      and after the MLP's down projection), each of ``tokens x d_model`` values of
      ``allreduce_dtype`` (``dtype`` unless given) over a ring: :meth:`allreduce_time`. The
      time is *added* to the roofline, not overlapped with it: the next layer's input is the
      all-reduce's output, so no GPU has work to hide it behind (engines that overlap part of
      it split each layer's matrix products into chunks; this model does not). The link's
      bandwidth is its datasheet peak, so the term is a lower bound.
    """

    model: ModelConfig | str
    gpu: GPU | str
    num_gpus: int = 1
    dtype: str = "fp16"
    bandwidth_efficiency: float = 0.8
    compute_efficiency: float = 0.6
    step_overhead: float = 0.005
    pcie_bandwidth: float = 25e9
    copy_latency: float = 5e-6
    kv_tile_tokens: int = 16
    interconnect: Interconnect | str | None = None
    allreduce_dtype: str | None = None  # the hidden states' format; None: ``dtype``

    def __post_init__(self):
        object.__setattr__(self, "model", get_model(self.model))
        object.__setattr__(self, "gpu", get_gpu(self.gpu))
        check_positive("num_gpus", self.num_gpus, integer=True)
        for name in ("bandwidth_efficiency", "compute_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name}={value!r} must be in (0, 1]")
        check_positive("step_overhead", self.step_overhead, allow_zero=True)
        check_positive("pcie_bandwidth", self.pcie_bandwidth)
        check_positive("copy_latency", self.copy_latency, allow_zero=True)
        check_positive("kv_tile_tokens", self.kv_tile_tokens, integer=True)
        if self.interconnect is not None:
            object.__setattr__(self, "interconnect", get_interconnect(self.interconnect))
        m, n = self.model, self.num_gpus
        derived = {  # per-step constants, computed once: a simulation asks millions of times
            "_weight_bytes": weight_bytes(m, self.dtype),
            "_kv_token_bytes": kv_bytes_per_token(m, self.dtype),
            "_flops_per_pair": attention_flops_per_pair(m),
            "_flops_per_token": 2 * (m.n_active_params or m.n_params),
            "_bandwidth": n * self.gpu.bandwidth_bytes_per_s * self.bandwidth_efficiency,
            "_compute": n * self.gpu.peak_flops(self.dtype) * self.compute_efficiency,
            "_hidden_bytes": m.d_model * dtype_bytes(self.allreduce_dtype or self.dtype,
                                                     "allreduce_dtype"),  # a token's hidden state
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_token_bytes

    @property
    def max_context(self) -> int | None:
        """The model's longest sequence, if known: the unchunked token budget's floor."""
        return self.model.max_context

    def kv_read_tokens(self, context_len: int, block_size: int | None) -> int:
        """Tokens' worth of KV one sequence's attention reads: whole blocks, each at least a
        tile; ``block_size=None`` (contiguous cache) reads exactly ``context_len``."""
        if block_size is None:
            return context_len
        return cdiv(context_len, block_size) * max(block_size, self.kv_tile_tokens)

    def step_time(
        self,
        prefill_lens: Sequence[int] = (),
        decode_lens: Sequence[int] = (),
        block_size: int | None = None,
        prefill_starts: Sequence[int] = (),
    ) -> float:
        """Seconds for one step that computes prompt chunks of ``prefill_lens`` tokens, each
        after ``prefill_starts`` tokens already cached (none if omitted: whole prompts), and
        decodes one token for sequences whose contexts (the new token included) are
        ``decode_lens``."""
        if not prefill_lens and not decode_lens:
            return 0.0
        starts = prefill_starts or [0] * len(prefill_lens)
        prefill_tokens = sum(prefill_lens)
        tokens = prefill_tokens + len(decode_lens)
        pairs = prefill_pairs(prefill_lens, starts) + sum(decode_lens)
        contexts = [*decode_lens, *(s for s in starts if s)]  # cached keys attention reads
        if block_size is None:
            read = sum(contexts)
        else:
            read = sum(self.kv_read_tokens(n, block_size) for n in contexts)
        flops = self._flops_per_token * tokens + self._flops_per_pair * pairs
        # Decodes read their context (the new token's slot included, as it is written), chunks
        # their cached prefix; prefills write their tokens' keys and values.
        bytes_moved = self._weight_bytes + self._kv_token_bytes * (read + prefill_tokens)
        seconds = max(flops / self._compute, bytes_moved / self._bandwidth) + self.step_overhead
        if self.interconnect is None:  # communication free: the common case, kept cheap
            return seconds
        return seconds + self.allreduce_time(tokens)

    def allreduce_bytes(self, tokens: int) -> int:
        """Bytes of one all-reduce's tensor in a step of ``tokens`` tokens: every token's
        hidden state, ``tokens * d_model`` values of ``allreduce_dtype``. A layer makes two."""
        check_positive("tokens", tokens, integer=True, allow_zero=True)
        return tokens * self._hidden_bytes

    def allreduce_time(self, tokens: int) -> float:
        """Seconds a step of ``tokens`` tokens spends in all-reduces: two per layer over the
        ``interconnect``; 0 on one GPU or without an interconnect (communication free)."""
        if self.interconnect is None or self.num_gpus == 1 or tokens == 0:
            return 0.0
        one = self.interconnect.allreduce_time(self.allreduce_bytes(tokens), self.num_gpus)
        return 2 * self.model.n_layers * one

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        """Seconds to move ``num_blocks`` blocks over PCIe, one copy per block, layer, K and V."""
        check_positive("num_blocks", num_blocks, integer=True, allow_zero=True)
        check_positive("block_size", block_size, integer=True)
        copies = num_blocks * 2 * self.model.n_layers
        bytes_moved = num_blocks * block_size * self._kv_token_bytes
        return bytes_moved / self.pcie_bandwidth + copies * self.copy_latency

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """Token slots of KV left once the weights are loaded (``footprint.kv_capacity``)."""
        return kv_capacity(self.model, self.gpu, self.num_gpus, self.dtype,
                           gpu_memory_utilization).token_slots
