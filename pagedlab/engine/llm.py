"""The ``LLM`` facade: vLLM's offline API over pagedlab's model, cache, scheduler and sampler::

    llm = LLM(pagedlab.model.from_hf(hf_model), block_size=16, num_gpu_blocks=64)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].token_ids, llm.stats.summary()

One engine step is: the scheduler forms a batch (and updates the block tables), the runner
makes the block copies and runs the model, the sampler picks tokens, the scheduler applies
them (fork, prune, stop, free). After every call the manager's invariants are checked and
every block must be back: free, or parked in the prefix cache.
"""

from __future__ import annotations

import itertools
import os
import time

from pagedlab._checks import lookup_preset
from pagedlab.engine.beams import BeamSearchOutput, BeamSearchParams
from pagedlab.engine.outputs import RequestOutput
from pagedlab.engine.policy import POLICIES, Policy
from pagedlab.engine.runner import ModelRunner, block_bytes, profile_num_blocks
from pagedlab.engine.sampling import Sampler, SamplingParams
from pagedlab.engine.scheduler import Scheduler, SchedulerConfig
from pagedlab.engine.sequence import SequenceGroup
from pagedlab.engine.stats import EngineStats
from pagedlab.memory import InvariantError, KVCacheManager
from pagedlab.model import PagedLlama, from_pretrained


