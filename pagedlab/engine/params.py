"""What a request asks for: :class:`SamplingParams` and :class:`BeamSearchParams` (vLLM's
names and defaults).

Plain data, checked when made, in a module of their own (as vLLM's ``sampling_params.py``):
the scheduler, the simulator and the server read them without importing the sampler or the
beam search that compute with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedlab._checks import check_positive

GREEDY_BELOW = 1e-5  # a temperature this small means greedy, as in vLLM


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a request's completions (vLLM's names and defaults).

    ``temperature`` 0 is greedy; ``top_k`` 0 or -1 and ``top_p`` 1 keep every token;
    generation stops at the model's EOS (unless ``ignore_eos``), at any of
    ``stop_token_ids``, at any of the strings ``stop`` (the output text is cut before it; needs
    a tokenizer), or after ``max_tokens`` tokens; ``logprobs=k`` returns, for each generated
    token, the log-probabilities of the ``k`` likeliest tokens and of the sampled one, from the
    model's raw logits (before temperature, top-k and top-p, as vLLM V1 by default).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        check_positive("n", self.n, integer=True)
        check_positive("max_tokens", self.max_tokens, integer=True)
        check_positive("temperature", self.temperature, allow_zero=True)
        check_positive("top_p", self.top_p)
        if self.top_p > 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**63:
            raise ValueError(f"top_k={self.top_k!r} must be -1, 0 (both: off) or a positive int "
                             "below 2**63")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63 - self.n
        ):
            raise ValueError(f"seed={self.seed!r} must be None or an int in [0, 2**63 - n)")
        if self.logprobs is not None:
            check_positive("logprobs", self.logprobs, integer=True, allow_zero=True)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be token ids (ints >= 0)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not _finite(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a finite number")
        check_positive("repetition_penalty", self.repetition_penalty)
        bias = tuple(sorted(dict(self.logit_bias).items()))
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and _finite(b)
                   for t, b in bias):
            raise ValueError(f"logit_bias={self.logit_bias!r} must map token ids (ints >= 0) "
                             "to finite numbers")
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "logit_bias", bias)

    @property
    def width(self) -> int:
        """Sequences the request runs at once."""
        return self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        """Does a bias or a penalty change the logits before the draw?"""
        return bool(self.logit_bias) or (self.presence_penalty, self.frequency_penalty,
                                         self.repetition_penalty) != (0.0, 0.0, 1.0)

    def generators(self, device) -> list[torch.Generator | None]:
        """Each sample's random stream: sample i seeded ``seed + i``; None (global) unseeded."""
        if self.seed is None:
            return [None] * self.n
        return [torch.Generator(device=device).manual_seed(self.seed + i) for i in range(self.n)]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search as in vLLM's ``LLM.beam_search``, plus transformers' ``early_stopping``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        check_positive("beam_width", self.beam_width, integer=True)
        check_positive("max_tokens", self.max_tokens, integer=True)
        if isinstance(self.length_penalty, bool) or not (
            isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)
        ):
            raise ValueError(f"length_penalty={self.length_penalty!r} must be a finite number")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping={self.early_stopping!r} must be True, False or 'never'"
            )

    @property
    def width(self) -> int:
        """Sequences the request runs at once."""
        return self.beam_width
