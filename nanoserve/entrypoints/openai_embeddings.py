"""OpenAI `/v1/embeddings` batch lines: the body -> pooling requests, the results -> the response body.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists; each
element becomes one engine request (the line's answer waits for all of them). `dimensions`,
`encoding_format` ("float" or "base64": little-endian float32 bytes, as OpenAI's),
`truncate_prompt_tokens` and `add_special_tokens` as in vLLM's `EmbeddingCompletionRequest`.
"""
from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.engine.input_processor import EngineRequest
from nanoserve.engine.pooling_requests import tokenize
from nanoserve.outputs import PoolingRequestOutput
from nanoserve.pooling.api import check_task
from nanoserve.pooling_params import PoolingParams

if TYPE_CHECKING:
    from nanoserve.llm import LLM

EMBEDDINGS_URL = "/v1/embeddings"
ENCODING_FORMATS = ("float", "base64")
# Body fields that ask for something nanoserve does not do, with the value that asks for nothing.
_UNSUPPORTED = {"user": lambda v: True, "priority": lambda v: v == 0}
_KNOWN = {"model", "input", "dimensions", "encoding_format", "truncate_prompt_tokens", "add_special_tokens",
          "normalize", "use_activation", *_UNSUPPORTED}


@dataclass
class EmbeddingLine:
    """An embeddings line, validated: one engine request per input, answered in one record."""

    requests: list[EngineRequest]
    encoding_format: str


class LineParts:
    """Gathers the results of multi-request lines until each is complete (what is in flight only)."""

    def __init__(self) -> None:
        self._parts: dict[int, list[Any]] = {}

    def add(self, line: int, part: int, num_parts: int, out: Any) -> list[Any] | None:
        """The line's results in input order once all have arrived, else None."""
        got = self._parts.setdefault(line, [None] * num_parts)
        got[part] = out
        if any(o is None for o in got):
            return None
        return self._parts.pop(line)


def build_embedding_requests(llm: LLM, body: dict) -> EmbeddingLine:
    """One validated EngineRequest per input of the line; ValueError / TypeError naming the field."""
    check_task(llm.config.pooling, "embed")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise ValueError(f"{unknown} are not supported in /v1/embeddings bodies by nanoserve run-batch")
    for field, asks_nothing in _UNSUPPORTED.items():
        if body.get(field) is not None and not asks_nothing(body[field]):
            raise ValueError(f"`{field}` is not supported by nanoserve run-batch (got {body[field]!r})")
    fmt = body.get("encoding_format", "float")
    if fmt not in ENCODING_FORMATS:
        raise ValueError(f"`encoding_format` must be one of {ENCODING_FORMATS}, got {fmt!r}")
    params = PoolingParams(  # its errors name the field
        dimensions=body.get("dimensions"), normalize=body.get("normalize"),
        use_activation=body.get("use_activation"), truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
    )
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise TypeError(f"`add_special_tokens` must be true or false, got {add_special!r}")
    requests = []
    for ids in _inputs(llm, body.get("input"), add_special):
        requests.append(llm.engine.input_processor.prepare({"prompt_token_ids": ids}, params))
    return EmbeddingLine(requests, fmt)


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _inputs(llm: LLM, value: Any, add_special: bool) -> list[list[int]]:
    """Token ids of each input (OpenAI's four forms of `input`)."""
    if isinstance(value, str):
        value = [value]
    elif _is_ids(value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"`input` must be a non-empty string, list of strings or list of token ids, got {value!r:.80}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(tokenize(llm.tokenizer, item, {"add_special_tokens": add_special}))
        elif _is_ids(item):
            out.append(list(item))
        else:
            raise ValueError(f"`input[{i}]` must be a non-empty string or list of token ids, got {item!r:.80}")
    return out


def embeddings_body(outs: list[PoolingRequestOutput], model: str, fmt: str) -> dict:
    """vLLM's EmbeddingResponse: `data` in input order, usage counting prompt tokens only."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    data = [{"index": i, "object": "embedding", "embedding": _encode(o.outputs.data.tolist(), fmt)}
            for i, o in enumerate(outs)]
    return {
        "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model, "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    }


def _encode(values: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
