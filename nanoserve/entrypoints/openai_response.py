"""Batch output records, shaped as vLLM's run-batch writes them.

A result line is `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`
whose body is a `chat.completion` or `text_completion` object as vLLM's OpenAI server returns it
(choices with finish_reason / stop_reason / logprobs, and usage). A failed line has
`response.body = null` and `error = {"message", "type", "param", "code", "line"}`, where `line`
is the 1-based input line; `custom_id` is null when the line has no custom_id of its own to
answer for (unparsable, missing, or a duplicate of an earlier line).
"""
from __future__ import annotations

import time
import uuid

from nanoserve.entrypoints.openai_request import CHAT_URL, ModelNotFoundError
from nanoserve.engine.input_processor import RequestError
from nanoserve.entrypoints.openai_embeddings import embeddings_body
from nanoserve.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
from nanoserve.sampling_params import ALL_LOGPROBS

# vLLM's floor for -inf logprobs, which JSON cannot carry.
_MIN_LOGPROB = -9999.0


def _uid() -> str:
    return uuid.uuid4().hex


def result_record(custom_id: str, url: str, out: RequestOutput | list[RequestOutput], model: str, tokenizer,
                  echo: bool = False, prompt_only: bool = False, *, num_logprobs: int | None) -> dict:
    """A 200 record; `out` is a list for a completions line with several prompts (chat takes one).
    `prompt_only` (completions `echo` with `max_tokens` 0): each choice is the prompt, as vLLM's.
    `num_logprobs`: the request's k (SamplingParams.logprobs), the length of each top_logprobs list."""
    outs = out if isinstance(out, list) else [out]
    k = None if num_logprobs == ALL_LOGPROBS else num_logprobs or 0  # None: every entry, the whole vocabulary
    if url == CHAT_URL:
        (out,) = outs
        body = _chat_body(out, model, tokenizer, k)
    else:
        body = _completion_body(outs, model, tokenizer, k, echo, prompt_only)
    return {
        "id": f"nanoserve-{_uid()}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"nanoserve-batch-{_uid()}", "body": body},
        "error": None,
    }


def embeddings_record(custom_id: str, outs: list[PoolingRequestOutput], model: str, encoding_format: str) -> dict:
    return {
        "id": f"nanoserve-{_uid()}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"nanoserve-batch-{_uid()}",
                     "body": embeddings_body(outs, model, encoding_format)},
        "error": None,
    }


def error_record(custom_id: str | None, line: int, error: RequestError) -> dict:
    not_found = issubclass(error.error_type, ModelNotFoundError)
    code = 404 if not_found else 400
    return {
        "id": f"nanoserve-{_uid()}",
        "custom_id": custom_id,
        "response": {"status_code": code, "request_id": f"nanoserve-batch-{_uid()}", "body": None},
        "error": {
            "message": error.message,
            "type": "NotFoundError" if not_found else "BadRequestError",
            "param": None,
            "code": code,
            "line": line,
        },
    }


