"""Prompt shapes accepted by `LLM.generate`, as plain typed dicts with vLLM's names and keys.

A prompt is a `str`, a list of token ids, a `TextPrompt` or a `TokensPrompt`:

    llm.generate(TokensPrompt(prompt_token_ids=[1, 2, 3]))
    llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": [1, 2, 3]}])
"""
from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any, TypedDict, Union


class _PromptExtras(TypedDict, total=False):
    # vLLM's optional keys. nanoserve accepts them only when they ask for nothing (None):
    # it has no multimodal inputs and no per-request cache salt.
    multi_modal_data: Any
    mm_processor_kwargs: dict[str, Any] | None
    multi_modal_uuids: Any
    cache_salt: str | None


class _TextPromptRequired(TypedDict):
    prompt: str


class TextPrompt(_TextPromptRequired, _PromptExtras, total=False):
    """A text prompt, tokenized by the engine."""


class _TokensPromptRequired(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptRequired, _PromptExtras, total=False):
    """A tokenized prompt; `prompt`, when given, is only reported back in `RequestOutput.prompt`."""

    prompt: str


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

# The optional keys above: a prompt dict may carry them set to None, nothing else.
EXTRA_PROMPT_KEYS = tuple(_PromptExtras.__annotations__)


def _is_token_id(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def as_prompt_list(prompts) -> list:
    """Any accepted `prompts` of `generate` -> a list with one prompt per entry."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if type(prompts).__module__ == "numpy" and getattr(prompts, "ndim", None) == 1:
        prompts = prompts.tolist()  # a column of a Ray Data / pandas batch, as vLLM's examples pass it
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise TypeError(f"prompts must be a str, a list of str, token ids or prompt dicts; got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty")
    if all(_is_token_id(p) for p in prompts):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)


def parse_prompt(prompt, i: int) -> tuple[str | None, list[int] | None]:
    """One prompt (number i, for error messages) -> (text, token ids); one of the two may be None."""
    if isinstance(prompt, dict):
        return _parse_dict(prompt, i)
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, (list, tuple)):
        return None, _token_ids(prompt, i)
    raise TypeError(f"prompt {i} must be a str, a list of token ids or a prompt dict, got {type(prompt).__name__}")


def _parse_dict(prompt: dict, i: int) -> tuple[str | None, list[int] | None]:
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", *EXTRA_PROMPT_KEYS})
    if unknown:
        raise ValueError(f"prompt {i} has unknown key(s) {unknown}; a prompt dict holds 'prompt' or 'prompt_token_ids'")
    for key in EXTRA_PROMPT_KEYS:
        if prompt.get(key) is not None:
            raise ValueError(
                f"prompt {i}: {key} is not supported (nanoserve takes text or token ids only, with no "
                "multimodal data or cache salt); leave it out or None"
            )
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"prompt {i}: 'prompt' must be a str, got {type(text).__name__}")
    if "prompt_token_ids" in prompt:
        return text, _token_ids(prompt["prompt_token_ids"], i)
    if text is None:
        raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'")
    return text, None


def _token_ids(ids, i: int) -> list[int]:
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)) or not all(_is_token_id(t) for t in ids):
        raise TypeError(f"prompt {i} must hold int token ids, got {list(ids)[:5] if isinstance(ids, Sequence) else ids!r}")
    return [int(t) for t in ids]
