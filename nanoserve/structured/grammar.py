"""Constraints -> llguidance grammars, checked against the model's tokenizer and cached.

llguidance (PyPI `llguidance`, no dependencies) compiles JSON schemas, regexes, choices and
Lark / GBNF grammars into one grammar format and computes token masks from it. Compiling checks
the grammar against the tokenizer (an invalid schema, a regex that does not compile, a grammar
with a syntax error are refused here, before the request does any work). A compiled grammar is
kept as a ready matcher in an LRU cache keyed by the ConstraintSpec: a new sequence copies it
(`deep_copy`), which skips building the lexer again.
"""
from __future__ import annotations

import importlib.metadata
import json
import re
from collections import OrderedDict
from typing import Any

from nanoserve.structured.params import ConstraintSpec

# Distinct constraints kept compiled; a long run with many schemas stays bounded.
GRAMMAR_CACHE_SIZE = 256
# JSON whitespace between tokens, unless disable_any_whitespace or whitespace_pattern says
# otherwise: enough for pretty-printed JSON (a newline and 4-space indents 5 levels deep), but
# bounded, so a model cannot spin on whitespace after `{` until max_tokens (vLLM #30730;
# xgrammar's max_whitespace_cnt does the same).
MAX_JSON_WHITESPACE = 24
DEFAULT_WHITESPACE_PATTERN = rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"
_INSTALL_HINT = 'structured outputs need llguidance: pip install llguidance (or pip install "nanoserve[structured]")'
# 1.8 bounds every whitespace run by the pattern above (1.7.6 and before let runs grow past it,
# seen on a GPU machine whose image had 1.6.1) and takes a list of EOS ids (1.7).
MIN_LLGUIDANCE = (1, 8)


def import_llguidance():
    """The llguidance module, or an ImportError that says how to install or upgrade it."""
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the tokenizer bridge)
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from None
    found = importlib.metadata.version("llguidance")
    if tuple(int(part) for part in re.findall(r"\d+", found)[:2]) < MIN_LLGUIDANCE:
        wanted = ".".join(map(str, MIN_LLGUIDANCE))
        raise ImportError(f"structured outputs need llguidance >= {wanted}, found {found}: "
                          f'pip install -U "llguidance>={wanted}"')
    return llguidance


def make_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of the tokenizer over the model's vocabulary (ids past the tokenizer's
    own are never allowed). Built once per engine and tokenizer (~1 s for a 150k vocabulary)."""
    llg = import_llguidance()
    eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
    try:
        return llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos or None)
    except ValueError as e:  # a slow (Python) tokenizer
        raise ValueError(f"structured outputs need a fast (Rust) Hugging Face tokenizer: {e}") from None


def grammar_text(spec: ConstraintSpec) -> str:
    """The llguidance grammar for a spec (not yet checked: LLMatcher.validate_grammar does that)."""
    llg = import_llguidance()
    if spec.kind in ("json", "json_object"):
        schema = json.loads(spec.text)
        if schema is True:  # the schema that accepts any JSON value; llguidance's options need an object
            schema = {}
        if spec.disable_additional_properties:
            schema = _no_additional_properties(schema)
        options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
        if not spec.disable_any_whitespace:
            options["whitespace_pattern"] = spec.whitespace_pattern or DEFAULT_WHITESPACE_PATTERN
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        # Each choice a Lark string literal: the output is exactly one of them.
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec.text)))
    if spec.kind == "grammar":
        return llg.grammar_from("grammar", spec.text)  # Lark, or GBNF/EBNF converted to Lark
    raise AssertionError(f"unknown constraint kind {spec.kind!r}")


class GrammarCache:
    """ConstraintSpec -> a fresh matcher at the grammar's start, compiled once per spec."""

    def __init__(self, tokenizer, size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self._templates: OrderedDict[ConstraintSpec, Any] = OrderedDict()
        self.num_compiled = 0

    def __len__(self) -> int:
        return len(self._templates)

    def matcher(self, spec: ConstraintSpec, where: str):
        """A new LLMatcher for `spec`; ValueError naming `where` (e.g. "structured_outputs.json")
        when the constraint does not compile."""
        template = self._templates.get(spec)
        if template is None:
            template = self._compile(spec, where)
            self._templates[spec] = template
            if len(self._templates) > self.size:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(spec)
        return template.deep_copy()

    def _compile(self, spec: ConstraintSpec, where: str):
        llg = import_llguidance()
        try:
            grammar = grammar_text(spec)
        except ValueError as e:  # a schema that is not a JSON object, a GBNF grammar that does not convert
            raise ValueError(f"{where}: {e}") from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"{where} does not compile: {_one_line(messages[0])}")
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{where} does not compile: {_one_line(matcher.get_error())}")
        self.num_compiled += 1
        return matcher


def _one_line(message: str) -> str:
    """llguidance's message on one line, cut to a readable length."""
    return " ".join(message.split())[:400]


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without `additionalProperties`
    gets `false` (nested ones too), so the model cannot invent keys."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema
