"""The scheduler's limits, with vLLM's names and defaults, and its policy (chapters 6 and 9).

Kept apart from :mod:`pagedlab.engine.scheduler` so that the scheduler reads as policy: what a
step may hold is configuration; what goes in it is the scheduler's decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedlab._checks import check_positive
from pagedlab.engine.policy import FCFS, Policy
from pagedlab.engine.speculative import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "swap")

DEFAULT_BUDGET = 2048  # vLLM's SchedulerConfig default for max_num_batched_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits (vLLM's names and defaults) and its policy.

    ``max_num_batched_tokens`` (the step's token budget) defaults to 2048 with chunked
    prefill; without it, to at least ``max_model_len`` (vLLM's rule then: a budget below the
    context would leave the longest prompts no step to run in).
    """

    max_num_seqs: int = 256  # sequences decoding at once
    max_num_batched_tokens: int | None = None  # tokens in one forward pass
    preemption_mode: str = "recompute"  # or "swap"
    watermark: float = 0.01  # fraction of GPU blocks admission leaves free
    policy: Policy = FCFS()  # the order of admission, decode, preemption and swap-in
    chunked_prefill: bool = True  # False: prompts prefilled whole (the paper's vLLM, V0)
    max_model_len: int | None = None  # the longest sequence; sizes the unchunked budget
    speculative_config: SpeculativeConfig | dict | None = None  # proposals per decode

    def __post_init__(self):
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.of(self.speculative_config))
        check_positive("max_num_seqs", self.max_num_seqs, integer=True)
        if not isinstance(self.chunked_prefill, bool):
            raise TypeError(f"chunked_prefill={self.chunked_prefill!r} must be a bool")
        if self.max_model_len is not None:
            check_positive("max_model_len", self.max_model_len, integer=True)
        if self.max_num_batched_tokens is not None:
            check_positive("max_num_batched_tokens", self.max_num_batched_tokens, integer=True)
        if self.token_budget < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.token_budget} must be at least "
                f"max_num_seqs={self.max_num_seqs}: each running sequence decodes a token a step"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r} must be one of {PREEMPTION_MODES}"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark={self.watermark!r} must be in [0, 1)")
        if not isinstance(self.policy, Policy):
            raise TypeError(
                f"policy={self.policy!r} must be an instance of a pagedlab.engine.Policy "
                "subclass, such as FCFS() (an instance, not the class)"
            )

    @property
    def token_budget(self) -> int:
        """The step's token budget: ``max_num_batched_tokens``, or its default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.chunked_prefill:
            return max(DEFAULT_BUDGET, self.max_num_seqs)
        return max(DEFAULT_BUDGET, self.max_num_seqs, self.max_model_len or 0)
