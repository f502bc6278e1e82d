"""Results of generate(), shaped like vLLM's so code written against vLLM keeps working."""
from __future__ import annotations

from dataclasses import dataclass, field

# repr() of outputs stays short: printing a list of results in a notebook must not dump
# thousands of token ids. Longer lists and texts are elided in the middle, with their length.
_MAX_LIST_ITEMS = 8
_MAX_TEXT_CHARS = 200


def short_list(items: list | None, unit: str = "ids") -> str:
    if items is None or len(items) <= _MAX_LIST_ITEMS:
        return repr(items)
    head = ", ".join(repr(x) for x in items[: _MAX_LIST_ITEMS - 2])
    return f"[{head}, ..., {items[-1]!r}] ({len(items)} {unit})"


def short_text(text: str | None) -> str:
    if text is None or len(text) <= _MAX_TEXT_CHARS:
        return repr(text)
    keep = _MAX_TEXT_CHARS // 2
    return f"{text[:keep]!r}...{text[-keep // 2:]!r} ({len(text)} chars)"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; a sampled / prompt token outside the top k has its vocab rank
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS / length
    # vLLM's fields for features nanoserve does not have (LoRA, disaggregated KV): always None.
    lora_request: None = None
    kv_transfer_params: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        logprobs = "None" if self.logprobs is None else f"<{len(self.logprobs)} positions>"
        return (
            f"CompletionOutput(index={self.index}, text={short_text(self.text)}, "
            f"token_ids={short_list(self.token_ids)}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={logprobs}, finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (per sample stream)."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # vLLM's: per prompt token, None for the first, else {token id: Logprob} (SamplingParams.prompt_logprobs).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # vLLM's fields for features nanoserve does not have (LoRA, encoder-decoder models,
    # disaggregated KV): always None, there for scripts that read them.
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None

    def __repr__(self) -> str:
        prompt_logprobs = (
            "" if self.prompt_logprobs is None else f"prompt_logprobs=<{len(self.prompt_logprobs)} positions>, "
        )
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={short_text(self.prompt)}, "
            f"prompt_token_ids={short_list(self.prompt_token_ids)}, {prompt_logprobs}outputs={self.outputs!r}, "
            f"num_cached_tokens={self.num_cached_tokens}, finished={self.finished})"
        )


# ---- pooling (runner="pooling": LLM.encode / LLM.embed), vLLM's classes ------------------------


@dataclass
class PoolingOutput:
    data: "torch.Tensor"  # noqa: F821 -- the pooled vector, float32 [dimensions or hidden_size]

    def __repr__(self) -> str:
        return f"PoolingOutput(data=<tensor of shape {list(self.data.shape)}>)"


@dataclass
class PoolingRequestOutput:
    """One prompt's pooled result (LLM.encode); `outputs.data` is a float32 tensor."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)

    def with_outputs(self, cls: type, outputs) -> PoolingRequestOutput:
        """This result as `cls` (a subclass: EmbeddingRequestOutput, ...) holding `outputs` instead."""
        return cls(request_id=self.request_id, outputs=outputs, prompt_token_ids=self.prompt_token_ids,
                   num_cached_tokens=self.num_cached_tokens, finished=self.finished, prompt=self.prompt,
                   metrics=self.metrics)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
            f"prompt_token_ids={short_list(self.prompt_token_ids)}, num_cached_tokens={self.num_cached_tokens}, "
            f"finished={self.finished})"
        )


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        return EmbeddingOutput(pooling_output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(embedding={short_list(self.embedding, 'values')})"


@dataclass(repr=False)
class EmbeddingRequestOutput(PoolingRequestOutput):
    """One prompt's embedding (LLM.embed): `outputs.embedding` is a list of floats."""

    outputs: EmbeddingOutput

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return request_output.with_outputs(EmbeddingRequestOutput, EmbeddingOutput.from_base(request_output.outputs))


@dataclass
class ScoringOutput:
    score: float

    def __repr__(self) -> str:
        return f"ScoringOutput(score={self.score})"


@dataclass(repr=False)
class ScoringRequestOutput(PoolingRequestOutput):
    """One pair's similarity (LLM.score): `outputs.score` is a float."""

    outputs: ScoringOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label: probabilities (softmax or sigmoid), or logits without activation

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ClassificationOutput:
        return ClassificationOutput(pooling_output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    def __repr__(self) -> str:
        return f"ClassificationOutput(probs={short_list(self.probs, 'values')})"


@dataclass(repr=False)
class ClassificationRequestOutput(PoolingRequestOutput):
    """One prompt's class probabilities (LLM.classify): `outputs.probs` is a list of floats."""

    outputs: ClassificationOutput

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return request_output.with_outputs(ClassificationRequestOutput, ClassificationOutput.from_base(request_output.outputs))
