"""One sequence being generated: its tokens, how many of them have K/V in the cache, its blocks."""
from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler side never imports torch
    from nanoserve.sampling.metadata import SamplingSpec


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request's single sample stream (a request with n > 1 owns n of these).

    `num_computed_tokens` chases `num_tokens`: tokens below it have K/V in the cache. A step
    schedules some new tokens; when the last one is the last known token, the step samples.
    The Scheduler alone writes it (admission sets it to the prefix-cache hit, a step advances it,
    preemption resets it); the BlockManager owns `block_table` and only reads the count.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        sample_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_total_tokens: int,
        seed: int,
        sampling_spec: SamplingSpec | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index  # 0..n-1 within that request
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_total_tokens = max_total_tokens  # min(prompt + max_tokens, max_model_len)
        self.seed = seed
        self.sampling_spec = sampling_spec  # `params` checked against the model; set by the engine
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache served, set when first scheduled
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] = []  # per output token when params.logprobs is set
        self.cumulative_logprob = 0.0
        self.first_token_time: float | None = None
        # The request's other n-1 samples; they start on this sequence's prompt blocks once its
        # prompt is computed, those past max_num_seqs from the queue (see Scheduler._fork_children).
        self.children: list[Sequence] = []
        # Structured outputs: the grammar matcher (nanoserve/structured/matcher.py), set by the engine.
        self.matcher = None

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, {self.status.name})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True until the K/V of every prompt token is in the cache."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
