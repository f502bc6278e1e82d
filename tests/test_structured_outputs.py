"""Structured outputs (nanoserve/structured): JSON schema, regex, choice and grammar constraints.

A random-weight model is the worst case for a matcher (it tries everything the mask allows), so
every sample that finishes with "stop" must parse and validate, and most must finish.
"""
import gc
import json
import re

import jsonschema
import pytest

pytest.importorskip("llguidance")

from helpers import assert_no_leak, make_llm  # noqa: E402
from structured_schemas import SCHEMAS  # noqa: E402

from nanoserve import GuidedDecodingParams, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanoserve.sampling import Sampler, SamplingMetadata, SamplingRow, SamplingSpec  # noqa: E402
from nanoserve.structured.bitmask import unpack_forbidden  # noqa: E402
from nanoserve.structured.matcher import SequenceMatcher  # noqa: E402

PROMPTS = ["Give me JSON:", "The answer is", "Once upon a time", "x"]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def llm(tiny_model):
    with make_llm(tiny_model) as engine:
        yield engine


@pytest.fixture(scope="module")
def llm_no_jf(tiny_model):
    with make_llm(tiny_model, structured_outputs_jump_forward=False) as engine:
        yield engine


def constrained(temperature=0.0, seed=None, max_tokens=MAX_TOKENS, **constraint):
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def live_matchers() -> int:
    gc.collect()
    return sum(type(o) is SequenceMatcher for o in gc.get_objects())


# ---- JSON schemas: every finished sample validates --------------------------------------------


@pytest.mark.parametrize("jump_forward", [True, False])
def test_json_schemas_validate(llm, llm_no_jf, jump_forward):
    engine = llm if jump_forward else llm_no_jf
    before = engine.engine.structured.stats.num_forced_tokens
    prompts, params, expected = [], [], []
    for i, schema in enumerate(SCHEMAS):
        # Every third schema allows whitespace between tokens (a short run, or a random model
        # spends its tokens on it).
        spacing = {"whitespace_pattern": r"[ \n]{0,2}"} if i % 3 == 2 else {"disable_any_whitespace": True}
        for temperature in (0.0, 1.0):
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(constrained(temperature, seed=i, json=schema, **spacing))
            expected.append(schema)
    outs = engine.generate(prompts, params, use_tqdm=False)
    finished = 0
    for out, schema in zip(outs, expected):
        sample = out.outputs[0]
        assert sample.finish_reason in ("stop", "length")
        assert len(sample.token_ids) <= MAX_TOKENS
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), schema)
            finished += 1
    assert finished >= 0.75 * len(outs), f"only {finished} of {len(outs)} samples finished"
    forced = engine.engine.structured.stats.num_forced_tokens - before
    assert (forced > 0) == jump_forward
    assert live_matchers() == 0
    assert_no_leak(engine)


def test_default_whitespace_is_bounded(llm):
    """vLLM's default allows any whitespace between JSON tokens, and a model can spin on it until
    max_tokens (vLLM #30730); nanoserve's default allows runs of at most MAX_JSON_WHITESPACE."""
    from nanoserve.structured.grammar import MAX_JSON_WHITESPACE

    params = [constrained(1.0, seed=s, json=SCHEMAS[26], max_tokens=200) for s in range(4)]
    for out in llm.generate(["ws"] * len(params), params, use_tqdm=False):
        sample = out.outputs[0]
        assert max(map(len, re.findall(r"\s+", sample.text)), default=0) <= MAX_JSON_WHITESPACE
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), SCHEMAS[26])


def test_jump_forward_takes_fewer_steps(llm, llm_no_jf):
    """The same greedy request: with forced tokens riding along, fewer engine steps."""
    params = constrained(json=SCHEMAS[15], disable_any_whitespace=True)
    steps = []
    for engine in (llm, llm_no_jf):
        engine.engine.add_request(engine.tokenizer.encode("hi"), params)
        n = 0
        while not engine.engine.is_finished():
            finished = engine.engine.step().finished
            n += 1
        steps.append(n)
        sample = finished[0].outputs[0]
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), SCHEMAS[15])
    assert steps[0] < steps[1], steps


