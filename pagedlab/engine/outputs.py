"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput`` and ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlab.engine.sequence import RequestMetrics, SequenceGroup
from pagedlab.engine.text import output_text


@dataclass
class CompletionOutput:
    """One completion of a request.

    ``finish_reason`` is "stop" (EOS, a stop token or a stop string, named by ``stop_reason``),
    "length" (``max_tokens`` or ``max_model_len``), "abort", "error", or None while unfinished;
    ``text`` is empty without a tokenizer; ``logprobs``, if the request asked for ``k``, holds
    for each token the log-probabilities of the ``k`` likeliest tokens and of the one sampled;
    ``delta``, in a stream (:class:`~pagedlab.engine.async_llm.AsyncLLM`), is the text new
    since the request's previous output.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    delta: str = ""


@dataclass
class RequestOutput:
    """A request's prompt and its ``n`` completions, in index order.

    ``error`` is the exception that failed this request alone (an invalid prompt, a cache too
    small for it); the other requests of the call are not affected.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: Exception | None = None

    @classmethod
    def from_group(cls, group: SequenceGroup, tokenizer=None, prompt: str | None = None):
        seqs = sorted(group.seqs, key=lambda s: s.index)
        outputs = [
            CompletionOutput(
                s.index,
                output_text(s.output_token_ids, s.stop_reason, tokenizer),
                s.output_token_ids.copy(),
                s.cumulative_logprob,
                None if s.logprobs is None else s.logprobs.copy(),
                s.finish_reason,
                s.stop_reason,
            )
            for s in seqs
        ]
        return cls(group.request_id, prompt, group.prompt_token_ids, outputs,
                   group.is_finished, group.metrics, group.error)

    @classmethod
    def failed(cls, request_id: str, error: Exception, prompt=None) -> RequestOutput:
        """A request refused before it ran: no completions, only the error."""
        text = prompt if isinstance(prompt, str) else None
        return cls(request_id, text, [], [], True, error=error)
