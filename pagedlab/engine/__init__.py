"""A small serving engine on the paged KV cache, with vLLM's user API (chapters 6 and 8).

``params`` (what a request asks for), ``sequence`` (requests as sequence groups, each
sequence carrying its progress), ``step`` (what a step is, what an executor returns, and the
loop body engine and simulator share), ``scheduler_config`` and ``cache_config`` (the
limits and the cache, vLLM's names) and ``scheduler`` (continuous batching, preemption
by recomputation or swapping; no tensors, so the simulator drives it too), ``policy`` (the order
the scheduler serves and preempts in: FCFS, priority, or your own), ``sampling`` and
``beams`` (choosing tokens; parallel samples and beams by fork and copy-on-write),
``runner`` (the KV cache tensors and the model's forward pass), ``graphs`` (decode steps replayed
from CUDA graphs), ``batch`` (the persistent
batch of block-table rows), ``stats`` and ``outputs``
(what a run reports), ``llm`` (the :class:`LLM` facade), ``async_llm`` (the engine online:
requests arriving while others run, tokens streamed back), ``speculative`` (proposals verified
in one pass, rolled back where rejected: chapter 12).
"""

from importlib import import_module

# Each name and the module it lives in, imported on first use: the scheduler and the
# simulator import this package without loading the model, the runner and the Triton kernels.
_EXPORTS = {
    "LLM": "llm",
    "AsyncLLM": "async_llm",
    "BeamSearchOutput": "beams",
    "BeamSearchParams": "params",
    "BeamSearchSequence": "beams",
    "CacheConfig": "cache_config",
    "CacheTooSmall": "scheduler",
    "TooManySequences": "scheduler",
    "InvalidPrompt": "text",
    "PromptTooLong": "text",
    "CompletionOutput": "outputs",
    "EngineStats": "stats",
    "FCFS": "policy",
    "GroupOutput": "sequence",
    "GroupStatus": "sequence",
    "ModelRunner": "runner",
    "Policy": "policy",
    "Priority": "policy",
    "RequestOutput": "outputs",
    "Sampler": "sampling",
    "SamplingParams": "params",
    "Scheduler": "scheduler",
    "SchedulerConfig": "scheduler_config",
    "Sequence": "sequence",
    "SequenceGroup": "sequence",
    "SequenceOutput": "sequence",
    "Drafter": "speculative",
    "NgramProposer": "speculative",
    "Proposer": "speculative",
    "SpeculativeConfig": "speculative",
    "Step": "step",
    "StepOutput": "step",
    "Placeholders": "step",
    "drive": "step",
    "run_step": "step",
    "StepStats": "stats",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedlab.engine' has no attribute {name!r}")
    value = getattr(import_module(f"pagedlab.engine.{_EXPORTS[name]}"), name)
    globals()[name] = value  # the next lookup is an ordinary one
    return value


def __dir__():
    return sorted({*globals(), *_EXPORTS})