def test_json_object_and_pydantic_model(llm):
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        label: str = pydantic.Field(max_length=4)

    outs = llm.generate(["a", "b"], [constrained(json_object=True, disable_any_whitespace=True),
                                     constrained(json=Point, disable_any_whitespace=True)], use_tqdm=False)
    obj, point = (o.outputs[0] for o in outs)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    if point.finish_reason == "stop":
        Point.model_validate_json(point.text)
    assert "stop" in (obj.finish_reason, point.finish_reason)


# ---- regex, choice, grammar ---------------------------------------------------------------------

REGEXES = [r"[a-z]{3,6}@(foo|bar)\.com", r"(\+|-)?[0-9]{1,4}", r"(cat|dog|bird)( and (cat|dog|bird)){0,2}",
           r"[A-F0-9]{4}-[A-F0-9]{4}", r"yes|no"]
ARITH_LARK = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
ARITH_RE = r"[0-9()+\-]+"
GBNF = 'root ::= "ab" [0-9] [0-9]? | "cd"'


@pytest.mark.parametrize("jump_forward", [True, False])
def test_regex_choice_grammar_match_fully(llm, llm_no_jf, jump_forward):
    engine = llm if jump_forward else llm_no_jf
    choices = ["yes", "no", "maybe not", "n/a"]
    cases = [(dict(regex=r), lambda t, r=r: re.fullmatch(r, t)) for r in REGEXES]
    cases += [(dict(choice=choices), lambda t: t in choices),
              (dict(grammar=ARITH_LARK), lambda t: re.fullmatch(ARITH_RE, t) and _balanced(t)),
              (dict(grammar=GBNF), lambda t: re.fullmatch(r"ab[0-9][0-9]?|cd", t))]
    params = [constrained(temperature, seed=i, **c) for i, (c, _) in enumerate(cases) for temperature in (0.0, 1.0)]
    outs = engine.generate(["Say something"] * len(params), params, use_tqdm=False)
    checks = [check for _, check in cases for _ in (0.0, 1.0)]
    finished = 0
    for out, check in zip(outs, checks):
        sample = out.outputs[0]
        if sample.finish_reason == "stop":
            assert check(sample.text), sample.text
            finished += 1
    assert finished >= 0.75 * len(outs)


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


# ---- bad constraints: ValueError naming the field, before any work --------------------------------


@pytest.mark.parametrize("constraint, fragment", [
    ({"json": {"type": "foo"}}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "structured_outputs.json"),
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"grammar": "start: (unclosed"}, "structured_outputs.grammar"),
])
def test_constraints_that_do_not_compile_fail_before_work(llm, constraint, fragment):
    stats = llm.engine.structured.stats
    masks = stats.num_masks
    good = constrained(choice=["a"])
    with pytest.raises(ValueError, match=re.escape(fragment)):
        llm.generate(["ok", "bad"], [good, constrained(**constraint)], use_tqdm=False)
    assert stats.num_masks == masks and not llm.engine.requests and llm.engine.is_finished()


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"structured_outputs": {"choice": []}}, ValueError, "structured_outputs.choice"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, ValueError, "exactly one"),
    ({"structured_outputs": {}}, ValueError, "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, ValueError, "structural_tag"),
    ({"structured_outputs": {"regex": 3}}, TypeError, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, ValueError, "structured_outputs.json"),
    ({"structured_outputs": {"choice": ["a"], "colour": 1}}, ValueError, "unknown keys"),
    ({"structured_outputs": 5}, TypeError, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}, ValueError, "both"),
    ({"guided_decoding": {"choice": ["a"], "json_object": True}}, ValueError, "guided_decoding"),
    ({"structured_outputs": {"json": False}}, ValueError, "structured_outputs.json is the schema false"),
    ({"structured_outputs": {"json": "false"}}, ValueError, "structured_outputs.json is the schema false"),
])
def test_bad_params_are_refused_at_construction(kwargs, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        SamplingParams(**kwargs)


def test_keys_come_in_the_schema_order(llm, llm_no_jf):
    """Properties are generated in the order the schema lists them (as vLLM's backends do): a
    "reasoning" key before an "answer" key is part of a schema's meaning. The compile-cache key
    once sorted the schema's keys, which generated them alphabetically."""
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "mid": {"enum": ["x", "y"]},
                                               "alpha": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["zeta", "mid", "alpha"], "additionalProperties": False}
    for engine in (llm, llm_no_jf):
        params = [constrained(1.0, seed=s, json=schema, disable_any_whitespace=True) for s in range(3)]
        params.append(constrained(json=json.dumps(schema), disable_any_whitespace=True))
        for out in engine.generate(["order"] * len(params), params, use_tqdm=False):
            assert out.outputs[0].finish_reason == "stop"
            assert list(json.loads(out.outputs[0].text)) == ["zeta", "mid", "alpha"]


