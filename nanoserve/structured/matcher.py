"""One sequence's place in its grammar: consumes the tokens it is given, says when it is done,
and offers the tokens the grammar forces next (jump-forward)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class StructuredStats:
    """Counters over an engine's life (the benchmark reads them; reset by assigning a new one)."""

    num_masks: int = 0  # token masks computed (one per constrained row per sampling step)
    mask_seconds: float = 0.0  # wall time spent computing them
    num_sampled_tokens: int = 0  # constrained tokens that went through the sampler
    num_forced_tokens: int = 0  # tokens appended by jump-forward, without sampling

    @property
    def mask_us_per_token(self) -> float:
        return 1e6 * self.mask_seconds / self.num_masks if self.num_masks else 0.0

    @property
    def forced_fraction(self) -> float:
        total = self.num_sampled_tokens + self.num_forced_tokens
        return self.num_forced_tokens / total if total else 0.0


class SequenceMatcher:
    """Wraps an llguidance LLMatcher. It sees each output token exactly once, when the token is
    appended (sampled or forced): recomputing a preempted sequence re-reads K/V, not the matcher."""

    __slots__ = ("llg", "stats", "jump_forward")

    def __init__(self, llg_matcher: Any, stats: StructuredStats, jump_forward: bool) -> None:
        self.llg = llg_matcher
        self.stats = stats
        self.jump_forward = jump_forward

    def accept(self, token_id: int) -> None:
        """The sampler picked `token_id` under this matcher's mask."""
        self.stats.num_sampled_tokens += 1
        ok = self.llg.consume_token(token_id)
        assert ok, f"the grammar refused token {token_id}, which its own mask allowed: {self.llg.get_error()}"

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and admits nothing more (its only allowed token would be EOS)."""
        return self.llg.is_stopped()

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next, already consumed; [] with jump-forward off.

        These are llguidance's canonical tokenization of the forced text (compute_ff_tokens keeps
        back a tail that a longer token could still absorb), so the model's next sampled token
        never has to split what was forced.
        """
        if not self.jump_forward or limit <= 0:
            return []
        tokens = self.llg.compute_ff_tokens()[:limit]
        if tokens:
            ok = self.llg.consume_tokens(tokens)
            assert ok, f"the grammar refused its own forced tokens {tokens}: {self.llg.get_error()}"
            self.stats.num_forced_tokens += len(tokens)
        return tokens
