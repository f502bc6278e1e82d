"""Fuzzing the public API: random engine configs, random request mixes, invariants after every call.

Configs: block sizes 1-64, KV caches a few blocks over one full-length sequence (preemption),
small token budgets, max_num_seqs 1-8, chunked prefill and prefix caching on and off. Mixes:
text / token ids (also numpy ints) / prompt dicts, prompts sharing prefixes, empty prompts,
out-of-vocab ids, over-long prompts, prompts of the wrong type, valid and invalid SamplingParams,
n > 1, stop strings and ids, logprobs, seeds, min_tokens, in one generate.

Properties: a mix with a bad request raises ValueError/TypeError before any work (no forward
pass, no request left, no block touched); otherwise every request completes within its limits
with a consistent finish_reason / stop_reason, logprobs of the right length, no stop string left
in the text unless asked for, and seeded and greedy requests give the same samples again in
another batch and in an engine of another configuration. After every call the block manager's
integrity holds and every block is free or only cached.

Bounded in time: each example builds an engine and runs a few small calls; a failure prints
the `@reproduce_failure` blob.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from helpers import FaultInjectingBackend, assert_no_leak, make_llm
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nanoserve import LLM, SamplingParams, TextPrompt, TokensPrompt

FUZZ = settings(
    max_examples=60, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_MODEL_LEN = 80
TEXT = st.text(alphabet="abcdeht \n.,é中😀", min_size=1, max_size=24)
STOP_STRINGS = st.lists(st.sampled_from(["e", "a", " t", "he", ".", "\n", "é", "xyz"]), min_size=1, max_size=3)


@dataclass
class Case:
    prompt: object  # what generate() is given
    ids: list[int] | None  # the prompt's token ids once tokenized
    params: SamplingParams
    prompt_ok: bool
    params_ok: bool


# ---- strategies ------------------------------------------------------------------------------


@st.composite
def configs(draw) -> dict:
    block_size = draw(st.sampled_from([1, 2, 3, 4, 7, 8, 16, 31, 64]))
    max_model_len = draw(st.integers(8, MAX_MODEL_LEN))
    chunked = draw(st.booleans())
    budget = draw(st.integers(3, 48)) if chunked else max_model_len + draw(st.integers(0, 16))
    return dict(
        device="cpu", dtype="float32", attention_backend=FaultInjectingBackend,
        kvcache_block_size=block_size, max_model_len=max_model_len,
        # One full-length sequence always fits; more than that is what preemption is for.
        num_kvcache_blocks=math.ceil(max_model_len / block_size) + draw(st.integers(0, 3)),
        max_num_batched_tokens=budget, max_num_seqs=draw(st.integers(1, 8)),
        enable_chunked_prefill=chunked, enable_prefix_caching=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32)),
    )


def valid_params(draw, llm: LLM) -> SamplingParams:
    max_tokens = None if draw(st.integers(0, 9)) == 0 else draw(st.integers(1, 10))  # None: up to max_model_len
    vocab = llm.engine.vocab_size
    detokenize = draw(st.integers(0, 5)) > 0  # stop strings need text (vLLM refuses them without)
    return SamplingParams(
        n=draw(st.integers(1, min(3, llm.config.max_num_seqs))),
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0, 1.5])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.3])),
        top_k=draw(st.sampled_from([0, -1, 1, 5])),
        min_p=draw(st.sampled_from([0.0, 0.1])),
        presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.3])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.2, 0.8])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**40))),
        stop=draw(st.one_of(st.none(), STOP_STRINGS)) if detokenize else None,
        # Up to 80 ids: a random model's output hits one often enough to stop some samples.
        stop_token_ids=draw(st.one_of(st.none(), st.lists(
            st.one_of(st.integers(0, vocab - 1), st.sampled_from(llm.engine.eos_token_ids)), max_size=80))),
        include_stop_str_in_output=draw(st.booleans()),
        ignore_eos=draw(st.booleans()),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens if max_tokens is not None else 3)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 5))),
        skip_special_tokens=draw(st.booleans()),
        detokenize=detokenize,
    )


def spoil(draw, params: SamplingParams, llm: LLM) -> None:
    """Set one field to a value generate() must refuse (SamplingParams is mutable, like vLLM's)."""
    field, value = draw(st.sampled_from([
        ("temperature", -0.5), ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
        ("min_p", 2.0), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("max_tokens", 0),
        ("max_tokens", 2.5), ("min_tokens", 99), ("min_tokens", -1), ("n", 0),
        ("logprobs", -2), ("seed", -2), ("seed", 2**63), ("stop", [""]), ("stop", [3]),
        ("stop_token_ids", [llm.engine.vocab_size]), ("stop_token_ids", [-1]), ("ignore_eos", 1),
    ]))
    if field == "min_tokens" and params.max_tokens is None:
        params.max_tokens = 10  # min_tokens is only capped by a max_tokens
    setattr(params, field, value)


@st.composite
def cases(draw, llm: LLM, bad: bool, shared: list[int]) -> Case:
    vocab, max_len = llm.engine.vocab_size, llm.config.max_model_len
    kind = draw(st.sampled_from(["empty", "oov", "too long", "bad params", "bad type"])) if bad else "ok"
    form = draw(st.sampled_from(["text", "ids", "text dict", "ids dict", "numpy ids"]))
    if kind == "bad type":
        prompt = draw(st.sampled_from([
            [1.5, 2], [True, 3], None, b"abc", {"prompt": 5}, {"text": "hi"}, {"prompt_token_ids": "abc"},
            [[1, 2], [3]], {"prompt": "hi", "multi_modal_data": {"image": 1}}, {"prompt": "hi", "cache_salt": "s"},
        ]))
        return Case(prompt, None, valid_params(draw, llm), prompt_ok=False, params_ok=True)
    if kind == "empty":
        text, ids = "", []
    elif kind == "oov":
        ids = draw(st.lists(st.integers(0, vocab - 1), max_size=5)) + [draw(st.sampled_from([vocab, vocab + 7, -1]))]
        form, text = draw(st.sampled_from(["ids", "ids dict"])), None
    elif kind == "too long":
        ids = draw(st.lists(st.integers(0, vocab - 1), min_size=max_len + 1, max_size=max_len + 8))
        form, text = draw(st.sampled_from(["ids", "ids dict"])), None
    elif form.startswith("text"):
        text = draw(TEXT)
        ids = llm.get_tokenizer().encode(text)
        if len(ids) > max_len:  # over-long after tokenizing: use ids instead
            form, text, ids = "ids", None, ids[:max_len]
    else:
        text, ids = None, draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=min(max_len, 40)))
        if shared and draw(st.booleans()):  # a shared prefix (or the same prompt): prefix-cache hits
            ids = (shared[: draw(st.integers(1, len(shared)))] + ids[: draw(st.integers(0, 8))])[:max_len]
    if form.startswith("text"):
        prompt = text if form == "text" else TextPrompt(prompt=text)
    elif form == "numpy ids":  # any Integral is a token id
        prompt = [np.int64(t) for t in ids]
    else:
        prompt = ids if form == "ids" else TokensPrompt(prompt_token_ids=ids)
    params = valid_params(draw, llm)
    if kind == "bad params":
        spoil(draw, params, llm)
    return Case(prompt, ids, params, prompt_ok=kind in ("ok", "bad params"), params_ok=kind != "bad params")