def _usage(*outs: RequestOutput) -> dict:
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
    completion_tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def _chat_body(out: RequestOutput, model: str, tokenizer, k: int | None) -> dict:
    choices = [
        {
            "index": c.index,
            "message": {
                "role": "assistant", "content": c.text, "refusal": None, "annotations": None, "audio": None,
                "function_call": None, "tool_calls": [], "reasoning_content": None,
            },
            "logprobs": _chat_logprobs(c, tokenizer, k),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in out.outputs
    ]
    return {
        "id": f"chatcmpl-{_uid()}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": choices, "service_tier": None, "system_fingerprint": None, "usage": _usage(out),
        "prompt_logprobs": _prompt_logprobs(out), "kv_transfer_params": None,
    }


def _completion_body(outs: list[RequestOutput], model: str, tokenizer, k: int | None, echo: bool = False,
                     prompt_only: bool = False) -> dict:
    """vLLM's CompletionResponse: prompt i's n choices have indices i * n ... i * n + n - 1."""
    choices = []
    for i, out in enumerate(outs):
        prompt_text = (out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)) if echo else ""
        choices += [
            {
                "index": i * len(out.outputs) + c.index,
                "text": prompt_text + ("" if prompt_only else c.text),
                "logprobs": (_echo_logprobs(out, c, tokenizer, k, not prompt_only) if echo
                             else _completion_logprobs(c, tokenizer, k)),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": _prompt_logprobs(out),
            }
            for c in out.outputs
        ]
    return {
        "id": f"cmpl-{_uid()}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices, "service_tier": None, "system_fingerprint": None, "usage": _usage(*outs),
        "kv_transfer_params": None,
    }


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _top(step: dict[int, Logprob], k: int | None) -> list[tuple[int, Logprob]]:
    """The step's top-k entries by rank. The step also holds the sampled (or prompt) token with its
    rank in the vocabulary; outside the top k that rank is >= k + 1 (ties included: it counts every
    token scoring at least as high), so `rank <= k` keeps exactly the top k. k None: every entry."""
    return sorted(((t, lp) for t, lp in step.items() if k is None or lp.rank <= k), key=lambda e: e[1].rank)


def _chat_logprobs(c: CompletionOutput, tokenizer, k: int | None) -> dict | None:
    if c.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": max(logprob, _MIN_LOGPROB), "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for token_id, step in zip(c.token_ids, c.logprobs):
        item = entry(token_id, step[token_id].logprob)
        item["top_logprobs"] = [entry(t, lp.logprob) for t, lp in _top(step, k)]
        content.append(item)
    return {"content": content}


def _completion_logprobs(c: CompletionOutput, tokenizer, k: int | None) -> dict | None:
    if c.logprobs is None:
        return None
    result: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for token_id, step in zip(c.token_ids, c.logprobs):
        text = _token_text(tokenizer, token_id)
        result["text_offset"].append(offset)
        result["token_logprobs"].append(max(step[token_id].logprob, _MIN_LOGPROB))
        result["tokens"].append(text)
        top = {text: max(step[token_id].logprob, _MIN_LOGPROB)}  # vLLM lists the sampled token first
        top.update({_token_text(tokenizer, t): max(lp.logprob, _MIN_LOGPROB) for t, lp in _top(step, k)})
        result["top_logprobs"].append(top)
        offset += len(text)
    return result


def _prompt_logprobs(out: RequestOutput) -> list[dict | None] | None:
    """vLLM server's `prompt_logprobs`: per prompt token None or {"token id": {logprob, rank, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [
        None if step is None else {
            str(t): {"logprob": max(lp.logprob, _MIN_LOGPROB), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in step.items()
        }
        for step in out.prompt_logprobs
    ]


def _echo_logprobs(out: RequestOutput, c: CompletionOutput, tokenizer, k: int | None,
                   with_completion: bool = True) -> dict | None:
    """OpenAI completions `echo` + `logprobs`: the prompt's tokens first (token_logprobs and
    top_logprobs null for the first), then the completion's, text_offset running over both."""
    completion = _completion_logprobs(c, tokenizer, k)
    if completion is None or out.prompt_logprobs is None:
        return completion
    result: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for token_id, step in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
        text = _token_text(tokenizer, token_id)
        result["text_offset"].append(offset)
        result["tokens"].append(text)
        if step is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
        else:
            result["token_logprobs"].append(max(step[token_id].logprob, _MIN_LOGPROB))
            top = {text: max(step[token_id].logprob, _MIN_LOGPROB)}
            # every entry: the prompt token (listed first already) and its top prompt_logprobs
            top.update({_token_text(tokenizer, t): max(lp.logprob, _MIN_LOGPROB) for t, lp in _top(step, None)})
            result["top_logprobs"].append(top)
        offset += len(text)
    if not with_completion:
        return result
    result["text_offset"].extend(offset + o for o in completion["text_offset"])
    for key in ("token_logprobs", "tokens", "top_logprobs"):
        result[key].extend(completion[key])
    return result
