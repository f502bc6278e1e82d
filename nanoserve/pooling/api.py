"""PoolingParams per prompt for `LLM.encode` / `LLM.embed` / `LLM.embed_stream` (runner="pooling").

Pooling requests go through the same request path as `generate` (InputProcessor, the step loop);
only the params (PoolingParams) and the results differ.
"""
from __future__ import annotations

import dataclasses

from nanoserve.pooling_params import PoolingParams

POOLING_TASKS = ("embed", "classify")


def params_per_prompt(pooling_params, num_prompts: int, truncate_prompt_tokens: int | None) -> list[PoolingParams]:
    """One PoolingParams per prompt (None = the defaults); truncate_prompt_tokens overrides theirs."""
    if pooling_params is None:
        pooling_params = PoolingParams()
    if isinstance(pooling_params, PoolingParams):
        params = [pooling_params] * num_prompts
    elif isinstance(pooling_params, (list, tuple)):
        if len(pooling_params) != num_prompts:
            raise ValueError(
                f"got {len(pooling_params)} pooling_params for {num_prompts} prompts; pass one, or one per prompt"
            )
        params = list(pooling_params)
    else:
        raise TypeError(f"pooling_params must be PoolingParams or a list of them, got {type(pooling_params).__name__}")
    for p in params:
        if not isinstance(p, PoolingParams):
            raise TypeError(f"pooling_params entries must be PoolingParams, got {type(p).__name__}")
    if truncate_prompt_tokens is None:
        return params
    return [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]


def check_task(pooling, task: str | None) -> None:
    """An engine pools for one task (its checkpoint's): asking a classifier for embeddings, or an
    embedding model for class probabilities, is refused before any work. `pooling`: the engine's
    Pooling (None for a generating engine, whose own error comes when the request is prepared)."""
    if task not in (None, *POOLING_TASKS):
        raise ValueError(f"pooling_task must be one of {POOLING_TASKS} (or None), got {task!r}")
    if task is not None and pooling is not None and task != pooling.task:
        model, call = (("a sequence classifier", "classify()") if pooling.task == "classify"
                       else ("an embedding model", "embed()"))
        raise ValueError(f"pooling_task={task!r}: this LLM's model is {model}; use llm.{call}")
