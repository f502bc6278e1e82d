"""Score given tokens under rows of logits: the numbers behind prompt logprobs.

float32 log_softmax of the RAW logits (no penalties, no temperature: vLLM's prompt logprobs are
the model's distribution), the target token's logprob and rank (vLLM's rank: how many tokens have
a logprob >= the target's, so 1 = the most likely), and the top k. Rows are taken a slice at a
time so a long prompt never holds a [rows, vocab] float32 copy of all its logits at once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

ROWS_PER_SLICE = 256  # [256, 152k-vocab] float32 is ~150 MB: bounded whatever the prompt length


class TokenScores(NamedTuple):
    logprobs: torch.Tensor  # [R] float32, the target token's logprob
    ranks: torch.Tensor  # [R] int64, 1 = the most likely token
    topk_ids: torch.Tensor  # [R, k] int64
    topk_logprobs: torch.Tensor  # [R, k] float32


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, k: int) -> TokenScores:
    """logits [R, V] (any float dtype), targets [R] int64 -> the targets' scores and the top k."""
    k = min(k, logits.shape[-1])
    parts = [_score_slice(logits[i : i + ROWS_PER_SLICE], targets[i : i + ROWS_PER_SLICE], k)
             for i in range(0, logits.shape[0], ROWS_PER_SLICE)]
    if not parts:
        return _score_slice(logits.new_empty((0, logits.shape[-1])), targets, k)
    return TokenScores(*(torch.cat(cols) for cols in zip(*parts)))


def _score_slice(logits: torch.Tensor, targets: torch.Tensor, k: int) -> TokenScores:
    logprobs = logits.float().log_softmax(-1)  # [r, V]
    target = logprobs.gather(1, targets[:, None])  # [r, 1]
    ranks = (logprobs >= target).sum(-1)  # [r]
    top_vals, top_ids = logprobs.topk(k, dim=-1)  # [r, k]
    return TokenScores(target.squeeze(1), ranks, top_ids, top_vals)
