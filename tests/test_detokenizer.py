"""IncrementalDetokenizer: incremental text equals a full decode, and stop strings cut it."""
from __future__ import annotations

import random

import pytest
import transformers

from nanoserve import SamplingParams
from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.utils.tiny_checkpoint import build_tiny_qwen3


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = build_tiny_qwen3(tmp_path_factory.mktemp("tiny"))
    return transformers.AutoTokenizer.from_pretrained(path)


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _detokenize(tok, prompt_ids, output_ids, stop=(), include=False, skip=True, min_tokens=0):
    """Feed output_ids one at a time, like the engine; returns (detokenizer, stop hit, #tokens fed)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, list(stop), include, skip, min_tokens=min_tokens)
    for n, token_id in enumerate(output_ids, start=1):
        hit = detok.update([token_id])
        if hit is not None:
            return detok, hit, n
    return detok, None, len(output_ids)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode(tok, skip):
    rng = random.Random(0)
    period = _encode(tok, ".")
    prompts = ["", "Hello there", "héllo 世界 🙂", "<|im_start|>assistant\n"]
    for trial in range(200):
        # Random ids hit lone bytes of multi-byte characters; ending on an ASCII token makes
        # the expected text well defined (a trailing partial character is held back).
        output = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))] + period
        prompt = _encode(tok, prompts[trial % len(prompts)])
        detok, _, _ = _detokenize(tok, prompt, output, skip=skip)
        assert detok.output_text == tok.decode(output, skip_special_tokens=skip), (prompt, output)


def test_text_matches_decode_with_prompt_context(tok):
    prompt = _encode(tok, "The quick brown")
    output = _encode(tok, " fox jumps over the lazy dog.")
    detok, _, _ = _detokenize(tok, prompt, output)
    assert detok.output_text == " fox jumps over the lazy dog."


def test_multibyte_characters_survive(tok):
    text = "héllo 世界 🙂 ok"
    output = _encode(tok, text)
    assert len(output) > len(text.split())  # characters really are split across tokens
    seen = []
    detok = IncrementalDetokenizer(tok, _encode(tok, "Say:"), [], False, True)
    for token_id in output:
        detok.update([token_id])
        seen.append(detok.output_text)
    assert detok.output_text == text
    assert not any("\ufffd" in s for s in seen)


def test_several_tokens_per_update(tok):
    output = _encode(tok, "Once upon a time, 世界.")
    detok = IncrementalDetokenizer(tok, [], [], False, True)
    assert detok.update(output[:3]) is None
    assert detok.update(output[3:]) is None
    assert detok.output_text == "Once upon a time, 世界."


def test_stop_string_spanning_two_tokens(tok):
    output = _encode(tok, "The weather today is cloudy with rain.")
    stop = "her tod"  # straddles the "weather" / " today" tokens
    assert "".join(tok.decode([i]) for i in output).count(stop) == 1
    assert not any(stop in tok.decode([i]) for i in output)
    detok, hit, fed = _detokenize(tok, [], output, stop=[stop])
    assert hit == stop
    assert detok.output_text == "The weat"
    assert detok.stop_hit == stop
    assert fed < len(output)  # stopped as soon as the stop string was complete


def test_include_stop_str_in_output(tok):
    output = _encode(tok, "What is two plus two? Two plus two is four.")
    detok, hit, _ = _detokenize(tok, [], output, stop=["plus two"], include=True)
    assert hit == "plus two" and detok.output_text == "What is two plus two"
    detok, hit, _ = _detokenize(tok, [], output, stop=["plus two"], include=False)
    assert hit == "plus two" and detok.output_text == "What is two "


def test_earliest_stop_string_wins_within_one_update(tok):
    detok = IncrementalDetokenizer(tok, [], ["four", "two"], False, True)
    assert detok.update(_encode(tok, "one two three four")) == "two"
    assert detok.output_text == "one "


def test_no_stop_when_absent_and_update_after_stop_is_an_error(tok):
    output = _encode(tok, "The dog sleeps.")
    detok, hit, _ = _detokenize(tok, [], output, stop=["cat"])
    assert hit is None and detok.output_text == "The dog sleeps."
    detok, hit, _ = _detokenize(tok, [], output, stop=["dog"])
    assert hit == "dog"
    with pytest.raises(RuntimeError):
        detok.update(_encode(tok, " more"))


def test_min_tokens_defers_stop_strings(tok):
    output = _encode(tok, "stop here and stop there")  # "st", "o", "p", " ", "here", ...
    detok, hit, fed = _detokenize(tok, [], output, stop=["stop"], min_tokens=3)
    assert hit == "stop" and detok.output_text == "stop here and "
    assert fed > 3
    # Like vLLM, a stop string completed after min_tokens may start within them.
    detok, hit, fed = _detokenize(tok, [], output, stop=["stop"], min_tokens=2)
    assert hit == "stop" and detok.output_text == "" and fed == 3


def test_unknown_ids_decode_to_nothing(tok):
    big = len(tok) + 1000  # the model vocab can be bigger than the tokenizer's
    hello = _encode(tok, "hello")
    detok = IncrementalDetokenizer(tok, [big, *hello], ["zzz"], False, True)
    for token_id in [big, *hello, len(tok), -1, *_encode(tok, " world")]:
        assert detok.update([token_id]) is None
    assert detok.output_text == "hello world"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    output = _encode(tok, "<think>\nhmm\n</think>\n\nHi!<|im_end|><|endoftext|>")
    detok, _, _ = _detokenize(tok, _encode(tok, "<|im_start|>assistant\n"), output, skip=skip)
    assert detok.output_text == tok.decode(output, skip_special_tokens=skip)
    if skip:
        # Like Qwen3, the think markers are not special and stay in the text.
        assert detok.output_text == "<think>\nhmm\n</think>\n\nHi!"
    else:
        assert detok.output_text.endswith("Hi!<|im_end|><|endoftext|>")


def test_empty_stop_string_is_rejected():
    # Checked once, by SamplingParams (the detokenizer trusts what the engine accepted).
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        SamplingParams(stop=[""])
