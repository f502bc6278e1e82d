"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): which positions a step scores, and
the per-request record that turns the runner's numbers into `RequestOutput.prompt_logprobs`.

The logits at position p score prompt token p + 1, so a prompt of L tokens is scored by the logits
at positions 0 .. L-2 (token 0 has no logprob: `None`, as in vLLM). A prompt split over several
steps (chunked prefill) is scored chunk by chunk; a request that is preempted and recomputed
writes the same positions again (the record is keyed by position, so nothing is counted twice).

Prefix cache: a cached block keeps K/V, not logits. A request therefore never takes cache hits at
positions it needs scored (`max_cached_tokens`); with `prompt_logprobs_start=s` (score only tokens
s..L-1, e.g. a continuation after a shared context) the blocks before position s-1 may still be
hits, and their numbers would be the same had they been computed: the logits at a position depend
only on the tokens up to it. So a hit can never return logprobs computed for other tokens.

Torch-free (the scheduler side imports it); the numbers are computed by
`nanoserve.sampling.prompt_scores.score_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoserve.outputs import Logprob

if TYPE_CHECKING:
    from nanoserve.engine.sequence import Sequence

PromptLogprobs = list[dict[int, Logprob] | None]  # RequestOutput.prompt_logprobs: one per prompt token


def first_scored_position(seq: Sequence) -> int | None:
    """The first position whose logits this sequence must compute for its prompt logprobs, or None.

    Only a request's first sample scores its prompt (its other samples share the prompt); once it
    has sampled a token its prompt was wholly scored, so a recompute after preemption scores nothing.
    Pooling requests (PoolingParams) score nothing.
    """
    params = seq.params
    if getattr(params, "prompt_logprobs", None) is None or seq.sample_index != 0 or seq.num_output_tokens > 0:
        return None
    start = max(params.prompt_logprobs_start or 1, 1)  # token 0 has no logprob
    return min(start, seq.num_prompt_tokens) - 1


def max_cached_tokens(seq: Sequence) -> int:
    """The most leading tokens of `seq` the prefix cache may serve: none it needs logits for."""
    first = first_scored_position(seq)
    return seq.num_tokens if first is None else first


def scored_positions(seq: Sequence, num_new_tokens: int) -> range:
    """Positions among this step's new tokens (from `seq.num_computed_tokens`) whose logits score a
    prompt token."""
    first = first_scored_position(seq)
    if first is None:
        return range(0)
    start = seq.num_computed_tokens
    return range(max(start, first), min(start + num_new_tokens, seq.num_prompt_tokens - 1))


@dataclass
class PromptLogprobsChunk:
    """One step's scores for one sequence: positions `first`, `first + 1`, ... score prompt tokens
    `first + 1`, ...; lists are per position; top-k lists have the request's own k."""

    batch_index: int
    first: int
    token_logprobs: list[float]
    ranks: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]


@dataclass
class PromptLogprobsRecord:
    """A request's prompt scores, filled chunk by chunk and keyed by the scored token's index."""

    prompt_token_ids: list[int]
    num_logprobs: int
    start: int  # first scored token index (>= 1)
    scores: dict[int, tuple[float, int, list[int], list[float]]] = field(default_factory=dict)

    @classmethod
    def for_request(cls, prompt_token_ids: list[int], params, num_logprobs: int | None) -> PromptLogprobsRecord | None:
        """`num_logprobs`: the request's k for this model (SamplingSpec.prompt_logprobs: -1 resolved)."""
        if num_logprobs is None:
            return None
        return cls(list(prompt_token_ids), num_logprobs, max(params.prompt_logprobs_start or 1, 1))

    def record(self, chunk: PromptLogprobsChunk) -> None:
        for i, (lp, rank, ids, lps) in enumerate(
            zip(chunk.token_logprobs, chunk.ranks, chunk.topk_ids, chunk.topk_logprobs, strict=True)
        ):
            self.scores[chunk.first + 1 + i] = (lp, rank, ids, lps)

    def output(self, decode=None) -> PromptLogprobs:
        """vLLM's layout: `None` for token 0 (and, here, for tokens before `start`), then per token a
        dict holding the prompt token (with its rank) first, then the top k with ranks 1..k.
        `decode(token_id) -> str` fills `decoded_token` (None leaves it None, as detokenize=False)."""
        missing = [t for t in range(self.start, len(self.prompt_token_ids)) if t not in self.scores]
        assert not missing, f"prompt tokens {missing[:5]} were never scored"
        out: PromptLogprobs = [None] * min(self.start, len(self.prompt_token_ids))
        for t in range(self.start, len(self.prompt_token_ids)):
            lp, rank, ids, lps = self.scores[t]
            token = self.prompt_token_ids[t]
            # vLLM builds the dict from [prompt token, top 1..k]: a prompt token in the top k keeps
            # its place first and takes its top-k rank.
            entry = {token: Logprob(lp, rank, decode(token) if decode else None)}
            for r, (tid, tlp) in enumerate(zip(ids[: self.num_logprobs], lps), start=1):
                entry[tid] = Logprob(tlp, r, decode(tid) if decode else None)
            out.append(entry)
        return out
