"""`LLM.score` on an embedding model: the cosine similarity of two prompts' embeddings, as vLLM
scores pairs with a bi-encoder (its `_embedding_score`).

Pairs are 1:1, 1:N (the one left prompt meets every right one) or N:N. Every distinct prompt is
embedded once in one batch, left then right, so a shared query costs one forward pass.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F

from nanoserve.inputs import PromptType, as_prompt_list
from nanoserve.outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput


def score_sides(data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType]
                ) -> tuple[list, list]:
    """The two sides as prompt lists, checked for vLLM's pairings (1:1, 1:N, N:N)."""
    for name, data in (("data_1", data_1), ("data_2", data_2)):
        if isinstance(data, Sequence) and not isinstance(data, str) and len(data) == 0:
            raise ValueError(f"score() needs at least one prompt in {name}")
    left, right = as_prompt_list(data_1), as_prompt_list(data_2)
    if len(left) > 1 and len(left) != len(right):
        raise ValueError(
            f"score() pairs data_1 with data_2 1:1, 1:N or N:N; got {len(left)} and {len(right)} prompts"
        )
    return left, right


def cosine_scores(left: list[PoolingRequestOutput], right: list[PoolingRequestOutput],
                  pad_token_id: int | None) -> list[ScoringRequestOutput]:
    """One score per pair; a single left output meets every right one. Each pair's token ids are the
    left prompt's, the pad token (where the tokenizer has one) and the right prompt's, as vLLM reports them."""
    if len(left) == 1:
        left = left * len(right)
    padding = [] if pad_token_id is None else [pad_token_id]
    scores = []
    for a, b in zip(left, right):
        similarity = F.cosine_similarity(a.outputs.data.float(), b.outputs.data.float(), dim=0)
        scores.append(ScoringRequestOutput(
            request_id=f"{a.request_id}_{b.request_id}",
            outputs=ScoringOutput(score=float(similarity)),
            prompt_token_ids=a.prompt_token_ids + padding + b.prompt_token_ids,
            num_cached_tokens=a.num_cached_tokens + b.num_cached_tokens,
        ))
    return scores

