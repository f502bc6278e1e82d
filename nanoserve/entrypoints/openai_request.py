"""One OpenAI Batch input line -> a validated engine request, with vLLM's OpenAI-server mapping.

A line is `{"custom_id", "method": "POST", "url", "body"}`; the body is a Chat Completions or
Completions request. Fields map onto SamplingParams as in vLLM's `ChatCompletionRequest` /
`CompletionRequest.to_sampling_params`, with unset fields taken from the checkpoint's
generation_config.json, and `max_tokens` bounded by the context as vLLM's server does.
Fields that would change the output but that nanoserve cannot honour are rejected, never ignored.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


from nanoserve.entrypoints.openai_embeddings import EMBEDDINGS_URL, EmbeddingLine, build_embedding_requests
from nanoserve.llm import LLM
from nanoserve.chat import render_conversations
from nanoserve.sampling_params import ALL_LOGPROBS, SamplingParams
from nanoserve.engine.input_processor import EngineRequest
from nanoserve.structured.openai import structured_outputs_from_body

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)

# Body fields nanoserve cannot honour, each with the test for a value that asks for nothing.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "stream": lambda v: v is False,
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1,
    "use_beam_search": lambda v: v is False,
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in ("none", "auto"),
    "structural_tag": lambda v: False,
    "logits_processors": lambda v: not v,
    "truncate_prompt_tokens": lambda v: False,
    "prompt_embeds": lambda v: False,
    "documents": lambda v: not v,
    "return_tokens_as_token_ids": lambda v: v is False,
    "return_token_ids": lambda v: v is False,
    "spaces_between_special_tokens": lambda v: v is True,
}

# SamplingParams fields copied as they are when the body sets them (vLLM's names).
_PLAIN_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words",
)
# vLLM's server clamps each logit_bias value into this range (SamplingParams.from_optional:
# min(100, max(-100, v)), in that order, so a NaN becomes -100 as there).
_LOGIT_BIAS_LIMIT = 100.0
# Fields whose default, when the body leaves them out, comes from generation_config.json.
_DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class CompletionLine:
    """A completions line whose `prompt` lists several prompts: one engine request each, answered
    in one record (vLLM's choices for prompt i are i * n ... i * n + n - 1)."""

    requests: list[EngineRequest]


class BatchLineError(ValueError):
    """A line that is not a usable batch request at all (bad JSON, no custom_id, ...)."""


class ModelNotFoundError(LookupError):
    """The body names a model this run does not serve (HTTP 404 in vLLM's server)."""


def parse_line(text: str) -> tuple[str, dict]:
    """(custom_id, the whole record) of one input line; BatchLineError when there is neither."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise BatchLineError(f"invalid JSON: {e}") from None
    if not isinstance(record, dict):
        raise BatchLineError(f"a batch line must be a JSON object, got {type(record).__name__}")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError(f"custom_id must be a non-empty string, got {custom_id!r}")
    return custom_id, record


class RequestBuilder:
    """Turns a batch record into an EngineRequest for one served model (the `--model`)."""

    def __init__(self, llm: LLM, model: str) -> None:
        self.llm = llm
        self.processor = llm.engine.input_processor
        self.model = model
        self.model_names = {model, os.path.basename(os.path.normpath(model))}
        self.max_model_len = llm.config.max_model_len
        self.defaults = llm.engine.default_sampling_params()
        # vLLM's server: generation_config.json's max_new_tokens caps every request's output
        self.max_new_tokens = llm.engine.generation_config.get("max_new_tokens")

    def build(self, record: dict) -> EngineRequest | EmbeddingLine | CompletionLine:
        """Raises ValueError / TypeError (HTTP 400) or ModelNotFoundError (404) naming the field.
        An embeddings line gives one request per input (nanoserve/entrypoints/openai_embeddings.py),
        a completions line one per prompt."""
        method, url, body = record.get("method"), record.get("url"), record.get("body")
        if method != "POST":
            raise ValueError(f"method must be 'POST', got {method!r}")
        # One runner per engine: an embedding model serves /v1/embeddings only, a generative one the rest.
        urls = (EMBEDDINGS_URL,) if self.llm.config.runner == "pooling" else URLS
        if url not in urls:
            raise ValueError(f"URL {url!r} was used. Supported endpoints of this {self.llm.config.runner!r} "
                             f"runner: {', '.join(urls)}")
        if not isinstance(body, dict):
            raise TypeError(f"body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model not in self.model_names:
            raise ModelNotFoundError(f"The model `{model}` does not exist. This run serves `{self.model}`.")
        if url == EMBEDDINGS_URL:
            return build_embedding_requests(self.llm, body)
        for field, asks_nothing in _UNSUPPORTED.items():
            if body.get(field) is not None and not asks_nothing(body[field]):
                raise ValueError(f"`{field}` is not supported by nanoserve run-batch (got {body[field]!r})")
        chat = url == CHAT_URL
        if chat and body.get("echo") not in (None, False):
            raise ValueError(f"`echo` is not supported by nanoserve run-batch for {CHAT_URL} (got {body['echo']!r})")
        prompts = [self._chat_prompt(body)] if chat else self._completion_prompts(body)
        requests = []
        for i, (prompt, add_special_tokens) in enumerate(prompts):  # every prompt is checked before any runs
            try:
                requests.append(self._request(body, chat, prompt, add_special_tokens))
            except (ValueError, TypeError) as e:
                if len(prompts) == 1:
                    raise
                raise (TypeError if isinstance(e, TypeError) else ValueError)(f"`prompt[{i}]`: {e}") from None
        return requests[0] if len(requests) == 1 else CompletionLine(requests)

    def _request(self, body: dict, chat: bool, prompt: str | list[int], add_special_tokens: bool) -> EngineRequest:
        _, token_ids = self.processor.tokenize(prompt, tokenization_kwargs={"add_special_tokens": add_special_tokens})
        params = self._sampling_params(body, chat, len(token_ids))
        return self.processor.prepare({"prompt_token_ids": token_ids}, params)

    # ---- prompts ---------------------------------------------------------------------------

    def _chat_prompt(self, body: dict) -> tuple[str, bool]:
        """(prompt, add_special_tokens): the rendered chat, whose template wrote the special tokens."""
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"`chat_template_kwargs` must be an object, got {type(kwargs).__name__}")
        if body.get("chat_template") is not None or kwargs.get("chat_template") is not None:
            # vLLM's run-batch refuses templates from the request (it does not pass
            # --trust-request-chat-template); the checkpoint's template is the one used.
            raise ValueError("Chat template is passed with request, but nanoserve run-batch does not take request "
                             "chat templates: `chat_template` (also inside `chat_template_kwargs`) must be left out")
        continue_final = _flag(body, "continue_final_message", False)
        (text,) = render_conversations(
            self.llm.tokenizer, [body.get("messages")], continue_final_message=continue_final,
            add_generation_prompt=_flag(body, "add_generation_prompt", not continue_final), chat_template_kwargs=kwargs,
        )
        return text, _flag(body, "add_special_tokens", False)

    def _completion_prompts(self, body: dict) -> list[tuple[str | list[int], bool]]:
        """(prompt, add_special_tokens) of each prompt: `prompt` is a string, token ids, or a list of these."""
        prompt = body.get("prompt")
        if isinstance(prompt, str) or _is_token_ids(prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"`prompt` must be a non-empty string, token ids or a list of these, got {prompt!r:.80}")
        add_special = _flag(body, "add_special_tokens", True)
        out = []
        for i, item in enumerate(prompt):
            if not (isinstance(item, str) or _is_token_ids(item)):
                raise ValueError(f"`prompt[{i}]` must be a string or a non-empty list of token ids, got {item!r:.80}")
            out.append((item, add_special if isinstance(item, str) else True))
        return out

    # ---- sampling --------------------------------------------------------------------------

    def _sampling_params(self, body: dict, chat: bool, num_prompt_tokens: int) -> SamplingParams:
        kwargs = {name: body[name] for name in _PLAIN_FIELDS if body.get(name) is not None}
        for name in _DEFAULTED_FIELDS:
            kwargs[name] = body[name] if body.get(name) is not None else getattr(self.defaults, name)
        kwargs["logprobs"] = self._logprobs(body, chat)
        kwargs["max_tokens"] = self._max_tokens(body, chat, num_prompt_tokens)
        kwargs["prompt_logprobs"] = self._prompt_logprobs(body, chat, kwargs["logprobs"])
        # response_format / structured_outputs / guided_* (nanoserve/structured/openai.py)
        kwargs["structured_outputs"] = structured_outputs_from_body(body)
        if isinstance(bias := body.get("logit_bias"), dict):  # other types: SamplingParams names the field
            bias = {k: min(_LOGIT_BIAS_LIMIT, max(-_LOGIT_BIAS_LIMIT, v)) if isinstance(v, (int, float)) else v
                    for k, v in bias.items()}
        if bias is not None:
            kwargs["logit_bias"] = bias
        return SamplingParams(**kwargs)

    @staticmethod
    def _prompt_logprobs(body: dict, chat: bool, logprobs: int | None) -> int | None:
        """vLLM's server: `prompt_logprobs` as given; completions with `echo` and `logprobs` score
        the prompt with the same k (the OpenAI echo format lm-eval's local-completions reads)."""
        asked = body.get("prompt_logprobs")
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < ALL_LOGPROBS):
            raise ValueError(f"`prompt_logprobs` must be an integer >= 0 or -1 (the whole vocabulary), got {asked!r}")
        if not chat and _flag(body, "echo", False) and logprobs is not None:
            return ALL_LOGPROBS if ALL_LOGPROBS in (asked, logprobs) else max(asked or 0, logprobs)
        return asked

    @staticmethod
    def _logprobs(body: dict, chat: bool) -> int | None:
        if not chat:  # Completions: the number of top logprobs, or null; vLLM's server takes no -1 here
            asked = body.get("logprobs")
            if isinstance(asked, int) and not isinstance(asked, bool) and asked < 0:
                raise ValueError(f"`logprobs` must be an integer >= 0, got {asked!r}")
            return asked  # other types: SamplingParams names the field
        top = body.get("top_logprobs")
        top = 0 if top is None else top
        if not isinstance(top, int) or isinstance(top, bool) or top < ALL_LOGPROBS:
            raise ValueError(f"`top_logprobs` must be an integer >= 0 or -1 (the whole vocabulary), got {top!r}")
        wants = _flag(body, "logprobs", False)
        if top != 0 and not wants:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return top if wants else None

    def _max_tokens(self, body: dict, chat: bool, num_prompt_tokens: int) -> int:
        """The request's cap, or the rest of the context, at most the checkpoint's max_new_tokens;
        a request past the context is an error."""
        cap = self._requested_max_tokens(body, chat, num_prompt_tokens)
        return cap if self.max_new_tokens is None else min(cap, self.max_new_tokens)

    def _requested_max_tokens(self, body: dict, chat: bool, num_prompt_tokens: int) -> int:
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        requested = body.get(name, None if chat else 16)  # vLLM's defaults: chat none, completions 16
        if type(requested) is int and requested == 0 and not chat and _flag(body, "echo", False):
            requested = 1  # vLLM: echo with max_tokens 0 returns the prompt alone; one token is sampled, not shown
        if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool) or requested < 1):
            raise ValueError(f"`{name}` must be an integer >= 1, got {requested!r}")
        limit = self.max_model_len
        if requested is None:
            if num_prompt_tokens >= limit:
                raise ValueError(
                    f"This model's maximum context length is {limit} tokens. However, your request has "
                    f"{num_prompt_tokens} input tokens. Please reduce the length of the input."
                )
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the input, {requested} in the "
                f"completion). Please reduce the length of the input or `{name}`."
            )
        return requested


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be true or false, got {value!r}")
    return value