def test_schema_true_accepts_any_json_value(llm):
    """The JSON schema `true` (as a bool or a JSON string) is any JSON value, like `{}`."""
    params = [constrained(1.0, seed=s, json=schema, disable_any_whitespace=True, max_tokens=24)
              for s in range(3) for schema in (True, "true")]
    outs = llm.generate(["any"] * len(params), params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs[::2]] == [o.outputs[0].text for o in outs[1::2]]
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            json.loads(out.outputs[0].text)


def test_field_set_after_construction_is_checked(llm):
    params = SamplingParams(max_tokens=4)
    params.structured_outputs = {"choice": []}
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        llm.generate(["x"], params, use_tqdm=False)


# ---- vLLM's three spellings behave the same ------------------------------------------------------


def test_guided_decoding_dict_and_guided_options_request_match(llm):
    regex = r"[a-c]{2,5}"
    common = dict(temperature=1.0, seed=7, max_tokens=20)
    a = llm.generate(["p"], SamplingParams(**common, structured_outputs=StructuredOutputsParams(regex=regex)),
                     use_tqdm=False)
    b = llm.generate(["p"], SamplingParams(**common, guided_decoding=GuidedDecodingParams(regex=regex,
                                                                                           backend="xgrammar")),
                     use_tqdm=False)
    c = llm.generate(["p"], SamplingParams(**common, structured_outputs={"regex": regex}), use_tqdm=False)
    shared = SamplingParams(**common)
    d = llm.generate(["p"], shared, use_tqdm=False, guided_options_request={"guided_regex": regex})
    assert shared.guided_decoding is None  # the caller's params are left alone
    texts = {o[0].outputs[0].text for o in (a, b, c, d)}
    assert len(texts) == 1 and re.fullmatch(regex, texts.pop())
    with pytest.raises(ValueError, match="one of"):
        llm.generate(["p"], shared, use_tqdm=False,
                     guided_options_request={"guided_regex": regex, "guided_choice": ["a"]})
    assert GuidedDecodingParams.from_optional() is None


def test_vllm_example_runs_with_only_the_import_changed(llm):
    """vLLM's offline structured-outputs example (docs), with `vllm` replaced by `nanoserve`."""
    from enum import Enum

    from pydantic import BaseModel

    from nanoserve.engine_args import resolve_engine_args
    from nanoserve.sampling_params import GuidedDecodingParams as G
    from nanoserve.sampling_params import StructuredOutputsParams as S

    class CarType(str, Enum):
        sedan = "sedan"
        suv = "SUV"

    class CarDescription(BaseModel):
        brand: str
        model: str
        car_type: CarType

    simplified_sql_grammar = """
        root ::= select_statement
        select_statement ::= "SELECT " column " from " table " where " condition
        column ::= "col_1 " | "col_2 "
        table ::= "table_1 " | "table_2 "
        condition ::= column "= " number
        number ::= "1 " | "2 "
    """
    params = [
        SamplingParams(structured_outputs=S(choice=["Positive", "Negative"])),
        SamplingParams(structured_outputs=S(regex=r"\w+@\w+\.com\n"), stop=["\n"]),
        SamplingParams(structured_outputs=S(json=CarDescription.model_json_schema()), max_tokens=200),
        SamplingParams(structured_outputs=S(grammar=simplified_sql_grammar), max_tokens=50),
        SamplingParams(guided_decoding=G(choice=["Positive", "Negative"])),
    ]
    outs = llm.generate(["Classify this sentiment: vLLM is wonderful!"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("Positive", "Negative") and texts[4] in ("Positive", "Negative")
    if outs[1].outputs[0].finish_reason == "stop":
        assert re.fullmatch(r"\w+@\w+\.com", texts[1])  # the stop string "\n" is cut
    if outs[2].outputs[0].finish_reason == "stop":
        CarDescription.model_validate_json(texts[2])
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", texts[3])
    # LLM(..., guided_decoding_backend=...) / structured_outputs_config: accepted, no effect.
    assert resolve_engine_args({"guided_decoding_backend": "xgrammar",
                                "structured_outputs_config": {"backend": "guidance"}})[0] == {}


# ---- every sampling option ----------------------------------------------------------------------


def test_n_and_seeds(llm):
    params = constrained(1.0, seed=3, json=SCHEMAS[4], disable_any_whitespace=True)
    params.n = 4
    first = llm.generate(["seeded"], params, use_tqdm=False)[0].outputs
    again = llm.generate(["seeded"], params, use_tqdm=False)[0].outputs
    assert [s.text for s in first] == [s.text for s in again]
    assert len({s.text for s in first}) > 1  # sample i uses seed + i
    for sample in first:
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), SCHEMAS[4])


