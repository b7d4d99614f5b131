"""Between text and tokens: what a prompt may be, chat templates, detokenized outputs and stop
strings (chapter 8).

A prompt is text, a sequence of token ids (a list, or a 1-D integer tensor or array) or one of
vLLM's prompt dicts, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``. Each is checked on
its own: a bad one raises :class:`InvalidPrompt` naming its request, so the engine can fail that
request alone. A tokenizer is any object with transformers' ``encode``, ``decode`` and
``apply_chat_template``.
"""

from __future__ import annotations

from numbers import Integral

import numpy as np
import torch

CHAT_ROLES = ("system", "user", "assistant", "tool")
PROMPT_KEYS = ("prompt", "prompt_token_ids")


class InvalidPrompt(ValueError):
    """A prompt the engine cannot serve; the message names the request and what is wrong."""


class PromptTooLong(InvalidPrompt):
    """A prompt with more tokens than ``max_model_len``."""


def split_prompts(prompts) -> list:
    """One prompt or a list of them, as a list of single prompts (checked later, one by one)."""
    if isinstance(prompts, (str, dict, torch.Tensor, np.ndarray)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and isinstance(prompts[0], (Integral, np.integer)):
            return [prompts]  # one prompt of token ids
        return list(prompts)
    raise TypeError(
        f"prompts must be a prompt or a list of prompts (text, token ids or a dict), "
        f"not {type(prompts).__name__}"
    )


def prompt_token_ids(prompt, request_id: str, tokenizer=None) -> tuple[list[int], str | None]:
    """(token ids, text or None) of one prompt; :class:`InvalidPrompt` names what is wrong."""
    where = f"request {request_id!r}"
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown or len(prompt) != 1:
            raise InvalidPrompt(
                f"{where}: a prompt dict has exactly one of the keys {PROMPT_KEYS}, not "
                f"{sorted(prompt)}"
            )
        ((key, prompt),) = prompt.items()
        if key == "prompt" and not isinstance(prompt, str):
            raise InvalidPrompt(f"{where}: 'prompt' must be text, not {type(prompt).__name__}")
        if key == "prompt_token_ids" and isinstance(prompt, str):
            raise InvalidPrompt(f"{where}: 'prompt_token_ids' must be token ids, not text")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidPrompt(f"{where}: a text prompt needs a tokenizer (LLM(..., tokenizer=))")
        if not prompt:
            raise InvalidPrompt(f"{where}: the prompt is an empty string")
        return tokenizer.encode(prompt), prompt
    return _token_ids(prompt, where), None


def _token_ids(prompt, where: str) -> list[int]:
    """Integers only: Python, numpy or torch ones, or a 1-D integer tensor or array."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        integer = (not prompt.dtype.is_floating_point and not prompt.dtype.is_complex
                   and prompt.dtype != torch.bool) if isinstance(prompt, torch.Tensor) else (
            np.issubdtype(prompt.dtype, np.integer))
        if prompt.ndim != 1 or not integer:
            raise InvalidPrompt(
                f"{where}: a tensor or array prompt must be 1-D of integers, not "
                f"{tuple(prompt.shape)} of {prompt.dtype}"
            )
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, (list, tuple)):
        raise InvalidPrompt(
            f"{where}: a prompt is text, token ids or a dict, not {type(prompt).__name__}"
        )
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, (Integral, np.integer))]
    if bad:
        raise InvalidPrompt(f"{where}: token ids must be integers, got {bad[:3]!r}")
    return [int(t) for t in prompt]


def chat_prompt(messages, request_id: str, tokenizer) -> str:
    """The text of a conversation under the tokenizer's chat template, ready for the reply."""
    where = f"request {request_id!r}"
    if tokenizer is None:
        raise InvalidPrompt(f"{where}: chat needs a tokenizer with a chat template")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidPrompt(f"{where}: a conversation is a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise InvalidPrompt(f"{where}: message {i} must be a dict with text 'content'")
        if message.get("role") not in CHAT_ROLES:
            raise InvalidPrompt(
                f"{where}: message {i} has role {message.get('role')!r}; roles are {CHAT_ROLES}"
            )
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                         tokenize=False)


def stop_string_check(stops: tuple[str, ...], tokenizer):
    """A function of a sequence that returns the first stop string its output text contains
    (None if none), for the scheduler's stop check; None if there are no stop strings."""
    if not stops:
        return None

    def check(seq) -> str | None:
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        found = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
        return stops[min(found)[1]] if found else None

    return check


def output_text(token_ids: list[int], stop_reason, tokenizer) -> str:
    """Detokenized output, cut before the stop string that ended it (as vLLM does)."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if isinstance(stop_reason, str):
        text = text[: text.find(stop_reason)]
    return text
