"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput`` and ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlab.engine.sequence import SequenceGroup


@dataclass
class CompletionOutput:
    """One completion of a request; ``finish_reason`` is "stop" (a stop token or EOS), "length"
    (``max_tokens``) or None while unfinished."""

    index: int
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None


@dataclass
class RequestOutput:
    """A request's prompt and its ``n`` completions, in index order."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

    @classmethod
    def from_group(cls, group: SequenceGroup) -> RequestOutput:
        seqs = sorted(group.seqs, key=lambda s: s.index)
        outputs = [
            CompletionOutput(s.index, s.output_token_ids.copy(), s.cumulative_logprob,
                             s.finish_reason)
            for s in seqs
        ]
        return cls(group.request_id, group.prompt_token_ids, outputs, group.is_finished)
