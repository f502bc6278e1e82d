"""Constraints as OpenAI / vLLM-server requests spell them, turned into SamplingParams fields.

A Chat Completions or Completions body may carry `response_format` ({"type": "json_schema",
"json_schema": {"name", "schema"}} or {"type": "json_object"}), vLLM's `structured_outputs`
object, or older vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
(with `guided_decoding_backend` and `guided_whitespace_pattern` as options). At most one of
them; errors are ValueError / TypeError naming the body field (a 400 line in run-batch).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from nanoserve.structured.params import (
    GuidedDecodingParams,
    StructuredOutputsParams,
    coerce,
    from_guided_options,
)

# Body fields read here (run-batch lets them through).
BODY_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern",
)
_GUIDED_CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_outputs_from_body(body: dict) -> StructuredOutputsParams | None:
    """The request body's constraint (None when it asks for free text)."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        from_format = _from_response_format(fmt)
        if from_format is not None:
            found.append(("`response_format`", from_format))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", coerce(body["structured_outputs"], StructuredOutputsParams,
                                                   "`structured_outputs`")))
    guided = {k: body[k] for k in _GUIDED_CONSTRAINTS if body.get(k) is not None}
    if guided:
        options = {k: body[k] for k in ("guided_decoding_backend", "guided_whitespace_pattern")
                   if body.get(k) is not None}
        found.append((", ".join(f"`{k}`" for k in guided), from_guided_options({**guided, **options})))
    if len(found) > 1:
        raise ValueError(f"a request takes one constraint; got {' and '.join(name for name, _ in found)}")
    if not found:
        return None
    name, constraint = found[0]
    constraint.source = name if name != "structured_outputs" else f"`structured_outputs.{constraint.kind}`"
    return constraint


def _from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict):
        raise TypeError(f"`response_format` must be an object, got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("`response_format.json_schema` must be an object with a `schema`")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"`response_format.json_schema.schema` must be a JSON schema object, got {schema!r:.80}")
        try:
            return StructuredOutputsParams(json=schema)
        except (TypeError, ValueError) as e:
            raise type(e)(f"`response_format.json_schema.schema`: {e}") from None
    raise ValueError(
        f"`response_format.type` must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )


def with_guided_options(params: list[Any], options: Any) -> list[Any]:
    """vLLM's `LLM.generate(guided_options_request=...)`: the same constraint on every prompt.
    The caller's SamplingParams are not changed (one object may serve several prompts)."""
    guided = from_guided_options(options)
    out = []
    for p in params:
        if p.structured_outputs is not None or p.guided_decoding is not None:
            raise ValueError("guided_options_request was given but a SamplingParams already has a constraint "
                             "(structured_outputs / guided_decoding); pass one")
        q = p.clone()
        q.guided_decoding = dataclasses.replace(guided) if isinstance(guided, GuidedDecodingParams) else guided
        out.append(q)
    return out