@st.composite
def mixes(draw, llm: LLM) -> list[Case]:
    num_bad = draw(st.sampled_from([0, 0, 0, 1, 2]))
    shared = draw(st.lists(st.integers(0, llm.engine.vocab_size - 1), max_size=min(llm.config.max_model_len, 40)))
    good = draw(st.lists(cases(llm, False, shared), min_size=1 if not num_bad else 0, max_size=6))
    bad = [draw(cases(llm, True, shared)) for _ in range(num_bad)]
    return draw(st.permutations(good + bad))


# ---- properties ------------------------------------------------------------------------------


def check_refused(llm: LLM, call) -> None:
    backend = llm.engine.model_runner.backend
    calls, queried = backend.calls, llm.engine.block_manager.num_queried_tokens
    with pytest.raises((ValueError, TypeError)):
        call()
    assert backend.calls == calls, "a forward pass ran before the bad request was refused"
    assert llm.engine.is_finished() and not llm.engine.requests
    assert llm.engine.block_manager.num_queried_tokens == queried
    assert_no_leak(llm)


def check_completion(llm: LLM, case: Case, prompt_len: int, c) -> None:
    p, eos = case.params, llm.engine.eos_token_ids
    out = c.token_ids
    assert out, "every sample has at least one token"
    limit = max(llm.config.max_model_len, prompt_len + 1)
    assert prompt_len + len(out) <= limit
    if p.max_tokens is not None:
        assert len(out) <= p.max_tokens
    # EOS and stop ids are masked until min_tokens exist, and end the sample from then on.
    for j, t in enumerate(out[:-1]):
        assert t not in p.stop_token_ids, f"stop id {t} at {j} did not stop the sample"
        assert p.ignore_eos or t not in eos, f"EOS {t} at {j} did not stop the sample"
    for t in out[: p.min_tokens]:
        assert t not in p.stop_token_ids and (p.ignore_eos or t not in eos), "a stop token came before min_tokens"
    if c.finish_reason == "length":
        assert c.stop_reason is None
        assert len(out) == p.max_tokens or prompt_len + len(out) == limit
    else:
        assert c.finish_reason == "stop", c.finish_reason
        assert len(out) > p.min_tokens
        if c.stop_reason is None:
            assert out[-1] == llm.tokenizer.eos_token_id and not p.ignore_eos
        elif isinstance(c.stop_reason, int):  # a stop id, or (as vLLM) an EOS id other than the tokenizer's
            assert c.stop_reason == out[-1] and (c.stop_reason in p.stop_token_ids or c.stop_reason in eos)
        else:
            assert c.stop_reason in p.stop and p.detokenize
            assert c.text.endswith(c.stop_reason) or not p.include_stop_str_in_output
    if not p.detokenize:
        assert c.text == ""
    elif p.min_tokens == 0:  # text of the first min_tokens tokens may hold a stop string
        body = c.text[: -len(c.stop_reason)] if isinstance(c.stop_reason, str) and p.include_stop_str_in_output \
            else c.text
        assert not any(s in body for s in p.stop), f"stop string left in {c.text!r}"
    if p.logprobs is None:
        assert c.logprobs is None and c.cumulative_logprob is None
    else:
        assert len(c.logprobs) == len(out)
        for token, entry in zip(out, c.logprobs):
            assert token in entry and len(entry) <= p.logprobs + 1
            assert all(lp.logprob <= 1e-5 and math.isfinite(lp.logprob) for lp in entry.values())
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out, c.logprobs)), abs=1e-3)


