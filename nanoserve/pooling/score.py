"""`LLM.score`, as vLLM scores pairs: on an embedding model (a bi-encoder) the cosine similarity
of the two prompts' embeddings (its `_embedding_score`); on a one-label sequence classifier (a
cross-encoder reranker) the classifier's probability for the pair tokenized together, text and
text pair (its `_cross_encoding_score`).

Pairs are 1:1, 1:N (the one left prompt meets every right one) or N:N. A bi-encoder embeds both
sides in one batch, left then right: the left prompt of a 1:N call costs one forward pass.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F

from nanoserve.inputs import PromptType, as_prompt_list, parse_prompt
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


def cross_encoder_prompts(tokenizer, left: list, right: list, tokenization_kwargs: dict | None) -> list[dict]:
    """Each pair as one prompt: the tokenizer's text + text-pair encoding of the two texts (a token-id
    prompt decoded to its text first, as vLLM does)."""
    texts_1 = [_text(tokenizer, p, i) for i, p in enumerate(left)]
    texts_2 = [_text(tokenizer, p, len(left) + i) for i, p in enumerate(right)]
    if len(texts_1) == 1:
        texts_1 = texts_1 * len(texts_2)
    kwargs = tokenization_kwargs or {}
    return [{"prompt_token_ids": tokenizer(text=a, text_pair=b, **kwargs)["input_ids"]}
            for a, b in zip(texts_1, texts_2)]


def _text(tokenizer, prompt, i: int) -> str:
    text, ids = parse_prompt(prompt, i)
    return text if text is not None else tokenizer.decode(ids)


def pair_score(out: PoolingRequestOutput) -> ScoringRequestOutput:
    """A one-label classifier's result for a pair as its score."""
    return ScoringRequestOutput(request_id=out.request_id, outputs=ScoringOutput(score=float(out.outputs.data[0])),
                                prompt_token_ids=out.prompt_token_ids, num_cached_tokens=out.num_cached_tokens)


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

