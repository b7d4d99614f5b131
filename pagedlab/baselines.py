"""The engine against transformers on one workload: tokens per second and KV memory at peak
(chapter 8 and ``benchmarks/bench_engine.py``).

A workload is requests with ShareGPT-like prompt and output lengths (:mod:`pagedlab.sim.traces`)
scaled to the model, EOS ignored, so every engine produces exactly the same number of tokens.
Three ways to serve it:

- pagedlab's :class:`~pagedlab.LLM`: continuous batching over the paged cache;
- transformers' ``generate`` in batches (left padding): each batch runs until its longest
  request is done and keeps a contiguous cache of ``batch x (longest prompt + longest output)``
  tokens, so only the requested tokens count as throughput;
- transformers' own continuous batching over a paged cache (``generate_batch``'s manager), where
  the installed version has it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedlab._arith import cdiv
from pagedlab.sim.traces import sample_lengths
from pagedlab.timing import Elapsed, stopwatch


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and how many tokens each request generates."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Run:
    """One engine's pass over a workload: wall-clock and process CPU seconds (all threads);
    ``peak_kv_bytes`` None where it cannot be read."""

    engine: str
    seconds: float
    cpu_seconds: float
    tokens: int
    peak_kv_bytes: int | None
    note: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_cpu_second(self) -> float:
        """Throughput by CPU time: on a shared CPU, what the work cost, whatever else ran."""
        return self.tokens / self.cpu_seconds


def workload(n: int, vocab_size: int, *, scale: float = 0.25, max_context: int = 2048,
             seed: int = 0, skip_ids=()) -> Workload:
    """``n`` ShareGPT-like requests with lengths multiplied by ``scale`` (at least one token
    each) and random prompt tokens, avoiding the ids in ``skip_ids`` (special tokens)."""
    rng = np.random.default_rng(seed)
    prompt_lens, output_lens = sample_lengths("sharegpt", n, rng, max_context)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(skip_ids), dtype=np.int64))
    prompts = [rng.choice(allowed, max(1, round(p * scale))).tolist() for p in prompt_lens]
    return Workload(prompts, [max(1, round(o * scale)) for o in output_lens])


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys and values of one token in every layer, for a transformers Llama-family config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def run_pagedlab(llm, work: Workload) -> Run:
    """The engine on every request at once (its scheduler batches them continuously)."""
    from pagedlab import SamplingParams
    from pagedlab.engine.runner import block_bytes

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]
    with stopwatch(llm.model.device) as t:
        outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params,
                            use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cache = llm.cache_config
    per_block = block_bytes(llm.model, cache.block_size, cache.kv_cache_dtype)
    return Run("pagedlab", t.wall, t.cpu, tokens, llm.stats.peak_blocks_used * per_block)


def run_generate(hf, work: Workload, batch_size: int) -> Run:
    """transformers' ``generate``, ``batch_size`` requests at a time in arrival order."""
    device, pad = hf.device, 0
    per_token = kv_bytes_per_token(hf.config, hf.dtype)
    total, tokens, peak = Elapsed(), 0, 0
    for first in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[first : first + batch_size]
        wanted = work.output_lens[first : first + batch_size]
        width, new = max(map(len, prompts)), max(wanted)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=device)  # left padding, masked out
        with stopwatch(device) as t:
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=pad)  # no EOS before `new`
        total.wall, total.cpu = total.wall + t.wall, total.cpu + t.cpu
        assert out.shape[1] == width + new
        tokens += sum(wanted)  # what was asked for; the rest of each row is waste
        peak = max(peak, len(prompts) * (width + new) * per_token)
    return Run(f"transformers generate (batch {batch_size})", total.wall, total.cpu, tokens,
               peak)


def run_continuous_batching(hf, work: Workload, page_size: int = 256) -> Run:
    """transformers' continuous batching manager, each request with its own length, its paged
    cache sized to hold the whole workload at once (left to itself it takes 90% of free
    memory, a CPU's RAM included); a Run with a note instead of numbers where this
    transformers lacks it or it fails."""
    pages = sum(cdiv(len(p) + n, page_size) for p, n in zip(work.prompts, work.output_lens))
    per_token = kv_bytes_per_token(hf.config, hf.dtype)
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(do_sample=False, max_new_tokens=max(work.output_lens),
                                  eos_token_id=-1, pad_token_id=0)
        cb_config = ContinuousBatchingConfig(
            page_size=page_size, num_blocks=pages,
            max_batch_tokens=max(2048, max(map(len, work.prompts))),
        )
        with stopwatch(hf.device) as t, hf.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5
        ) as manager:
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
                   for p, n in zip(work.prompts, work.output_lens)]
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("the manager stopped before every request finished")
        tokens = sum(len(r.generated_tokens) for r in results.values())
    except Exception as error:  # noqa: BLE001  (reported, not hidden: see Run.note)
        return Run("transformers continuous batching", float("nan"), float("nan"), 0, None,
                   note=f"not measured: {type(error).__name__}: {error}"[:200])
    return Run("transformers continuous batching", t.wall, t.cpu, tokens,
               pages * page_size * per_token)