def test_logprobs_cover_every_token(llm):
    """Forced tokens have no logprobs, so a request asking for them samples every token."""
    params = constrained(json=SCHEMAS[15], disable_any_whitespace=True)
    params.logprobs = 2
    sample = llm.generate(["lp"], params, use_tqdm=False)[0].outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids)
    for token, entry in zip(sample.token_ids, sample.logprobs):
        assert token in entry
    plain = llm.generate(["lp"], constrained(json=SCHEMAS[15], disable_any_whitespace=True), use_tqdm=False)
    assert json.loads(sample.text) == json.loads(plain[0].outputs[0].text)  # same text, maybe other tokens


def test_logprobs_are_over_the_tokens_the_grammar_allows(llm, tiny_model, hf):
    """vLLM masks the logits with the grammar before its sampler computes logprobs, so a
    constrained row's logprobs are the model's distribution renormalised over the allowed tokens:
    equal to HF's log_softmax less the logsumexp of the allowed tokens, step by step."""
    import torch

    from nanoserve.structured.bitmask import fill_bitmask

    manager, vocab = llm.engine.structured, llm.engine.vocab_size
    prompt = llm.tokenizer.encode("Pick one:")
    for temperature, seed in ((0.0, None), (1.0, 3)):
        params = constrained(temperature, seed=seed, max_tokens=8, regex=r"(yes|no|maybe)[0-9]{1,3}")
        params.logprobs = 3
        sample = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        raw = hf.logprobs(tiny_model, prompt, sample.token_ids)  # [T, V], no mask
        replay = manager.new_matcher(params)  # walks the same grammar to know each step's mask
        for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            allowed = torch.from_numpy(unpack_forbidden(fill_bitmask([replay], vocab), vocab)[0] == 0)
            want = raw[step].masked_fill(~allowed, float("-inf")).log_softmax(-1)
            assert entry[token].logprob == pytest.approx(want[token].item(), abs=1e-4)
            for t, lp in entry.items():
                if lp.rank <= 3:  # the top 3 of the masked distribution, forbidden ones at -inf
                    assert lp.logprob == pytest.approx(want.topk(3).values[lp.rank - 1].item(), abs=1e-4)
                    assert allowed[t] or lp.logprob == float("-inf")
            replay.accept(token)


def test_text_that_spells_a_special_token_ends_only_its_own_sample(llm, llm_no_jf):
    """llguidance tokenizes forced text as the tokenizer does, so a constraint whose text spells a
    special token ("<|im_end|>") gets that special token in its mask and jump-forward, and its
    parser then refuses it (outlines #1771). That sample ends; the batch and the engine go on."""
    special = ["<|im_end|>", "<|endoftext|>"]
    for engine in (llm, llm_no_jf):
        refused = engine.engine.structured.stats.num_refused_tokens
        params = [constrained(regex=r"a<\|im_end\|>b"), constrained(json={"const": "<|endoftext|>"}),
                  constrained(choice=["yes", "no"]), SamplingParams(temperature=0, max_tokens=5)]
        outs = [o.outputs[0] for o in engine.generate(["s"] * len(params), params, use_tqdm=False)]
        assert [o.text for o in outs[:2]] == ["a", '"']  # the text up to the special token
        assert all(o.finish_reason == "stop" for o in outs[:3]) and outs[2].text in ("yes", "no")
        assert len(outs[3].token_ids) == 5
        assert not any(t in special for t in engine.tokenizer.convert_ids_to_tokens(outs[0].token_ids[:-1]))
        assert engine.engine.structured.stats.num_refused_tokens == refused + 2
        assert live_matchers() == 0
        assert_no_leak(engine)