def check_outputs(llm: LLM, mix: list[Case], outputs) -> None:
    assert len(outputs) == len(mix)
    for case, out in zip(mix, outputs):
        assert out.finished
        assert out.prompt_token_ids == case.ids
        assert 0 <= out.num_cached_tokens < len(case.ids)
        assert [c.index for c in out.outputs] == list(range(case.params.n))
        for c in out.outputs:
            check_completion(llm, case, len(case.ids), c)


def run_mix(llm: LLM, mix: list[Case], one_params: bool) -> list | None:
    prompts = [case.prompt for case in mix]
    params = mix[0].params if one_params else [case.params for case in mix]
    if one_params:
        mix = [Case(c.prompt, c.ids, mix[0].params, c.prompt_ok, mix[0].params_ok) for c in mix]
    call = lambda: llm.generate(prompts, params, use_tqdm=False)
    if not all(case.prompt_ok and case.params_ok for case in mix):
        check_refused(llm, call)
        event("refused")
        return None
    preemptions = llm.engine.scheduler.num_preemptions
    outputs = call()
    check_outputs(llm, mix, outputs)
    event("ran" + (", preempted" if llm.engine.scheduler.num_preemptions > preemptions else ""))
    for out in outputs:
        for c in out.outputs:
            event(f"finish: {c.finish_reason} {type(c.stop_reason).__name__}")
    assert_no_leak(llm)
    return outputs


def deterministic(mix: list[Case], outputs) -> list[tuple[Case, object]]:
    """Requests whose samples do not depend on the batch: seeded or greedy ones."""
    return [(case, out) for case, out in zip(mix, outputs) if case.params.seed is not None or case.params.greedy]


def check_same_samples(first, second, cap: int | None) -> None:
    """The same samples; `cap`: the first run's max_model_len, where its samples may have been cut
    while the second (a longer context) went on."""
    for a, b in zip(first.outputs, second.outputs):
        cut = cap is not None and a.finish_reason == "length" and len(first.prompt_token_ids) + len(a.token_ids) >= cap
        if cut:
            assert b.token_ids[: len(a.token_ids)] == a.token_ids
        else:
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                            a.stop_reason)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """A roomy engine (no preemption, one block size, longest context the fuzzed configs use)."""
    return make_llm(tiny_model, kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=MAX_MODEL_LEN,
                    max_num_seqs=8)


@FUZZ
@given(data=st.data())
def test_random_configs_and_request_mixes(tiny_model, reference, data):
    llm = make_llm(tiny_model, **data.draw(configs(), label="config"))
    for _ in range(2):
        mix = data.draw(mixes(llm), label="mix")
        one_params = len(mix) > 1 and data.draw(st.booleans(), label="one SamplingParams for all")
        outputs = run_mix(llm, mix, one_params)
        if outputs is None or one_params:
            continue
        # Seeded and greedy requests give the same samples again: in this engine in another batch
        # (now with prefix-cache hits), and in an engine with another block size and no preemption.
        again = deterministic(mix, outputs)
        if again:
            prompts, params = [case.prompt for case, _ in again], [case.params for case, _ in again]
            for engine, cap in ((llm, None), (reference, llm.config.max_model_len)):
                for (_, first), second in zip(again, engine.generate(prompts, params, use_tqdm=False)):
                    check_same_samples(first, second, cap)
            assert_no_leak(llm)
            assert_no_leak(reference)
    llm.close()
