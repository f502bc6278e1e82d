"""vLLM's `SamplingParams.bad_words`: words a sample must never produce.

A word is tokenized twice, as written (leading spaces stripped) and with one leading space (its
form mid-text), keeping the second form only when it is a different token sequence of the same
length (vLLM's `update_from_tokenizer`). At each step the last token of a sequence is banned
when the output so far ends with all its other tokens (vLLM's `apply_bad_words`): a one-token
word is banned everywhere, a longer one only where it would be completed.
"""
from __future__ import annotations


def bad_words_token_ids(bad_words: list[str], tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell the words; ValueError for a word that tokenizes to nothing
    or to ids the model does not have."""
    sequences: list[list[int]] = []
    for word in bad_words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
                continue
            if not prefix or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                sequences.append(ids)
    bad = sorted({t for ids in sequences for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"bad_words tokenize to ids outside the model's vocabulary [0, {vocab_size}): {bad[:5]}")
    return tuple(tuple(ids) for ids in sequences)


def banned_tokens(sequences: tuple[tuple[int, ...], ...], token_ids: list[int], num_prompt_tokens: int) -> list[int]:
    """The tokens this step may not take, given a sequence's tokens (prompt, then output so far):
    only each word's prefix-long tail of the output is read, never the whole output copied."""
    banned = []
    num_output = len(token_ids) - num_prompt_tokens
    for ids in sequences:
        prefix = ids[:-1]
        if len(prefix) <= num_output and (not prefix or tuple(token_ids[len(token_ids) - len(prefix):]) == prefix):
            banned.append(ids[-1])
    return banned
