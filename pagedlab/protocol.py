"""OpenAI's request bodies as pydantic models (vLLM's ``protocol.py``): every field's type and
range is checked before a request reaches the engine, so that a bad request fails alone, with a
400 that names its field, and never inside a step that other requests share.

Types are strict (``"5"`` is not an integer, ``1`` is not ``true``); numbers must be finite;
text must be encodable as UTF-8 (a lone surrogate is refused here rather than by the
tokenizer). Fields a client may send but this server does not implement are refused by name
(:data:`UNSUPPORTED`) rather than silently ignored; other unknown fields are ignored, as vLLM
does.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # the most alternatives per token a request may ask for (vLLM's default)

UNSUPPORTED = ("suffix", "tools", "tool_choice", "functions", "function_call",
               "response_format", "audio", "modalities", "prediction", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "prompt_logprobs")


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"a lone surrogate at {error.start} is not text (not UTF-8)") from None
    return text


T = TypeVar("T")
Text = Annotated[str, AfterValidator(_utf8)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0)]
Number = Annotated[float, Field(allow_inf_nan=False)]
NonEmpty = Annotated[list[T], Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]  # OpenAI's range
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]  # OpenAI's range


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class _Request(BaseModel):
    """The fields completions and chat share (OpenAI's, and vLLM's extra sampling fields)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text | None = None
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0)
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**62)
    max_tokens: int | None = Field(None, ge=1)
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Number = Field(1.0, gt=0)
    logit_bias: dict[str, Bias] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None


class CompletionRequest(_Request):
    """``POST /v1/completions``: a prompt (text or token ids), or a list of them."""

    prompt: NonEmptyText | NonEmpty[TokenId] | NonEmpty[NonEmptyText] | NonEmpty[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM joins them)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatRequest(_Request):
    """``POST /v1/chat/completions``: a conversation; ``max_completion_tokens`` is OpenAI's
    current name for ``max_tokens``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
