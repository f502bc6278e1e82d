"""Incremental detokenisation with stop strings, following vLLM's detokenizer.

Decoding the whole output again after every token costs O(length) per token. Instead, each
step decodes only a small window of tokens twice: once up to the previously read position
(prefix_text) and once including the new tokens (new_text); the difference is the new text.
Decoding the window in one piece lets the tokenizer merge multi-byte characters and place
leading spaces exactly as a full decode would.
"""
from __future__ import annotations

# vLLM's window: how many already-read tokens are decoded as context for the new ones.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, one step at a time.

    min_tokens: text produced by the first min_tokens output tokens cannot trigger a stop
    string (vLLM's min_tokens semantics); a stop string may still *start* in that text.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # The model's vocab may be larger than the tokenizer's; ids past it decode to "".
        self._num_known_ids = len(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop or [])  # SamplingParams.validate checked them
        self._include_stop_str_in_output = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_output_tokens = 0
        self._text = ""
        self._stop_hit: str | None = None
        # The last prompt tokens are context only: they make the first output token decode
        # as it would mid-text (e.g. with its leading space) but never appear in the output.
        self._tokens = self._to_tokens(list(prompt_token_ids[-(_CONTEXT_TOKENS + 2) :]))
        self._read_offset = len(self._tokens)  # tokens before this are already in the text
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)  # window start

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_hit

    def update(self, new_token_ids: list[int]) -> str | None:
        """Feed newly generated tokens; returns the stop string that was hit (text cut there unless include_stop_str_in_output), else None."""
        if self._stop_hit is not None:
            raise RuntimeError(f"update() after stop string {self._stop_hit!r} was hit")
        check_from = len(self._text)
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            self._text += self._decode_next(token_id)
            if self._num_output_tokens <= self._min_tokens:
                check_from = len(self._text)
        if not self._stop or len(self._text) == check_from:
            return None
        return self._check_stop(check_from)

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        known = [i for i in token_ids if 0 <= i < self._num_known_ids]
        if not known:
            return []
        tokens = self._tokenizer.convert_ids_to_tokens(known, skip_special_tokens=self._skip_special_tokens)
        return [t for t in tokens if t is not None]

    def _decode_next(self, token_id: int) -> str:
        self._tokens += self._to_tokens([token_id])
        window = self._tokens[self._prefix_offset :]
        prefix_text = self._tokenizer.convert_tokens_to_string(window[: self._read_offset - self._prefix_offset])
        new_text = self._tokenizer.convert_tokens_to_string(window)
        # A trailing U+FFFD means the window ends inside a multi-byte character whose other
        # bytes are still to come: emit nothing yet and decode it whole next time.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]

    def _check_stop(self, check_from: int) -> str | None:
        """Find the earliest stop string ending in text[check_from:] and truncate there."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # A stop string may begin up to len(stop) - 1 characters before the new text.
            index = self._text.find(stop, max(check_from - len(stop) + 1, 0))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[: index + len(stop) if self._include_stop_str_in_output else index]
        self._stop_hit = stop
        return stop
