"""SamplingParams with vLLM's names, defaults and validation."""
from __future__ import annotations

import copy
import logging
import math
import numbers
from dataclasses import dataclass, fields

import numpy as np

from nanoserve.structured.params import GuidedDecodingParams, StructuredOutputsParams, coerce


def _is_int(x) -> bool:
    """An int, numpy's included (as vLLM, whose fields are plain annotations), never a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


logger = logging.getLogger(__name__)

# Shown by repr() whatever their value; every other field only when it differs from its default.
_ALWAYS_SHOWN = ("n", "temperature", "top_p", "top_k", "max_tokens")
# logprobs / prompt_logprobs / LLM(max_logprobs=...) = -1: the whole vocabulary (vLLM's meaning).
ALL_LOGPROBS = -1
# vLLM raises a temperature in (0, _MIN_TEMPERATURE) to it (dividing by less overflows in half precision).
_MIN_TEMPERATURE = 1e-2


@dataclass(repr=False)
class SamplingParams:
    """How to sample one request. temperature=0 means greedy; top_k 0 or -1 disables top-k.

    Mutable, like vLLM's: a field set after construction is checked and normalised again when
    the request is added (`validate()`), with the same messages as at construction.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs per sampled token; -1 = the whole vocabulary
    # Scores of the prompt's own tokens (vLLM's field): the prompt token's logprob and rank plus the top k.
    prompt_logprobs: int | None = None
    # nanoserve's: score only prompt tokens from this index on (a continuation after a shared
    # context); the positions before it may then come from the prefix cache. None = every token.
    prompt_logprobs_start: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False skips text (and stop strings) entirely, e.g. in benchmarks
    # Structured outputs (nanoserve/structured): a JSON schema, regex, choice or grammar the output
    # must match; a dict is accepted in place of the class. guided_decoding: vLLM's older name.
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: GuidedDecodingParams | dict | None = None
    # vLLM's logits processors: {token id: bias} added to the logits (keys may be digit strings,
    # as in the OpenAI API), and the only token ids a sample may take.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Words a sample never produces (vLLM's field; nanoserve/sampling/bad_words.py).
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field and normalise in place as vLLM does (stop str -> [str], top_k -1 -> 0,
        seed -1 -> None, logprobs True -> 1, temperature in (0, 0.01) -> 0.01); idempotent."""
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)
        self._check_types()
        self._check_ranges()
        self._check_token_biases()
        if 0.0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in "
                           "tensors. We have maxed it out to %s.", self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check_structured_outputs()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> SamplingParams:
        """A deep copy: changing the clone (or its stop lists) leaves this one untouched."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name in _ALWAYS_SHOWN or getattr(self, f.name) != _default(f)
        ]
        return f"SamplingParams({', '.join(shown)})"

    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
            setattr(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not _is_number(getattr(self, name)):
                raise TypeError(f"{name} must be a number, got {getattr(self, name)!r}")
            setattr(self, name, float(getattr(self, name)))
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs", "prompt_logprobs_start"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
            if value is not None:
                setattr(self, name, int(value))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise TypeError(f"stop must be a str or a list of str, got {stop!r}")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids)):
            raise TypeError(f"stop_token_ids must be a list of int, got {ids!r}")

    def _check_ranges(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)}")

        if self.n < 1:
            raise bad("n", ">= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):  # NaN passes every comparison below
                raise bad(name, "a finite number")
        if self.temperature < 0.0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "-1, 0 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", ">= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < ALL_LOGPROBS:
                raise bad(name, f">= 0, {ALL_LOGPROBS} (the whole vocabulary) or None")
        if self.prompt_logprobs_start is not None and self.prompt_logprobs_start < 0:
            raise bad("prompt_logprobs_start", ">= 0 or None")
        if self.prompt_logprobs_start is not None and self.prompt_logprobs is None:
            raise ValueError("prompt_logprobs_start needs prompt_logprobs (the number of top logprobs per position)")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", "in [0, 2**63), -1 or None")
        if any(s == "" for s in ([self.stop] if isinstance(self.stop, str) else self.stop or [])):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.stop and not self.detokenize:  # without text there is nothing to match them against
            raise ValueError("stop strings are only supported when detokenize is True. "
                             "Set detokenize=True to use stop.")

    def _check_token_biases(self) -> None:
        """logit_bias keys become ints and values floats; allowed_token_ids a non-empty list of ints
        (vLLM refuses an empty one). Whether the ids are in the vocabulary is checked with the model."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bias = {}
            for key, value in self.logit_bias.items():
                token = key if _is_int(key) else int(key) if isinstance(key, str) and key.strip().isdigit() else None
                if token is None:
                    raise ValueError(f"logit_bias keys must be token ids (ints or digit strings), got {key!r}")
                if not _is_number(value) or not math.isfinite(value):
                    raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for token {key!r}")
                bias[token] = float(value)
            self.logit_bias = bias
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
                raise TypeError(f"allowed_token_ids must be a list of int, got {ids!r}")
            if not ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            self.allowed_token_ids = list(ids)
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise TypeError(f"bad_words must be a list of str, got {words!r}")
            if any(not w for w in words):
                raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={list(words)}")
            self.bad_words = list(dict.fromkeys(words))

    def _check_structured_outputs(self) -> None:
        """Dicts become the classes; the constraint is checked (compiling waits for the tokenizer,
        when the request is added)."""
        self.structured_outputs = coerce(self.structured_outputs, StructuredOutputsParams, "structured_outputs")
        self.guided_decoding = coerce(self.guided_decoding, GuidedDecodingParams, "guided_decoding")
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("structured_outputs and guided_decoding were both given; pass one (they are the "
                             "same constraint under vLLM's new and old names)")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def num_logprobs(asked: int | None, vocab_size: int) -> int | None:
    """How many top logprobs `logprobs` / `prompt_logprobs` / `max_logprobs` mean for a model:
    -1 is its whole vocabulary; None stays None."""
    return vocab_size if asked == ALL_LOGPROBS else asked


def _default(f):
    # After validate(), None lists are stored as []: compare against that normalised form.
    return [] if f.name in ("stop", "stop_token_ids") else f.default


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, for `LLM.beam_search` (nanoserve/beam_search.py).
    `include_stop_str_in_output` is accepted and has no effect, as in vLLM's offline beam search."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
