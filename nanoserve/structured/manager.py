"""The engine's structured-outputs state: the llguidance tokenizer, the grammar cache, the
jump-forward option and the counters. Everything per request goes through here:

  check(params)                  when the request is validated: compile (cached) or ValueError
  attach(seqs, detoks, params)   when its sequences are made: one matcher each, plus the tokens
                                 the grammar forces at the very start (they prefill with the prompt)
  after_token(seq) / forced      in the step loop (llm_engine.py): the matcher consumes the sampled
                                 token; a finished grammar stops the sequence; forced tokens follow
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanoserve.structured.grammar import GrammarCache, make_tokenizer
from nanoserve.structured.matcher import SequenceMatcher, StructuredStats
from nanoserve.structured.params import StructuredOutputsParams


# Any is named, not imported: sampling_params.py imports this package.
def constraint_of(params: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field it came in (for messages), or None."""
    for name in ("structured_outputs", "guided_decoding"):
        constraint = getattr(params, name)
        if constraint is not None:
            return constraint, constraint.source or f"{name}.{constraint.kind}"
    return None


class StructuredOutputManager:
    def __init__(
        self, get_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int], jump_forward: bool
    ) -> None:
        self._get_tokenizer = get_tokenizer  # the engine's current tokenizer (set_tokenizer may swap it)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.jump_forward = jump_forward
        self.stats = StructuredStats()
        self._hf_tokenizer = None
        self._cache: GrammarCache | None = None

    def _grammars(self) -> GrammarCache:
        """Built on the first constrained request: free-text users never load llguidance."""
        tokenizer = self._get_tokenizer()
        if self._cache is None or tokenizer is not self._hf_tokenizer:
            self._cache = GrammarCache(make_tokenizer(tokenizer, self.vocab_size, self.eos_token_ids))
            self._hf_tokenizer = tokenizer
        return self._cache

    def check(self, params: Any) -> None:
        """Compile the request's constraint (or find it cached); ValueError naming the field."""
        found = constraint_of(params)
        if found is not None:
            constraint, name = found
            self._grammars().matcher(constraint.spec(), name)

    def new_matcher(self, params: Any) -> SequenceMatcher | None:
        found = constraint_of(params)
        if found is None:
            return None
        constraint, name = found
        llg = self._grammars().matcher(constraint.spec(), name)
        # Forced tokens get no logprobs (nothing sampled them): a request asking for logprobs
        # takes every token from the sampler.
        return SequenceMatcher(llg, self.stats, self.jump_forward and params.logprobs is None)

    def attach(self, seqs: list, detokenizers: list, params: Any) -> None:
        """Give each new sequence its matcher and append what the grammar forces before the first
        sampled token (e.g. `{"name": "`), so it is prefilled with the prompt.

        Skipped where a forced token could end the request before it runs (stop strings or stop
        ids, which are checked as tokens arrive in the step loop), and kept one short of max_tokens.
        """
        start_ok = not params.stop and not params.stop_token_ids
        for seq, detok in zip(seqs, detokenizers):
            seq.matcher = self.new_matcher(params)
            if seq.matcher is None or not start_ok:
                continue
            forced = seq.matcher.forced_tokens(seq.max_total_tokens - seq.num_tokens - 1)
            if forced:
                seq.token_ids.extend(forced)
                if detok is not None:
                    detok.update(forced)