def test_a_grammar_failing_on_its_forced_tokens_ends_only_its_own_sample(llm):
    """A schema whose required property recurses forever ({"r": {"r": ...}}) compiles, but its
    forced text never ends and llguidance stops in error while consuming it (its item limit):
    that sample ends, the other requests and the engine go on."""
    node = {"type": "object", "properties": {"r": {"$ref": "#/$defs/d"}}, "required": ["r"],
            "additionalProperties": False}
    endless = {"$defs": {"d": node}, **node}
    refused = llm.engine.structured.stats.num_refused_tokens
    params = [constrained(json=endless, disable_any_whitespace=True, max_tokens=100),
              constrained(choice=["yes", "no"]), SamplingParams(temperature=0, max_tokens=5)]
    outs = [o.outputs[0] for o in llm.generate(["r"] * len(params), params, use_tqdm=False)]
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) < 100
    assert outs[1].text in ("yes", "no") and len(outs[2].token_ids) == 5
    assert llm.engine.structured.stats.num_refused_tokens > refused
    assert live_matchers() == 0
    assert_no_leak(llm)


def test_stop_strings_and_max_tokens(llm):
    choices = ["alpha beta", "gamma delta"]
    params = constrained(choice=choices)
    params.stop = [" "]
    sample = llm.generate(["s"], params, use_tqdm=False)[0].outputs[0]
    assert sample.finish_reason == "stop" and sample.stop_reason == " "
    assert sample.text in ("alpha", "gamma")
    for jf_tokens in (3, 5):
        short = constrained(json=SCHEMAS[15], disable_any_whitespace=True, max_tokens=jf_tokens)
        sample = llm.generate(["m"], short, use_tqdm=False)[0].outputs[0]
        assert sample.finish_reason == "length" and len(sample.token_ids) == jf_tokens


def test_eos_only_where_the_grammar_accepts(llm):
    """A regex that can stop after 1 digit or go on: greedy outputs end with EOS or the grammar's
    end, and the text always matches fully."""
    params = [constrained(t, seed=s, regex=r"[0-9]{1,8}") for t in (0.0, 1.0) for s in range(6)]
    eos = set(llm.engine.eos_token_ids)
    for out in llm.generate(["n"] * len(params), params, use_tqdm=False):
        sample = out.outputs[0]
        assert sample.finish_reason == "stop"
        assert re.fullmatch(r"[0-9]{1,8}", sample.text)
        assert all(t not in eos for t in sample.token_ids[:-1])


def test_grammar_wins_over_min_tokens_suppression(llm, llm_no_jf):
    """A stop id the grammar requires, suppressed by min_tokens: the grammar's only token is still
    sampled (never an arbitrary token the matcher would refuse), and the grammar ends the sample."""
    tok = llm.get_tokenizer()
    word = next(w for w in ("yes", "no", "ab", "a") if len(tok.encode(w, add_special_tokens=False)) == 1)
    (word_id,) = tok.encode(word, add_special_tokens=False)
    for engine in (llm, llm_no_jf):
        for temperature in (0.0, 1.0):
            params = constrained(temperature, seed=1, choice=[word])
            params.min_tokens, params.stop_token_ids = 5, [word_id]
            sample = engine.generate(["w"], params, use_tqdm=False)[0].outputs[0]
            assert sample.text == word and sample.finish_reason == "stop"
        assert_no_leak(engine)


