"""Prompt + SamplingParams -> a validated, tokenized `EngineRequest`: the one place requests are checked.

Every entry point (`generate`, `chat`, `generate_stream`, run-batch, Ray, the benchmark) comes
through `InputProcessor.prepare`, so a prompt is tokenized with the same `tokenization_kwargs`
and refused with the same message wherever it enters. Checks that need the model (vocabulary,
context length, engine caps) live here; checks of the params alone live in `SamplingParams.validate`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from nanoserve.config import Config
from nanoserve.inputs import parse_prompt
from nanoserve.sampling import SamplingSpec
from nanoserve.sampling.bad_words import bad_words_token_ids
from nanoserve.engine.pooling_requests import PoolingSpec, validate_pooling_request
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import ALL_LOGPROBS, SamplingParams, num_logprobs
from nanoserve.structured.manager import StructuredOutputManager

# tokenization_kwargs keys nanoserve honours (they go to tokenizer.encode).
TOKENIZATION_KEYS = ("add_special_tokens",)


@dataclass(frozen=True)
class RequestError:
    """A result in place of a RequestOutput for an item that was rejected before it ran.

    `message` is the text `LLM.generate` would raise for the same item, `error_type` its class
    (ValueError or TypeError); `raise err.exception()` turns it back into that exception.
    """

    message: str
    error_type: type[Exception] = ValueError

    def exception(self) -> Exception:
        return self.error_type(self.message)


class EngineRequest(NamedTuple):
    """A validated, tokenized request, ready for `LLMEngine.add_request`."""

    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    spec: SamplingSpec | PoolingSpec
    prompt: str | None = None


def encode_kwargs(tokenization_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    if tokenization_kwargs is None:
        return {}
    if not isinstance(tokenization_kwargs, dict):
        raise TypeError(f"tokenization_kwargs must be a dict or None, got {type(tokenization_kwargs).__name__}")
    unsupported = sorted(set(tokenization_kwargs) - set(TOKENIZATION_KEYS))
    if unsupported:
        raise ValueError(f"tokenization_kwargs {unsupported} are not supported; nanoserve takes {TOKENIZATION_KEYS}")
    return dict(tokenization_kwargs)


class InputProcessor:
    def __init__(self, config: Config, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 structured: StructuredOutputManager) -> None:
        self.config = config
        self.structured = structured  # compiles (and caches) a request's grammar: its errors are ValueErrors
        self.tokenizer = tokenizer  # replaced by LLM.set_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def prepare(
        self, prompt: Any, params: Any, index: int = 0, tokenization_kwargs: dict[str, Any] | None = None
    ) -> EngineRequest:
        """Parse, tokenize and validate prompt number `index`; ValueError / TypeError naming the field."""
        text, token_ids = self.tokenize(prompt, index, tokenization_kwargs)
        if isinstance(params, PoolingParams) or self.config.runner == "pooling":  # embeddings
            if text == "":  # the tokenizer's own special tokens alone would embed nothing of the user's
                raise ValueError("prompt is empty: a prompt needs at least one token")
            spec = validate_pooling_request(token_ids, params, self.config, self.vocab_size)
            return EngineRequest(spec.prompt_token_ids, params, spec, text)  # ids after truncate_prompt_tokens
        return EngineRequest(token_ids, params, self.validate(token_ids, params), text)

    def tokenize(self, prompt: Any, index: int = 0,
                 tokenization_kwargs: dict[str, Any] | None = None) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of any prompt form `generate` takes."""
        text, token_ids = parse_prompt(prompt, index)
        if token_ids is None:
            token_ids = self.tokenizer.encode(text, **encode_kwargs(tokenization_kwargs))
        return text, token_ids

    def prepare_or_error(self, prompt: Any, params: Any, index: int = 0,
                         tokenization_kwargs: dict[str, Any] | None = None) -> EngineRequest | RequestError:
        """`prepare`, with its ValueError / TypeError returned as a RequestError (streams go on)."""
        try:
            return self.prepare(prompt, params, index, tokenization_kwargs)
        except (ValueError, TypeError) as e:
            return RequestError(str(e), type(e))

    def validate(self, prompt_token_ids: list[int], params: Any) -> SamplingSpec:
        """Every check that can fail, before any work starts; returns the request's SamplingSpec."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()  # fields may have been set after construction, as vLLM's scripts do
        cfg, vocab = self.config, self.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
        if len(prompt_token_ids) > cfg.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens, longer than max_model_len={cfg.max_model_len}")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab}) (the model's vocab_size), got {bad[:5]}")
        self._check_num_logprobs(params)
        if params.seed is not None and params.seed + params.n - 1 >= 2**63:
            raise ValueError(
                f"seed must be in [0, {2**63 - params.n + 1}) for n={params.n} (sample i uses seed + i, "
                f"which must stay below 2**63), got {params.seed}"
            )
        self.structured.check(params)
        words = bad_words_token_ids(params.bad_words, self.tokenizer, vocab) if params.bad_words else ()
        return SamplingSpec.from_params(params, vocab, self.eos_token_ids, words)

    def _check_num_logprobs(self, params: SamplingParams) -> None:
        """vLLM's rule: -1 asks for the whole vocabulary, and max_logprobs=-1 allows at most that."""
        def shown(name: str, value: int) -> str:
            whole = f" (the whole vocabulary, {self.vocab_size})" if value == ALL_LOGPROBS else ""
            return f"{name}={value}{whole}"

        cap = num_logprobs(self.config.max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and num_logprobs(asked, self.vocab_size) > cap:
                raise ValueError(
                    f"{shown(name, asked)} exceeds {shown('max_logprobs', self.config.max_logprobs)}; "
                    "raise LLM(max_logprobs=...) to ask for more (-1: the whole vocabulary)"
                )
