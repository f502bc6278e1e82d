"""LLM.beam_search against the same search run on HF transformers' model (vLLM's algorithm: 2 x
beam_width candidates per beam, score = cumulative logprob / length ** length_penalty)."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_no_leak, make_llm, random_prompts

from nanoserve import BeamSearchParams, TokensPrompt
from nanoserve.sampling_params import BeamSearchParams as FromSamplingParams


@torch.inference_mode()
def hf_beam_search(model, prompt: list[int], width: int, max_tokens: int, eos: int | None, length_penalty: float,
                   ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """The reference: every beam's next-token log_softmax from HF's forward pass over its tokens."""
    def score(tokens, cum):
        return cum / ((len(tokens) - (tokens[-1] == eos)) ** length_penalty)

    beams, done = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        children = []
        for tokens, cum in beams:
            logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            values, ids = logprobs.topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist()):
                child = (tokens + [token], cum + value)
                (done if token == eos and not ignore_eos else children).append(child)
        beams = sorted(children, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + beams, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_match_the_search_on_hf(tiny_model, hf, width, length_penalty):
    llm = make_llm(tiny_model, kvcache_block_size=4)
    prompts = random_prompts(3, 3, 9, seed=width)
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    outs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts], params, concurrency_limit=2)
    eos = llm.get_tokenizer().eos_token_id
    for prompt, out in zip(prompts, outs):
        expected = hf_beam_search(hf.model(tiny_model), prompt, width, 6, eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
        for seq, (_, cum) in zip(out.sequences, expected):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
            assert all(len(step) == 2 * width for step in seq.logprobs)
    assert_no_leak(llm)


def test_eos_finishes_a_beam_unless_ignored(tiny_model, hf):
    llm = make_llm(tiny_model)
    prompt = random_prompts(1, 5, 5, seed=11)[0]
    # Make the prompt's likeliest next token the EOS, so a beam finishes on the first step.
    top = int(torch.log_softmax(hf.model(tiny_model)(torch.tensor([prompt])).logits[0, -1], -1).argmax())
    tokenizer = llm.get_tokenizer()  # its eos_token_id is the one vLLM's beam search reads
    original = tokenizer.eos_token
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(top)
    try:
        stopped = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(2, 4))[0].sequences
        ignored = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(2, 4, ignore_eos=True))[0].sequences
    finally:
        tokenizer.eos_token = original
    finished = [s for s in stopped if s.tokens[-1] == top and len(s.tokens) == len(prompt) + 1]
    assert finished, "the EOS candidate of the first step ends its beam"
    assert all(len(s.tokens) == len(prompt) + 4 for s in ignored)


def test_text_prompts_and_vllm_import_path(tiny_model):
    llm = make_llm(tiny_model)
    assert FromSamplingParams is BeamSearchParams
    (out,) = llm.beam_search([{"prompt": "hello world"}], BeamSearchParams(beam_width=2, max_tokens=3))
    ids = llm.get_tokenizer().encode("hello world")
    assert len(out.sequences) == 2 and all(s.tokens[: len(ids)] == ids for s in out.sequences)


def test_a_beam_at_max_model_len_is_kept_as_finished(tiny_model):
    llm = make_llm(tiny_model, max_model_len=12)
    prompt = random_prompts(1, 10, 10, seed=5)[0]
    (out,) = llm.beam_search([TokensPrompt(prompt_token_ids=prompt)], BeamSearchParams(beam_width=2, max_tokens=8))
    assert len(out.sequences) == 2 and all(len(s.tokens) == 12 for s in out.sequences)
    assert_no_leak(llm)


@pytest.mark.parametrize("make, kind, match", [
    (lambda: BeamSearchParams(0, 4), ValueError, "beam_width must be an integer >= 1"),
    (lambda: BeamSearchParams(2, 0), ValueError, "max_tokens must be an integer >= 1"),
    (lambda: BeamSearchParams(2, 4, temperature=-1.0), ValueError, "temperature must be >= 0"),
    (lambda: BeamSearchParams(2, 4, length_penalty=float("nan")), ValueError, "length_penalty must be a finite"),
])
def test_bad_params_are_refused(make, kind, match):
    with pytest.raises(kind, match=match):
        make()


def test_bad_requests_fail_before_work(tiny_model):
    llm = make_llm(tiny_model, max_model_len=32)
    next_id = llm.engine._next_request_id
    good = TokensPrompt(prompt_token_ids=[5, 6, 7])
    for prompts, params, match in [
        ([good, TokensPrompt(prompt_token_ids=[1] * 33)], BeamSearchParams(2, 3), "1 to max_model_len=32 tokens"),
        ([good, TokensPrompt(prompt_token_ids=[10**7])], BeamSearchParams(2, 3), "vocab_size"),
        ([good], BeamSearchParams(11, 3), r"beam_width=11 takes 22 logprobs a step, more than max_logprobs allows \(20\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.beam_search(prompts, params)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([good], {"beam_width": 2})
    assert llm.engine._next_request_id == next_id
    assert_no_leak(llm)
    uncapped = make_llm(tiny_model, max_model_len=32, max_logprobs=-1)  # vLLM's "no cap": the whole vocabulary
    (out,) = uncapped.beam_search([good], BeamSearchParams(11, 2))
    assert len(out.sequences) == 11
