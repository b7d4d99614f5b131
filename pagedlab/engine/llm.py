"""The ``LLM`` facade: vLLM's offline API over pagedlab's model, cache, scheduler and sampler::

    llm = LLM(pagedlab.checkpoints.smollm2())  # a checkpoint directory: model and tokenizer
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].text, llm.stats.summary()
    llm.chat([{"role": "user", "content": "Hello!"}])

One engine step (:meth:`LLM.step`) is :func:`~pagedlab.engine.step.run_step`, the loop body
the simulator runs too: the scheduler forms a batch (and updates the block tables), the runner
makes the block copies, runs the model and samples, the scheduler applies the tokens (fork,
prune, stop, free). ``generate`` adds its requests and steps
until none is left (vLLM's ``LLMEngine`` loop: :meth:`LLM.add_request`, :meth:`LLM.step`,
:meth:`LLM.abort_request`). A step is a transaction: if it raises, every request in flight is
aborted, the blocks it cached before writing them are forgotten, and the engine serves the
next call as a fresh one would. A request that is invalid, that the cache can never hold, or
whose sampling or detokenization raises fails alone: its output carries the error and the
others complete.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from dataclasses import replace

from pagedlab._arith import cdiv
from pagedlab._checks import check_positive, lookup_preset
from pagedlab.engine.beams import BeamSearchOutput
from pagedlab.engine.cache_config import CacheConfig
from pagedlab.engine.draft import DraftModelProposer, early_exit
from pagedlab.engine.graphs import DEFAULT_SIZES
from pagedlab.engine.outputs import RequestOutput
from pagedlab.engine.params import BeamSearchParams, SamplingParams
from pagedlab.engine.policy import POLICIES, Policy
from pagedlab.engine.runner import ModelRunner, block_bytes, profile_num_blocks
from pagedlab.engine.scheduler import CacheTooSmall, Scheduler, SchedulerConfig, TooManySequences
from pagedlab.engine.speculative import Drafter, NgramProposer, SpeculativeConfig
from pagedlab.engine.sequence import SequenceGroup
from pagedlab.engine.stats import EngineStats
from pagedlab.engine.step import Step, run_step
from pagedlab.engine.tensor_parallel import TensorParallelExecutor, build_shard
from pagedlab.engine.text import (
    InvalidPrompt,
    PromptTooLong,
    chat_prompt,
    prompt_token_ids,
    split_prompts,
    stop_string_check,
)
from pagedlab.memory import InvariantError, KVCacheManager
from pagedlab.model import PagedLlama, from_pretrained
from pagedlab.profiling import scope

REQUEST_ERRORS = (InvalidPrompt, CacheTooSmall, TooManySequences)  # fail one request alone


class LLM:
    """A serving engine over a paged KV cache of ``num_gpu_blocks`` blocks of ``block_size``.

    ``model`` is a :class:`~pagedlab.model.PagedLlama` or a checkpoint directory (its tokenizer
    is loaded with it, if it has one); ``tokenizer`` (an object or a directory) enables text
    prompts, ``text`` outputs, stop strings and :meth:`chat`. ``max_model_len`` caps prompt and
    output tokens together (default: the model's ``max_position_embeddings``).
    ``enable_chunked_prefill`` (vLLM's name; on by default, as in V1) splits prompts into
    chunks of the step's token budget ``max_num_batched_tokens`` (see
    :class:`~pagedlab.engine.scheduler.SchedulerConfig` for the defaults); off, prompts are
    prefilled whole, as the paper's vLLM did.

    The cache is allocated once, here, and every API batches in it alike (``generate``, the
    engine API, a server). ``num_gpu_blocks`` sets its size; by default it is what a memory
    budget holds: ``kv_cache_memory_bytes`` if given, else on CUDA what
    ``gpu_memory_utilization`` leaves after the weights, else on a CPU
    ``$PAGEDLAB_CPU_KVCACHE_SPACE`` GiB (1 GiB unset; vLLM's CPU backend reads
    ``VLLM_CPU_KVCACHE_SPACE``), and never more than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens can fill. ``swap_space`` (GiB) or ``num_cpu_blocks`` sizes the
    CPU pool that ``preemption_mode="swap"`` needs; ``kernels``, if given, sets
    ``model.kernels`` ("triton" or "reference"); ``kv_cache_dtype`` is "auto" (the model's
    dtype) or "fp8" (e4m3 caches, half of fp16's bytes, stored with one per-tensor scale
    ``kv_scale`` for keys and values: pagedlab's stand-in for vLLM's ``k_scale``/``v_scale``);
    ``scheduling_policy`` is "fcfs", "priority" (vLLM's names) or any
    :class:`~pagedlab.engine.policy.Policy`; ``record_events`` keeps the manager's event log
    (``llm.manager.events``); ``decode_batch_sizes`` pads every step's decodes with dummy rows
    up to the smallest of these sizes that holds them, as replaying CUDA graphs captured at
    those sizes would (vLLM's ``cudagraph_capture_sizes``); ``cuda_graphs`` runs decode-only
    steps of those sizes (by default powers of two up to ``max_num_seqs``) as CUDA graphs
    captured at start, eagerly on a CPU (:mod:`pagedlab.engine.graphs`);
    ``speculative_config`` (vLLM's, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``)
    turns on speculative decoding (:mod:`pagedlab.engine.speculative`);
    ``tensor_parallel_size`` splits the model by its heads over that many processes, this one
    rank 0 (:mod:`pagedlab.engine.tensor_parallel`; end them with :meth:`shutdown` or a
    ``with`` block); it starts them itself, unless ``distributed_init_method="env://"``: then
    they are started apart, on this machine or others, and meet it through torch.distributed's
    environment variables (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``).
    """

    def __init__(
        self,
        model: PagedLlama | str | os.PathLike,
        *,
        tokenizer=None,
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        swap_space: float = 0,
        num_cpu_blocks: int | None = None,
        preemption_mode: str = "recompute",
        enable_prefix_caching: bool = False,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        max_model_len: int | None = None,
        kernels: str | None = None,
        kv_cache_dtype: str = "auto",
        kv_scale: float = 1.0,
        scheduling_policy: str | Policy = "fcfs",
        record_events: bool = False,
        decode_batch_sizes: tuple[int, ...] = (),
        speculative_config: dict | None = None,
        cuda_graphs: bool = False,
        tensor_parallel_size: int = 1,
        distributed_init_method: str | None = None,
    ):
        cache = CacheConfig(block_size, num_gpu_blocks, gpu_memory_utilization,
                            kv_cache_memory_bytes, swap_space, num_cpu_blocks,
                            enable_prefix_caching, kv_cache_dtype, kv_scale)
        decode_batch_sizes = _decode_batch_sizes(decode_batch_sizes, cuda_graphs, max_num_seqs)
        self.model, self.tokenizer = _load(model, tokenizer, kernels)
        check_positive("tensor_parallel_size", tensor_parallel_size, integer=True)
        if distributed_init_method is not None and tensor_parallel_size == 1:
            raise ValueError(f"distributed_init_method={distributed_init_method!r} needs "
                             "tensor_parallel_size > 1: one process meets no one")
        whole = self.model
        if tensor_parallel_size > 1:  # rank 0's shard: the cache is sized for one rank's heads
            state = {name: t.detach() for name, t in whole.state_dict().items()}
            self.model = build_shard(whole.args, state, 0, tensor_parallel_size, whole.kernels,
                                     whole.dtype, whole.device)
        self.max_model_len = (self.model.args.max_position_embeddings if max_model_len is None
                              else max_model_len)
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
            chunked_prefill=enable_chunked_prefill,
            max_model_len=self.max_model_len,
            policy=lookup_preset("scheduling_policy", scheduling_policy, POLICIES, Policy,
                                 "policies"),
            speculative_config=speculative_config,
        )
        spec = self.config.speculative_config
        if tensor_parallel_size > 1 and (cuda_graphs or spec and spec.method == "draft_model"):
            raise ValueError("tensor_parallel_size > 1 runs neither CUDA graphs nor a draft "
                             "model")
        self.cache_config = cache = _sized(cache, self.model, max_num_seqs, self.max_model_len)
        if preemption_mode == "swap" and cache.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs swap_space (GiB) or num_cpu_blocks > 0")
        self.manager = KVCacheManager(cache.num_gpu_blocks, block_size, cache.num_cpu_blocks,
                                      enable_prefix_caching, record_events=record_events)
        self.scheduler = Scheduler(self.manager, self.config)
        self.drafter = _drafter(self.config.speculative_config, self.model, cache)
        longest = cdiv(self.max_model_len, block_size) if self.max_model_len else None
        layout = (block_size, cache.num_gpu_blocks, cache.num_cpu_blocks, kv_cache_dtype,
                  kv_scale, decode_batch_sizes)
        self.runner = ModelRunner(self.model, *layout, cuda_graphs,
                                  max_blocks=min(cache.num_gpu_blocks, longest or math.inf))
        self.executor = self.runner  # what runs a step: this process, or every rank's
        if tensor_parallel_size > 1:
            self.executor = TensorParallelExecutor(
                self.runner, whole.args, state, tensor_parallel_size, layout,
                distributed_init_method=distributed_init_method)
            weakref.finalize(self, self.executor.shutdown)
        self.stats: EngineStats | None = None  # of the last call
        self.last_step: Step | None = None  # the last step's batch: what a timed replay reads
        self._next_id = 0  # request ids: "0", "1", ...
        self._prompts: dict[str, str | None] = {}  # request id -> prompt text

    # --- the offline API --------------------------------------------------------------------

    def generate(
        self, prompts, sampling_params=None, use_tqdm: bool = True, priority=None
    ) -> list[RequestOutput]:
        """Complete each prompt: text, token ids, or ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}``; one prompt or a list.

        ``sampling_params``: one SamplingParams for all prompts, or one per prompt;
        ``priority``: one int per prompt, smaller first, for ``scheduling_policy="priority"``.
        """
        prompts = split_prompts(prompts)
        params = _per_prompt("sampling_params", sampling_params, len(prompts), SamplingParams)
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        return self._run(list(zip(prompts, params, priority)), use_tqdm)[0]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` messages) or to a list
        of them, under the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            request_id = str(self._next_id + len(prompts))  # the id generate will give it
            try:
                prompts.append(chat_prompt(conversation, request_id, self.tokenizer))
            except InvalidPrompt as error:
                prompts.append(error)  # fails this request alone, under this id
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False):
        """The best ``params.beam_width`` beams of each prompt: a list of BeamSearchOutput."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, not {type(params).__name__}")
        outs, groups = self._run([(p, params, 0) for p in split_prompts(prompts)], use_tqdm)
        for out in outs:
            if out.error is not None:
                raise out.error
        return [BeamSearchOutput(groups[out.request_id].completed) for out in outs]

    # --- the engine API (vLLM's LLMEngine) --------------------------------------------------

    def add_request(self, request_id: str, prompt, params, arrival_time: float | None = None,
                    priority: int = 0) -> SequenceGroup:
        """Queue a request; raise :class:`InvalidPrompt`, :class:`CacheTooSmall` or
        :class:`TooManySequences` if it can never run (nothing is queued then)."""
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise TypeError(f"request {request_id!r}: params must be a SamplingParams or a "
                            f"BeamSearchParams, not {type(params).__name__}")
        if isinstance(prompt, InvalidPrompt):
            raise prompt
        ids, text = prompt_token_ids(prompt, request_id, self.tokenizer)
        self._check_prompt(request_id, ids, params)
        stop = set() if params.ignore_eos else set(self.model.args.eos_token_ids)
        check = None
        if isinstance(params, SamplingParams):
            stop.update(params.stop_token_ids)
            generators = params.generators(self.model.device)
            if params.stop and self.tokenizer is None:
                raise InvalidPrompt(f"request {request_id!r}: stop strings need a tokenizer")
            if params.adjusts_logits and self.config.speculative_config is not None:
                raise ValueError(f"request {request_id!r}: logit_bias and penalties are not "
                                 "supported with speculative decoding")
            check = stop_string_check(params.stop, self.tokenizer)
        else:
            generators = ()
        group = self.scheduler.add_request(request_id, ids, params, stop, generators, priority,
                                           check)
        if arrival_time is not None:
            group.metrics.arrival_time = arrival_time
        self._prompts[request_id] = text
        return group

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of the requests it advanced, finished or failed."""
        step = self._step()
        return [self._step_output(g) for g in [*step.groups, *step.failed]]

    def abort_request(self, request_id: str) -> None:
        """Stop an unfinished request and free its blocks."""
        group = self.scheduler.unfinished.get(request_id)
        if group is None:
            raise KeyError(f"request {request_id!r} is not running (unknown or finished)")
        self.scheduler.abort(group)
        self._prompts.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def shutdown(self) -> None:
        """End the engine's worker processes (tensor parallelism); nothing to do otherwise."""
        if self.executor is not self.runner:
            self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- inside -----------------------------------------------------------------------------

    def _step(self):
        """One transactional step: on any error, abort everything in flight and forget the
        blocks cached before their keys and values were written, then re-raise."""
        try:
            with scope("pagedlab::step"):  # a scope pagedlab.profiling reads
                step, ran, _ = run_step(self.scheduler, self.executor, drafter=self.drafter)
        except BaseException:
            self.scheduler.abort_all()
            self.manager.rollback()
            self._prompts.clear()
            raise
        self.last_step = step
        if self.stats is not None:
            self.stats.steps.append(step.stats)
            self.stats.generated_tokens += sum(len(out.children) for out in ran.outputs)
        return step

    def _run(self, requests, use_tqdm: bool):
        """Add the requests (each failing alone), step until all are done; return the outputs
        and the groups by request id."""
        stats = self.stats = EngineStats(self.manager.num_gpu_blocks, num_requests=len(requests))
        prefix_before = self.manager.prefix_stats
        start = time.perf_counter()
        outs, groups = [], {}
        for prompt, params, priority in requests:
            request_id = str(self._next_id)
            self._next_id += 1
            try:
                group = self.add_request(request_id, prompt, params, priority=priority)
            except REQUEST_ERRORS as error:
                outs.append(RequestOutput.failed(request_id, error, prompt))
            else:
                groups[request_id] = group
                stats.prompt_tokens += len(group.prompt_token_ids)
                outs.append(request_id)
        bar = _progress_bar(len(groups), use_tqdm)
        try:
            while self.scheduler.has_unfinished:
                step = self._step()
                if bar is not None:
                    bar.update(sum(g.is_finished for g in (*step.groups, *step.failed)))
        finally:
            if bar is not None:
                bar.close()
        self._check_no_leak()
        stats.elapsed_s = time.perf_counter() - start
        prefix = self.manager.prefix_stats
        stats.prefix_hits = prefix.hits - prefix_before.hits
        stats.prefix_misses = prefix.misses - prefix_before.misses
        outs = [o if isinstance(o, RequestOutput) else self._output(groups[o]) for o in outs]
        return outs, groups

    def _step_output(self, group: SequenceGroup) -> RequestOutput:
        """``group``'s output after a step; if making it raises (its tokens do not decode),
        the request fails alone: aborted, its output carrying the error."""
        try:
            return self._output(group, keep=not group.is_finished)
        except Exception as error:  # noqa: BLE001  (whatever it is, it is this request's)
            if not group.is_finished:
                self.abort_request(group.request_id)
            self._prompts.pop(group.request_id, None)
            return RequestOutput.failed(group.request_id, error)

    def _output(self, group: SequenceGroup, keep: bool = False) -> RequestOutput:
        prompts = self._prompts
        text = prompts.get(group.request_id) if keep else prompts.pop(group.request_id, None)
        return RequestOutput.from_group(group, self.tokenizer, text)

    def _check_prompt(self, request_id: str, ids: list[int], params) -> None:
        """Token ids inside the vocabulary, a prompt within ``max_model_len``."""
        vocab = self.model.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidPrompt(
                f"request {request_id!r}: prompt token ids {bad[:5]} are outside the vocabulary "
                f"[0, {vocab})"
            )
        if not ids:
            raise InvalidPrompt(f"request {request_id!r}: the prompt has no tokens")
        limit = self.max_model_len
        if limit is not None and len(ids) >= limit:
            raise PromptTooLong(
                f"request {request_id!r}: its prompt of {len(ids)} tokens leaves no room to "
                f"generate within max_model_len={limit}"
            )
        if (limit is not None and isinstance(params, BeamSearchParams)
                and len(ids) + params.max_tokens > limit):
            raise PromptTooLong(
                f"request {request_id!r}: prompt ({len(ids)}) + max_tokens "
                f"({params.max_tokens}) exceeds max_model_len={limit} for beam search"
            )

    def _check_no_leak(self) -> None:
        """Every block must be free or parked once no request is left."""
        if self.scheduler.has_unfinished:
            return
        self.manager.check_invariants()
        gpu, cpu = self.manager.num_used_blocks, self.manager.cpu.num_used
        if gpu or cpu:
            raise InvariantError(f"blocks leaked after the run: {gpu} GPU, {cpu} CPU")


def _per_prompt(name: str, given, count: int, kind: type) -> list:
    """One value for every prompt, or a list of one per prompt, each a ``kind``."""
    values = [given or kind()] * count if given is None or isinstance(given, kind) else list(given)
    if len(values) != count:
        raise ValueError(f"{len(values)} {name} for {count} prompts")
    for i, value in enumerate(values):
        if not isinstance(value, kind):
            raise TypeError(f"{name}[{i}] must be a {kind.__name__}, not {type(value).__name__}")
    return values


def _load(model, tokenizer, kernels):
    """The model (loaded if given as a checkpoint directory, its ``kernels`` set) and its
    tokenizer (the checkpoint's own if it has one and none is given)."""
    if isinstance(model, (str, os.PathLike)):
        if tokenizer is None:
            tokenizer = _tokenizer_in(model)
        model = from_pretrained(model, kernels=kernels)
    elif not isinstance(model, PagedLlama):
        raise TypeError(f"model must be a PagedLlama or a checkpoint directory, not "
                        f"{type(model).__name__}")
    elif kernels is not None:
        model.kernels = kernels
    return model, _load_tokenizer(tokenizer)


def _sized(cache: CacheConfig, model: PagedLlama, max_num_seqs: int,
           max_model_len: int | None) -> CacheConfig:
    """``cache`` with both pools sized: the GPU's by its memory budget, never past what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens can fill; the CPU's by
    ``swap_space``."""
    num_gpu_blocks, num_cpu_blocks = cache.num_gpu_blocks, cache.num_cpu_blocks
    if num_gpu_blocks is None:
        num_gpu_blocks = profile_num_blocks(model, cache.block_size,
                                            cache.gpu_memory_utilization, cache.kv_cache_dtype,
                                            cache.kv_cache_memory_bytes)
        if max_model_len is not None:  # blocks past these could never be used
            num_gpu_blocks = min(num_gpu_blocks,
                                 max_num_seqs * cdiv(max_model_len, cache.block_size))
    if num_cpu_blocks is None:
        per_block = block_bytes(model, cache.block_size, cache.kv_cache_dtype)
        num_cpu_blocks = int(cache.swap_space * (1 << 30) // per_block)
    return replace(cache, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks)


def _drafter(spec: SpeculativeConfig | None, model: PagedLlama,
             cache: CacheConfig) -> Drafter | None:
    """The proposer ``spec`` asks for, in its drafter: n-gram lookup, or a draft model cut
    from the target (:func:`~pagedlab.engine.draft.early_exit`) with a pool as big as the
    target's."""
    if spec is None:
        return None
    if spec.method == "draft_model":
        proposer = DraftModelProposer(early_exit(model, spec.draft_layers), cache.block_size,
                                      cache.num_gpu_blocks)
    else:
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return Drafter(proposer, spec.num_speculative_tokens)


def _decode_batch_sizes(sizes: tuple[int, ...], cuda_graphs: bool,
                        max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes padded to: as given, or with ``cuda_graphs`` by default powers
    of two up to ``max_num_seqs`` (vLLM's rule too: none above it)."""
    for size in sizes:
        check_positive("decode_batch_sizes", size, integer=True)
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs={cuda_graphs!r} must be a bool")
    if cuda_graphs and not sizes:
        return tuple(s for s in DEFAULT_SIZES if s < max_num_seqs) + (max_num_seqs,)
    return tuple(sizes)


def _tokenizer_in(path) -> str | None:
    """The checkpoint directory itself, if it holds a tokenizer."""
    return str(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None


def _load_tokenizer(tokenizer):
    """A tokenizer object, loaded with transformers if given as a directory."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer)


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req")
