"""One sequence's place in its grammar: consumes the tokens it is given, says when it is done,
and offers the tokens the grammar forces next (jump-forward)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class StructuredStats:
    """Counters over an engine's life (the benchmark reads them; reset by assigning a new one)."""

    num_masks: int = 0  # token masks computed (one per constrained row per sampling step)
    mask_seconds: float = 0.0  # wall time spent computing them
    num_sampled_tokens: int = 0  # constrained tokens that went through the sampler
    num_forced_tokens: int = 0  # tokens appended by jump-forward, without sampling
    num_refused_tokens: int = 0  # sampled tokens the grammar refused after its mask allowed them

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
        """The sampler picked `token_id` under this matcher's mask.

        llguidance's mask can offer a token its parser then refuses: where the grammar forces text
        that spells a special token (a literal "<|im_end|>" or "<think>"), the mask holds that
        special token alone (outlines #1771). The refusal stops the matcher (`is_finished`), so
        the sample ends there, as with vLLM's llguidance backend, instead of failing the batch.
        """
        self.stats.num_sampled_tokens += 1
        if not self.llg.consume_token(token_id):
            self._refused([token_id])

    def _refused(self, tokens: list[int]) -> None:
        """llguidance refused tokens it offered; it is now stopped in error, so the sample ends."""
        self.stats.num_refused_tokens += len(tokens)
        logger.warning("the grammar refused tokens %s, which it allowed or forced; ending the sample: %s",
                       tokens[:8], (self.llg.get_error().splitlines() or [""])[0][:300])

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and admits nothing more (its only allowed token would be EOS)."""
        return self.llg.is_stopped()

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next, already consumed; [] with jump-forward off.

        These are llguidance's canonical tokenization of the forced text (compute_ff_tokens keeps
        back a tail that a longer token could still absorb), so the model's next sampled token
        never has to split what was forced. A grammar can also fail while consuming them (a schema
        whose required properties recurse forever exceeds llguidance's item limit): the matcher
        stops in error, nothing is appended and the sample ends.
        """
        if not self.jump_forward or limit <= 0:
            return []
        tokens = self.llg.compute_ff_tokens()[:limit]
        # compute_ff_tokens tokenizes the forced text as the tokenizer would, so text spelling a
        # special token (a regex or JSON const "<|im_end|>") comes back as that special token,
        # which the grammar's byte-level lexer refuses: keep only the prefix it accepts and let
        # the sampler spell the rest under the mask.
        tokens = tokens[: self.llg.validate_tokens(tokens)] if tokens else tokens
        if tokens and not self.llg.consume_tokens(tokens):
            self._refused(tokens)
            return []
        self.stats.num_forced_tokens += len(tokens)
        return tokens
