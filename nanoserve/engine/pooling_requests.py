"""Pooling requests in the engine: checked before any work, queued as prefill-only sequences,
finished the step their prompt completes (their KV blocks freed then; only the prefix cache
keeps what it holds), their pooled vector truncated (Matryoshka) and normalised as asked, or a
classifier's logits turned into probabilities."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.config import Config
from nanoserve.engine.sequence import Sequence
from nanoserve.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from nanoserve.pooling_params import PoolingParams


@dataclass(frozen=True)
class PoolingSpec:
    """A pooling request checked against the engine: what validate_request returns for it."""

    prompt_token_ids: list[int]  # after truncate_prompt_tokens
    dimensions: int | None
    normalize: bool
    activation: str | None = None  # a classifier's: "softmax", "sigmoid" or None (raw logits)


@dataclass
class PoolingRequest:
    request_id: str
    prompt: str | None
    spec: PoolingSpec
    seqs: list[Sequence]  # one: a pooling request has no samples to fork
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return self.seqs[0].is_finished


def validate_pooling_request(
    prompt_token_ids: list[int], params, config: Config, vocab_size: int
) -> PoolingSpec:
    """Every check that can fail, before any work; the engine's runner must be "pooling"."""
    if config.runner != "pooling":
        raise ValueError(
            "PoolingParams need an embedding or classification engine: this LLM was built with "
            "runner='generate'; build LLM(model, runner='pooling') to embed or classify"
        )
    if not isinstance(params, PoolingParams):
        raise TypeError(
            f"this LLM was built with runner='pooling' (an embedding model or classifier): it takes "
            f"PoolingParams (LLM.embed / LLM.classify / LLM.encode) and does not generate, got {type(params).__name__}"
        )
    params.validate()
    pooling = config.pooling
    if not prompt_token_ids:
        raise ValueError("prompt is empty: a prompt needs at least one token")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be ints in [0, {vocab_size}); got {bad[:5]}")
    ids = truncate(list(prompt_token_ids), params.truncate_prompt_tokens, config.max_model_len)
    if len(ids) > config.max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens, longer than max_model_len={config.max_model_len}; "
            "pass truncate_prompt_tokens to keep its last tokens"
        )
    if pooling.task == "classify":
        if params.dimensions is not None:
            raise ValueError(f"dimensions={params.dimensions}: a classifier returns its {pooling.num_labels} label "
                             "scores; dimensions is for embeddings, leave it None")
        wanted = params.wants_normalize  # vLLM's use_activation: False keeps the raw logits
        use = pooling.use_activation if wanted is None else wanted
        return PoolingSpec(ids, None, False, pooling.activation if use else None)
    _check_dimensions(params.dimensions, pooling.hidden_size, pooling.matryoshka_dimensions)
    # None: the checkpoint's size (config_sentence_transformers.json truncate_dim, else hidden_size)
    dimensions = params.dimensions if params.dimensions is not None else pooling.default_dimensions
    normalize = params.wants_normalize
    return PoolingSpec(ids, dimensions, pooling.normalize if normalize is None else normalize)


def tokenize(tokenizer, text: str, encode_kwargs: dict | None = None) -> list[int]:
    """A text prompt's token ids with the special tokens the tokenizer adds (as sentence-transformers
    tokenizes: Qwen3-Embedding's appended end-of-text is what last-token pooling reads)."""
    if text == "":  # the tokenizer's own tokens alone would embed nothing of the user's
        raise ValueError("prompt is empty: a prompt needs at least one token")
    return tokenizer.encode(text, **(encode_kwargs or {}))


def truncate(token_ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: max_model_len)."""
    if k is None:
        return token_ids
    k = max_model_len if k == -1 else k
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={k} exceeds max_model_len={max_model_len}")
    return token_ids[-k:]


def _check_dimensions(dimensions: int | None, hidden_size: int, matryoshka: tuple[int, ...] | None) -> None:
    if dimensions is None:
        return
    if matryoshka is None:
        raise ValueError(
            f"dimensions={dimensions}: this model does not support Matryoshka embeddings (neither config.json nor "
            "config_sentence_transformers.json has is_matryoshka, matryoshka_dimensions or truncate_dim); "
            "leave dimensions=None"
        )
    if dimensions > hidden_size:
        raise ValueError(f"dimensions={dimensions} exceeds the model's hidden_size={hidden_size}")
    if matryoshka and dimensions not in matryoshka:
        raise ValueError(f"dimensions={dimensions} is not one of the model's matryoshka_dimensions {list(matryoshka)}")


def make_pooling_request(request_id: str, seq_id: int, prompt: str | None, params: PoolingParams,
                         spec: PoolingSpec) -> PoolingRequest:
    ids = spec.prompt_token_ids
    # A prefill-only sequence: it ends with its prompt (max_total_tokens = prompt length).
    seq = Sequence(seq_id, request_id, 0, ids, params, len(ids), seed=0)
    return PoolingRequest(request_id, prompt, spec, [seq], RequestMetrics(time.perf_counter()))


def finish_pooling_request(request: PoolingRequest, pooled: torch.Tensor, now: float) -> PoolingRequestOutput:
    """pooled: the raw pooled vector [hidden_size] float32 -> the request's result."""
    spec = request.spec
    vector = pooled[: spec.dimensions] if spec.dimensions is not None else pooled
    if spec.normalize:  # after the Matryoshka cut, as vLLM: the shorter vector is unit length too
        vector = F.normalize(vector, dim=-1)
    if spec.activation == "softmax":
        vector = vector.softmax(-1)
    elif spec.activation == "sigmoid":
        vector = vector.sigmoid()
    request.metrics.finished_time = now
    seq = request.seqs[0]
    return PoolingRequestOutput(
        request_id=request.request_id,
        outputs=PoolingOutput(vector.contiguous()),
        prompt_token_ids=list(spec.prompt_token_ids),
        num_cached_tokens=seq.num_cached_tokens or 0,
        finished=True,
        prompt=request.prompt,
        metrics=request.metrics,
    )