def test_prefix_caching_chunked_prefill_and_preemption_agree(tiny_model, llm):
    """Greedy constrained outputs stay the same under prefix-cache hits, small prefill chunks and
    preemption (a recomputed sequence must not feed its tokens to the matcher again)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    params = [constrained(json=s, disable_any_whitespace=True) for s in SCHEMAS[10:18]]
    ref = [o.outputs[0].text for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
    again = llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert [o.outputs[0].text for o in again] == ref
    assert again[0].num_cached_tokens > 0
    with make_llm(tiny_model, max_num_batched_tokens=16, enable_prefix_caching=False) as chunked:
        assert [o.outputs[0].text for o in chunked.generate([prompt] * len(params), params, use_tqdm=False)] == ref
    # Preemption: 8 sampled sequences growing from a one-block prompt into 12 blocks.
    params = [constrained(1.0, seed=i, json=SCHEMAS[15 + i % 5], disable_any_whitespace=True) for i in range(8)]
    ref = [o.outputs[0].text for o in llm.generate(["preempt"] * 8, params, use_tqdm=False)]
    with make_llm(tiny_model, num_kvcache_blocks=12, max_model_len=96, enable_prefix_caching=False) as tight:
        outs = tight.generate(["preempt"] * 8, params, use_tqdm=False)
        assert tight.engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].text for o in outs] == ref
        assert_no_leak(tight)


def test_chat_with_thinking_off(llm):
    messages = [{"role": "user", "content": "Reply in JSON"}]
    params = constrained(json=SCHEMAS[5], disable_any_whitespace=True)
    out = llm.chat([messages, messages], params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    for o in out:
        assert o.prompt.endswith("</think>\n\n")
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[5])


def test_aborted_requests_free_their_matchers(llm):
    params = constrained(1.0, seed=1, json=SCHEMAS[13], disable_any_whitespace=True)
    stream = llm.generate_stream(["a", "b", "c", "d"], params, max_inflight=4, use_tqdm=False)
    next(stream)
    stream.close()
    assert live_matchers() == 0
    assert_no_leak(llm)


# ---- the sampler's mask ----------------------------------------------------------------------


def test_unpack_forbidden_matches_bit_by_bit():
    import numpy as np

    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 1000):
        words = (vocab + 31) // 32
        bitmask = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
        want = [[not (int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)]
        assert unpack_forbidden(bitmask, vocab).astype(bool).tolist() == want


def test_threaded_and_serial_masks_agree(llm):
    from nanoserve.structured.bitmask import fill_bitmask

    manager = llm.engine.structured
    matchers = [manager.new_matcher(constrained(json=s, disable_any_whitespace=True)) for s in SCHEMAS[:6]]
    for m in matchers[::2]:
        m.forced_tokens(3)
    vocab = llm.engine.vocab_size
    serial, threaded = fill_bitmask(matchers, vocab, parallel=False), fill_bitmask(matchers, vocab, parallel=True)
    assert (serial == threaded).all() and (serial != -1).any()


def test_sampler_masks_constrained_rows_before_penalties(llm):
    """Two constrained rows (greedy with a repetition penalty, sampled with top_k) and a free
    one in one batch: the constrained rows draw only what their grammar allows, the free row
    is untouched."""
    import torch

    tok, vocab = llm.tokenizer, llm.engine.vocab_size
    manager = llm.engine.structured
    ab = [tok.convert_tokens_to_ids(t) for t in ("a", "b")]
    xyz = [tok.convert_tokens_to_ids(t) for t in ("x", "y", "z")]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, 5] = 100.0  # everyone's favourite, allowed by neither grammar
    logits[0, ab[0]], logits[0, ab[1]] = 3.0, 2.0
    # The penalty divides a's positive logit by 4: b wins, so the mask ran before the penalty
    # (masking after would leave a's -inf or b) and the penalty still applies.
    greedy = SamplingSpec.from_params(SamplingParams(temperature=0, repetition_penalty=4.0), vocab, [])
    hot = SamplingSpec.from_params(SamplingParams(temperature=1.0, top_k=3), vocab, [])
    for seed in range(5):
        rows = [
            SamplingRow(greedy, 0, [1, ab[0]], 1, manager.new_matcher(constrained(regex="(a|b)"))),
            SamplingRow(hot, seed, [1, 2], 1, manager.new_matcher(constrained(regex="(x|y|z)"))),
            SamplingRow(greedy, 2, [1, 2], 1),
        ]
        out = Sampler()(logits, SamplingMetadata.build(rows, vocab, torch.device("cpu"))).token_ids.tolist()
        assert out[0] == ab[1]
        assert out[1] in xyz
        assert out[2] == 5


# ---- run-batch and Ray rows -----------------------------------------------------------------------


def test_run_batch_fields(tiny_model, tmp_path):
    from nanoserve.entrypoints.run_batch import run_batch

    schema = SCHEMAS[4]
    bodies = {
        "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
        "object": {"response_format": {"type": "json_object"}},
        "so": {"structured_outputs": {"choice": ["red", "blue"]}},
        "gj": {"guided_json": schema, "guided_decoding_backend": "xgrammar"},
        "gr": {"guided_regex": "[0-9]{3}"},
        "gc": {"guided_choice": ["up", "down"]},
        "gg": {"guided_grammar": GBNF},
        "text": {"response_format": {"type": "text"}},
        "bad-regex": {"guided_regex": "a(b"},
        "two": {"guided_regex": "a", "guided_choice": ["b"]},
        "bad-format": {"response_format": {"type": "yaml"}},
        "tag": {"structural_tag": "{}"},
    }
    lines = []
    for cid, extra in bodies.items():
        body = {"messages": [{"role": "user", "content": cid}], "temperature": 0, "max_tokens": 80, **extra}
        lines.append({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    engine = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "kvcache_block_size": 8,
              "num_kvcache_blocks": 256}
    assert run_batch(str(src), str(dst), tiny_model, engine, progress=False) == 1  # some lines failed
    records = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert set(records) == set(bodies)
    for cid in ("bad-regex", "two", "bad-format", "tag"):
        assert records[cid]["response"]["status_code"] == 400, cid
    assert "guided_regex" in records["bad-regex"]["error"]["message"]
    text = {cid: r["response"]["body"]["choices"][0]["message"]["content"]
            for cid, r in records.items() if r["error"] is None}
    finish = {cid: r["response"]["body"]["choices"][0]["finish_reason"]
              for cid, r in records.items() if r["error"] is None}
    for cid in ("schema", "gj"):
        if finish[cid] == "stop":
            jsonschema.validate(json.loads(text[cid]), schema)
    assert text["so"] in ("red", "blue") and text["gc"] in ("up", "down")
    assert re.fullmatch("[0-9]{3}", text["gr"]) and re.fullmatch(r"ab[0-9][0-9]?|cd", text["gg"])


def test_ray_rows_carry_their_own_constraint(tiny_model):
    from nanoserve.ray import LLMPredictor

    engine = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "kvcache_block_size": 8,
              "num_kvcache_blocks": 128}
    predictor = LLMPredictor(tiny_model, {"temperature": 0, "max_tokens": 40}, engine)
    # As Arrow hands them over: every row has every key of the struct, absent ones null.
    null = {"choice": None, "regex": None, "json": None, "disable_any_whitespace": None}
    rows = [
        {"choice": ["left", "right"]},
        {"regex": "[xy]{4}"},
        {"json": json.dumps(SCHEMAS[5]), "disable_any_whitespace": True},
    ]
    batch = {"prompt": ["a", "b", "c", "d"],
             "sampling_params": [{"structured_outputs": {**null, **r}} for r in rows] + [{"structured_outputs": None}]}
    out = predictor(batch)
    texts = out["generated_text"]
    assert texts[0] in ("left", "right")
    assert re.fullmatch("[xy]{4}", texts[1])
    jsonschema.validate(json.loads(texts[2]), SCHEMAS[5])
    assert out["finish_reason"][:3] == ["stop"] * 3
    predictor.llm.close()


# ---- the benchmark workload -----------------------------------------------------------------------


def test_bench_json_workload_reports_consistent_figures(tiny_model):
    from nanoserve.bench.cli import main

    report = main(["--model", tiny_model, "--workload", "json", "--num-seqs", "2", "--input-len", "5", "9",
                   "--output-len", "24", "24", "--dtype", "float32", "--no-roofline", "--no-warmup"])
    phases = report["json"]
    assert set(phases) == {"concurrency_2"}
    for phase in phases.values():
        on, off = phase["jump_forward_on"], phase["jump_forward_off"]
        assert on["forced_fraction"] > 0 and off["forced_fraction"] == 0
        assert on["num_steps"] < off["num_steps"]  # forced tokens ride along with sampled ones
        for run in (on, off):
            assert 0 < run["output_tokens"] <= 24 * 2 and run["mask_us_per_token"] > 0
            twin = run["unconstrained_twin"]
            assert run["speed_vs_unconstrained"] == pytest.approx(run["output_tok_s"] / twin["output_tok_s"])



@pytest.mark.parametrize("found", ["1.6.1", "1.7.6"])
def test_an_llguidance_too_old_for_the_whitespace_bound_is_refused(monkeypatch, found):
    """llguidance 1.7.6 and before let JSON whitespace runs grow past the pattern's bound (a GPU
    image had 1.6.1): loading it is refused, naming the version to install."""
    import importlib.metadata

    from nanoserve.structured import grammar

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: found if name == "llguidance" else real(name))
    with pytest.raises(ImportError, match=rf"llguidance >= 1\.8, found {re.escape(found)}"):
        grammar.import_llguidance()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.8.0" if name == "llguidance" else real(name))
    assert grammar.import_llguidance().LLMatcher
