"""Turn a batch of logits into next tokens, with vLLM's sampling semantics.

Per step the engine describes each row with a SamplingRow; SamplingMetadata.build turns the rows
into per-row tensors once; Sampler.forward then works on the whole batch at once, with no Python
loop over rows or over the vocabulary.

Order of operations (vLLM's):
  1. structured outputs: tokens a row's grammar forbids -> -inf (constrained rows only).
  1b. logprobs (if any row asked): log_softmax of these logits, before anything below. vLLM
     masks the logits with the grammar before its sampler, so its "raw" logprobs of a
     constrained row are over the tokens the grammar allows.
  2. suppressed tokens (EOS / stop ids while min_tokens is not reached, the last token of a bad
     word the output would complete) -> -inf, except in a row where that would leave its grammar
     no token at all.
  2b. allowed_token_ids: every other token -> -inf; logit_bias added (vLLM's logits processors,
     after its raw logprobs, before penalties).
  3. penalties: repetition (over prompt + output), frequency and presence (over the output).
  4. greedy rows (temperature 0, or top_k 1, which keeps the same single token) take the argmax.
  5. the other rows: logits / temperature, then top_k, top_p, min_p, then a seeded draw
     (filters.py: one cutoff per row, an inverse-CDF draw with a counter-based uniform).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.sampling.filters import apply_penalties, draw_filtered, draw_full
from nanoserve.sampling.metadata import SamplingMetadata
from nanoserve.sampling.prompt_scores import score_tokens
from nanoserve.sampling.rng import row_uniforms


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, logprob of the sampled token; None if nobody asked
    ranks: torch.Tensor | None  # [B] int64, the sampled token's rank in the vocabulary (1 = most likely)
    topk_token_ids: torch.Tensor | None  # [B, K] int64, K = max logprobs asked (may be 0)
    topk_logprobs: torch.Tensor | None  # [B, K] float32


def _take(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """t[rows] for sorted, unique rows, without copying when they are all of t."""
    return t if t is None or rows.numel() == t.shape[0] else t[rows]


class Sampler(torch.nn.Module):
    """logits [B, V] (any float dtype; computed in float32) + SamplingMetadata -> SamplerOutput."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
            raise ValueError(
                f"logits must be [{meta.num_rows}, {meta.vocab_size}], got {list(logits.shape)}"
            )
        no_processing = (meta.suppressed is None and meta.grammar_forbidden is None and meta.repetition_penalty is None
                         and meta.frequency_penalty is None and meta.presence_penalty is None
                         and meta.bias is None and meta.disallowed is None)
        if meta.all_greedy and no_processing and meta.max_num_logprobs is None:
            # The common path: float32 conversion is exact and monotone, so skip it for argmax.
            return SamplerOutput(logits.argmax(-1), None, None, None, None)
        raw = logits.float()  # [B, V]; may be the caller's tensor, so never written in place

        logits = raw
        if meta.grammar_forbidden is not None:
            logits = logits.masked_fill(meta.grammar_forbidden, float("-inf"))
        scored = logits  # what logprobs are taken from: the model's, less what the grammar forbids
        if meta.suppressed is not None:
            suppressed = logits.index_put((meta.suppressed[0], meta.suppressed[1]), logits.new_tensor(float("-inf")))
            if meta.grammar_forbidden is not None:
                # The grammar wins: a row whose grammar admits only suppressed ids keeps them (its
                # sample then ends with the grammar, before min_tokens) rather than drawing from nothing.
                suppressed = torch.where(torch.isneginf(suppressed).all(-1, keepdim=True), logits, suppressed)
            logits = suppressed
        if meta.disallowed is not None:
            allowed = logits.masked_fill(meta.disallowed, float("-inf"))
            # A row whose allowed ids the grammar, min_tokens or bad_words already removed keeps what
            # it had rather than drawing from nothing (a NaN distribution, an id past the vocabulary).
            logits = torch.where(torch.isneginf(allowed).all(-1, keepdim=True), logits, allowed)
        if meta.bias is not None:
            index, values = meta.bias
            logits = logits.index_put((index[0], index[1]), values, accumulate=True)
        logits = apply_penalties(logits, meta)
        token_ids = self._sample(logits, meta)

        if meta.max_num_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, None)
        # The sampled token's logprob and vLLM's rank (how many tokens score >= it), and the top k:
        # the same scoring as prompt logprobs, over log_softmax(scored).
        scores = score_tokens(scored, token_ids, meta.max_num_logprobs)
        return SamplerOutput(token_ids, scores.logprobs, scores.ranks, scores.topk_ids, scores.topk_logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """[B, V] processed logits (never written to) -> [B] int64 token ids."""
        if meta.all_greedy:
            return logits.argmax(-1)  # ties go to the lowest id
        # The greedy rows' answer; the sampled rows are overwritten below.
        token_ids = logits.argmax(-1) if meta.any_greedy else logits.new_empty(meta.num_rows, dtype=torch.int64)
        u = row_uniforms(meta.seeds, meta.steps)  # [B]
        temperature = meta.temperature if meta.need_temperature else None
        if (rows := meta.plain_rows) is not None:  # temperature only: the whole vocabulary
            token_ids[rows] = draw_full(_take(logits, rows), _take(temperature, rows), u[rows], None)
        if (rows := meta.filtered_rows) is not None:
            token_ids[rows] = draw_filtered(
                _take(logits, rows), _take(temperature, rows), u[rows],
                meta.top_k[rows], meta.top_p[rows], meta.min_p[rows], meta,
            )
        return token_ids
