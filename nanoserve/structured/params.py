"""What a request asks its output to match: vLLM's StructuredOutputsParams and GuidedDecodingParams.

Both classes carry the same constraint fields (exactly one of json, regex, choice, grammar,
json_object per request) and the same options; GuidedDecodingParams (vLLM <= 0.11, still in many
scripts and older Ray / TRL releases) adds `backend`, accepted and logged. A plain dict works in
their place (Ray rows carry dicts). Checks here need no tokenizer and no llguidance; compiling
against the model's tokenizer happens when the request is added (grammar.py).

`ConstraintSpec` is the normalised, hashable form: (kind, text, options). Compiled grammars are
cached by it, so two requests with the same schema compile once.
"""
from __future__ import annotations

import json as _json
import logging
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

# The constraint fields, in vLLM's order; a request sets exactly one.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# Named so a script that uses it gets a clear refusal rather than an unknown-field error.
_REFUSED = {"structural_tag": "nanoserve has no structural tags; use a json schema or a grammar"}


def _is_pydantic_model(value: Any) -> bool:
    return not isinstance(value, (dict, str)) and callable(getattr(value, "model_json_schema", None))


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names).

    json: a JSON schema (dict, JSON string, or a pydantic model / its class); regex: a regular
    expression the whole output matches; choice: the output is exactly one of these strings;
    grammar: a Lark or GBNF/EBNF grammar; json_object: any JSON object.
    disable_any_whitespace: compact JSON (no whitespace between tokens); this is what lets
    jump-forward insert key names and separators. disable_additional_properties: objects
    without `additionalProperties` get `false`. whitespace_pattern: a regex for the whitespace
    JSON may use between tokens. disable_fallback: accepted (there is one backend, llguidance).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # Where the constraint came from, for error messages, when not a SamplingParams field (e.g. a
    # run-batch body's `guided_regex`); set by nanoserve/structured/openai.py.
    source: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str | None = None) -> None:
        """Check the fields; `where` names the SamplingParams field in messages. Idempotent."""
        where = where or type(self).__name__
        if self.structural_tag is not None:
            raise ValueError(f"{where}.structural_tag is not supported ({_REFUSED['structural_tag']})")
        if _is_pydantic_model(self.json):
            self.json = self.json.model_json_schema()
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if self.json_object is False:  # json_object=False asks for nothing, as in vLLM
            given.remove("json_object")
        if len(given) != 1:
            raise ValueError(
                f"{where} needs exactly one of {', '.join(CONSTRAINT_FIELDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{where}.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{where}.{name} must be a str, got {type(value).__name__}")
        if self.regex == "" or self.grammar == "":
            raise ValueError(f"{where}.{given[0]} must not be empty")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"{where}.json_object must be a bool, got {self.json_object!r}")
        if self.json is not None:
            _check_json_schema(self.json, f"{where}.json")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                raise TypeError(f"{where}.choice must be a list of str, got {self.choice!r:.100}")
            if not self.choice:
                raise ValueError(f"{where}.choice must hold at least one string, got []")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        # Only json_object=False means "not given"; json=False is a schema (refused by validate).
        return next(n for n in CONSTRAINT_FIELDS if getattr(self, n) is not None
                    and not (n == "json_object" and self.json_object is False))

    def spec(self) -> ConstraintSpec:
        """The hashable key this constraint compiles (and is cached) under."""
        kind = self.kind
        if kind == "json":
            # Not sort_keys: the order of "properties" is the order the keys are generated in
            # (a "reasoning" key before an "answer" key is part of the schema's meaning).
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json)
        elif kind == "choice":
            text = _json.dumps(self.choice)
        elif kind == "json_object":
            text = '{"type": "object"}'
        else:
            text = getattr(self, kind)
        return ConstraintSpec(
            kind, text, self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern
        )


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name (removed in vLLM 0.12): the same constraint, plus `backend` and
    `backend_was_auto`, accepted and logged (llguidance is the one backend)."""

    backend: str | None = None
    backend_was_auto: bool = False

    def validate(self, where: str | None = None) -> None:
        super().validate(where)
        if self.backend is not None:
            if not isinstance(self.backend, str):
                raise TypeError(f"{where or 'GuidedDecodingParams'}.backend must be a str, got {self.backend!r}")
            _log_backend_once(self.backend)

    @staticmethod
    def from_optional(
        json: str | dict | None = None, regex: str | None = None, choice: list[str] | None = None,
        grammar: str | None = None, json_object: bool | None = None, backend: str | None = None,
        whitespace_pattern: str | None = None, structural_tag: str | None = None,
    ) -> GuidedDecodingParams | None:
        """vLLM's helper: None when no constraint is given."""
        if all(v is None for v in (json, regex, choice, grammar, json_object, structural_tag)):
            return None
        return GuidedDecodingParams(
            json=json, regex=regex, choice=choice, grammar=grammar, json_object=json_object, backend=backend,
            whitespace_pattern=whitespace_pattern, structural_tag=structural_tag,
        )


class ConstraintSpec(NamedTuple):
    kind: str  # one of CONSTRAINT_FIELDS
    text: str  # the schema as JSON, the regex, the choices as a JSON list, or the grammar
    disable_any_whitespace: bool
    disable_additional_properties: bool
    whitespace_pattern: str | None


def coerce(value: Any, cls: type[StructuredOutputsParams], where: str) -> StructuredOutputsParams | None:
    """A SamplingParams field's value as `cls`: an instance is checked again (it may have been
    changed), a dict is built into one (keys set to None count as absent, as Arrow fills them)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        if value is not None:
            value.validate(where)
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{where} must be a {cls.__name__}, a dict or None, got {type(value).__name__}")
    names = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: {', '.join(sorted(names))}")
    try:
        return cls(**{k: v for k, v in value.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace(cls.__name__, where, 1)) from None


def _check_json_schema(schema: Any, where: str) -> None:
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except _json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise TypeError(f"{where} must be a JSON schema (a dict, a JSON string or a pydantic model), "
                        f"got {type(schema).__name__}")
    if schema is False:
        raise ValueError(f"{where} is the schema false, which no output matches")


# vLLM's LLM.generate(guided_options_request=...) keys -> GuidedDecodingParams fields.
GUIDED_OPTION_KEYS = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
    "guided_json_object": "json_object", "guided_decoding_backend": "backend",
    "guided_whitespace_pattern": "whitespace_pattern",
}


def from_guided_options(options: Any) -> GuidedDecodingParams:
    """vLLM's `guided_options_request` (a dict or an object with guided_* attributes, e.g. its
    GuidedDecodingRequest) as GuidedDecodingParams; ValueError naming the key when it is unusable."""
    where = "guided_options_request"
    if not isinstance(options, dict):
        options = {k: getattr(options, k) for k in GUIDED_OPTION_KEYS if hasattr(options, k)}
        if not options:
            raise TypeError(f"{where} must be a dict of {sorted(GUIDED_OPTION_KEYS)}, got {type(options).__name__}")
    unknown = sorted(set(options) - set(GUIDED_OPTION_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: {', '.join(sorted(GUIDED_OPTION_KEYS))}")
    kwargs = {GUIDED_OPTION_KEYS[k]: v for k, v in options.items() if v is not None}
    return coerce(kwargs, GuidedDecodingParams, where)


_logged_backends: set[str] = set()


def _log_backend_once(backend: str) -> None:
    if backend not in _logged_backends:
        _logged_backends.add(backend)
        logger.info("guided decoding backend %r: nanoserve always uses llguidance", backend)