class LLM:
    """A serving engine over a paged KV cache of ``num_gpu_blocks`` blocks of ``block_size``.

    ``model`` is a :class:`~pagedlab.model.PagedLlama` (or a checkpoint directory).
    ``num_gpu_blocks`` defaults to what ``gpu_memory_utilization`` leaves;
    ``swap_space`` (GiB) or ``num_cpu_blocks`` sizes the CPU pool that ``preemption_mode="swap"``
    needs; ``kernels``, if given, sets ``model.kernels`` ("triton" or "reference");
    ``kv_cache_dtype`` is "auto" (the model's dtype) or "fp8" (e4m3 caches, half of fp16's
    bytes, stored with the per-tensor scale ``kv_scale`` for keys and values, as vLLM's);
    ``scheduling_policy`` is "fcfs", "priority" (vLLM's names) or any
    :class:`~pagedlab.engine.policy.Policy`; ``record_events`` keeps the manager's event log
    (``llm.manager.events``).
    """

    def __init__(
        self,
        model: PagedLlama | str | os.PathLike,
        *,
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        swap_space: float = 0,
        num_cpu_blocks: int | None = None,
        preemption_mode: str = "recompute",
        enable_prefix_caching: bool = False,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        kernels: str | None = None,
        kv_cache_dtype: str = "auto",
        kv_scale: float = 1.0,
        scheduling_policy: str | Policy = "fcfs",
        record_events: bool = False,
    ):
        if isinstance(model, (str, os.PathLike)):
            model = from_pretrained(model, kernels=kernels)
        elif kernels is not None:
            model.kernels = kernels
        self.model = model
        if num_gpu_blocks is None:
            num_gpu_blocks = profile_num_blocks(
                model, block_size, gpu_memory_utilization, kv_cache_dtype
            )
        if num_cpu_blocks is None:
            per_block = block_bytes(model, block_size, kv_cache_dtype)
            num_cpu_blocks = int(swap_space * (1 << 30) // per_block)
        if preemption_mode == "swap" and num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs swap_space (GiB) or num_cpu_blocks > 0")
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(2048, max_num_seqs),
            preemption_mode=preemption_mode,
            policy=lookup_preset("scheduling_policy", scheduling_policy, POLICIES, Policy,
                                 "policies"),
        )
        self.manager = KVCacheManager(
            num_gpu_blocks, block_size, num_cpu_blocks, enable_prefix_caching,
            record_events=record_events,
        )
        self.scheduler = Scheduler(self.manager, config)
        self.runner = ModelRunner(
            model, block_size, num_gpu_blocks, num_cpu_blocks, kv_cache_dtype, kv_scale
        )
        self.sampler = Sampler()
        self.stats: EngineStats | None = None  # of the last call
        self._request_ids = itertools.count()

    def generate(
        self, prompts, sampling_params=None, use_tqdm: bool = True, priority=None
    ) -> list[RequestOutput]:
        """Complete each prompt (a list of token ids, or ``{"prompt_token_ids": [...]}``).

        ``sampling_params``: one SamplingParams for all prompts, or one per prompt;
        ``priority``: one int per prompt, smaller first, for ``scheduling_policy="priority"``.
        """
        prompts = _parse_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        priority = [0] * len(prompts) if priority is None else list(priority)
        for name, given in (("sampling_params", sampling_params), ("priority", priority)):
            if len(given) != len(prompts):
                raise ValueError(f"{len(given)} {name} for {len(prompts)} prompts")
        groups = self._run(list(zip(prompts, sampling_params, priority)), use_tqdm)
        return [RequestOutput.from_group(g) for g in groups]

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False):
        """The best ``params.beam_width`` beams of each prompt: a list of BeamSearchOutput."""
        groups = self._run([(p, params, 0) for p in _parse_prompts(prompts)], use_tqdm)
        return [BeamSearchOutput(g.completed) for g in groups]

    # --- the engine loop --------------------------------------------------------------------

    def _run(self, requests, use_tqdm: bool) -> list[SequenceGroup]:
        stats = EngineStats(self.manager.num_gpu_blocks, num_requests=len(requests))
        prefix_before = self.manager.prefix_stats
        bar = _progress_bar(len(requests), use_tqdm)
        start = time.perf_counter()
        try:
            groups = [self._add(*request) for request in requests]
            while self.scheduler.has_unfinished:
                step = self.scheduler.schedule()
                logits = self.runner.execute(step, self.manager)  # [num_seqs, vocab]
                rows = {seq.seq_id: i for i, seq in enumerate(step.seqs)}
                outputs = self.sampler(step.groups, rows, logits)
                finished = self.scheduler.update(outputs)
                stats.steps.append(step.stats)
                stats.generated_tokens += sum(len(out.children) for out in outputs)
                if bar is not None:
                    bar.update(len(finished))
        finally:
            if bar is not None:
                bar.close()
            self.scheduler.abort_all()  # nothing, unless an error stopped the loop
            self._check_no_leak()
        stats.elapsed_s = time.perf_counter() - start
        stats.prompt_tokens = sum(len(prompt) for prompt, _, _ in requests)
        prefix = self.manager.prefix_stats
        stats.prefix_hits = prefix.hits - prefix_before.hits
        stats.prefix_misses = prefix.misses - prefix_before.misses
        self.stats = stats
        return groups

    def _add(self, prompt: list[int], params, priority: int) -> SequenceGroup:
        request_id = str(next(self._request_ids))
        vocab = self.model.args.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary "
                f"[0, {vocab})"
            )
        stop = set() if params.ignore_eos else set(self.model.args.eos_token_ids)
        if isinstance(params, SamplingParams):
            stop.update(params.stop_token_ids)
            generators = params.generators(self.model.device)
        else:
            generators = ()
        return self.scheduler.add_request(request_id, prompt, params, stop, generators, priority)

    def _check_no_leak(self) -> None:
        """Every block must be free or parked once no request is left."""
        self.manager.check_invariants()
        gpu, cpu = self.manager.num_used_blocks, self.manager.cpu.num_used
        if gpu or cpu:
            raise InvariantError(f"blocks leaked after the run: {gpu} GPU, {cpu} CPU")


def _parse_prompts(prompts) -> list[list[int]]:
    """One prompt or a list of them; each a list of token ids or {"prompt_token_ids": [...]}."""
    if isinstance(prompts, dict) or (len(prompts) and isinstance(prompts[0], int)):
        prompts = [prompts]
    parsed = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            raise TypeError("text prompts need a tokenizer; pass lists of token ids")
        parsed.append([int(t) for t in prompt])
    return parsed


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req")
