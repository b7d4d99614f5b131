"""A small serving engine on the paged KV cache, with vLLM's user API (chapters 6 and 8).

``sequence`` (requests as sequence groups), ``scheduler`` (continuous batching, preemption by
recomputation or swapping; no tensors, so the simulator drives it too), ``policy`` (the order
the scheduler serves and preempts in: FCFS, priority, or your own), ``sampling`` and
``beam_search`` (choosing tokens; parallel samples and beams by fork and copy-on-write),
``runner`` (the KV cache tensors and the model's forward pass), ``stats`` and ``outputs``
(what a run reports), ``llm`` (the :class:`LLM` facade).
"""

from pagedlab.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedlab.engine.llm import LLM
from pagedlab.engine.outputs import CompletionOutput, RequestOutput
from pagedlab.engine.policy import FCFS, Policy, Priority
from pagedlab.engine.runner import ModelRunner
from pagedlab.engine.sampling import Sampler, SamplingParams
from pagedlab.engine.scheduler import (
    CacheTooSmall,
    Scheduler,
    SchedulerConfig,
    Step,
    TooManySequences,
)
from pagedlab.engine.sequence import (
    GroupOutput,
    GroupStatus,
    Sequence,
    SequenceGroup,
    SequenceOutput,
)
from pagedlab.engine.stats import EngineStats, StepStats
from pagedlab.engine.text import InvalidPrompt, PromptTooLong

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CacheTooSmall",
    "CompletionOutput",
    "EngineStats",
    "FCFS",
    "GroupOutput",
    "GroupStatus",
    "InvalidPrompt",
    "ModelRunner",
    "Policy",
    "Priority",
    "PromptTooLong",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceGroup",
    "SequenceOutput",
    "Step",
    "StepStats",
    "TooManySequences",
]
