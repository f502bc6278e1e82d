"""Scripts written for vLLM run with only the import changed (issue 16).

The first tests are vLLM's offline examples (basic.py, generate.py, chat.py) in miniature,
written as they are written against vLLM; then each group of engine arguments, the generate()
keywords vLLM takes, and the SamplingParams / output niceties those scripts rely on.
"""
import logging
import os
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from nanoserve import LLM, RequestOutput, SamplingParams, TextPrompt, TokensPrompt
from nanoserve.config import canonical_dtype
from nanoserve.engine_args import NO_EFFECT, REFUSED, resolve_engine_args
from nanoserve.outputs import CompletionOutput
from nanoserve.utils.tiny_checkpoint import build_tiny_qwen3

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]


@pytest.fixture(scope="module")
def llm(tiny_model):
    # vLLM's names only: block_size, not kvcache_block_size.
    return LLM(model=tiny_model, dtype="float32", max_model_len=256, block_size=8, max_num_seqs=16, seed=0)


def greedy(max_tokens=6):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


# ---- vLLM's offline examples -------------------------------------------------------------------


def test_basic_example(llm):
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert [o.prompt for o in outputs] == PROMPTS
    tok = llm.get_tokenizer()
    for output in outputs:
        generated = output.outputs[0]
        assert output.prompt_token_ids == tok.encode(output.prompt)
        assert isinstance(generated.text, str) and 1 <= len(generated.token_ids) <= 16  # vLLM's default max_tokens
        assert generated.finish_reason == "length" or generated.token_ids[-1] in llm.engine.eos_token_ids


def test_generate_example_defaults_then_mutate(llm):
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = 5
    sampling_params.temperature = 0
    sampling_params.top_p = 1.0
    sampling_params.top_k = -1  # vLLM's "off": normalised when the request is added
    outputs = llm.generate(PROMPTS, sampling_params)
    assert sampling_params.top_k == 0
    explicit = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in explicit]
    assert len(outputs) == len(PROMPTS) and all(len(o.outputs[0].token_ids) <= 5 for o in outputs)
    # get_default_sampling_params() hands out a fresh object: the mutation above did not stick.
    assert llm.get_default_sampling_params().max_tokens == 16


def test_stop_string_set_after_construction_is_applied(llm):
    full = llm.generate(PROMPTS[2], greedy(12), use_tqdm=False)[0].outputs[0].text
    stop = next(full[i:i + 2] for i in range(1, len(full) - 1) if full[i:i + 2].isalnum())
    params = greedy(12)
    params.stop = stop  # a plain str, as vLLM allows; becomes [stop] when the request is added
    out = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    assert params.stop == [stop]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == full[: full.index(stop)]


def test_bad_value_set_after_construction_fails_like_the_constructor(llm):
    with pytest.raises(ValueError) as at_construction:
        SamplingParams(top_p=0.0)
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(ValueError) as at_generate:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert str(at_generate.value) == str(at_construction.value)
    params.max_tokens = "5"
    with pytest.raises(TypeError, match="max_tokens"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.is_finished() and not llm.engine.requests


def test_numpy_scalars_are_numbers_as_in_vllm(llm):
    """A parameter sweep hands numpy scalars; vLLM's fields take them, so do ours (as Python
    numbers), while numpy's bool stays refused like bool."""
    import numpy as np

    params = SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(3), n=np.int32(1), seed=np.int64(5),
                            top_p=np.float64(0.5), ignore_eos=True)
    assert (type(params.max_tokens), type(params.temperature), type(params.seed)) == (int, float, int)
    want = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3, seed=5, top_p=0.5, ignore_eos=True),
                        use_tqdm=False)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens=np.bool_(True))


def test_chat_example_one_and_many(llm):
    sampling_params = SamplingParams(temperature=0, max_tokens=4)
    outputs = llm.chat(CONVERSATION, sampling_params, use_tqdm=False)
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert len(outputs) == 1 and outputs[0].prompt == expected
    assert outputs[0].prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    conversations = [CONVERSATION for _ in range(10)]
    many = llm.chat(conversations, sampling_params, use_tqdm=True)
    assert len(many) == 10 and texts(many) == texts(outputs) * 10


def test_chat_with_custom_template(llm):
    template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    conversations = [CONVERSATION, CONVERSATION[:2]]
    outputs = llm.chat(conversations, greedy(), use_tqdm=False, chat_template=template)
    expected = "".join(f"[{m['role']}] {m['content']}\n" for m in CONVERSATION[:2]) + "[assistant] "
    assert outputs[1].prompt == expected
    (plain,) = llm.generate(TokensPrompt(prompt_token_ids=outputs[1].prompt_token_ids), greedy(), use_tqdm=False)
    assert plain.outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_chat_continue_final_message(llm):
    conversation = [{"role": "user", "content": "Finish my sentence."}, {"role": "assistant", "content": "The fox"}]
    (out,) = llm.chat(conversation, greedy(), use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("<|im_start|>assistant\nThe fox")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conversation, greedy(), use_tqdm=False, continue_final_message=True)  # add_generation_prompt=True
    assert llm.engine.is_finished()


def test_chat_tools_and_template_kwargs_reach_the_template(llm):
    template = (
        "{% if tools %}{% for t in tools %}<tool>{{ t['function']['name'] }}</tool>\n{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant{{ suffix }}{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    (out,) = llm.chat(messages, greedy(), use_tqdm=False, chat_template=template, tools=tools,
                      chat_template_kwargs={"suffix": ":"})
    assert out.prompt == "<tool>get_weather</tool>\nuser: Weather in Paris?\nassistant:"


def test_chat_openai_text_parts(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    assert llm.chat(parts, greedy(), use_tqdm=False)[0].prompt == llm.chat(joined, greedy(), use_tqdm=False)[0].prompt
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    with pytest.raises(ValueError, match="image_url"):
        llm.chat(image, greedy(), use_tqdm=False)


def test_chat_auto_content_format_follows_the_template_as_vllm(llm):
    """A template that loops over a message's content gets a list of text parts ("openai"), as
    vLLM's "auto" detects; one that prints it gets the string; an explicit format wins."""
    loops = ("{% set turns = messages %}{% for m in turns %}{% for part in m['content'] %}<{{ part.text }}>"
             "{% endfor %}{% endfor %}")
    prints = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    plain = [{"role": "user", "content": "a"}]

    def prompt(messages, template, fmt="auto"):
        return llm.chat(messages, greedy(), use_tqdm=False, chat_template=template,
                        chat_template_content_format=fmt)[0].prompt

    assert prompt(parts, loops) == "<a><b>" and prompt(plain, loops) == "<a>"
    assert prompt(parts, prints) == "<a\nb>"
    assert prompt(parts, loops, "string") == "<><><>"  # looping over the string "a\nb"
    assert prompt(plain, prints, "openai") == "<[{'type': 'text', 'text': 'a'}]>"


def test_tokens_and_text_prompts(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[0])
    by_text = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0]
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt=PROMPTS[0]), {"prompt_token_ids": ids, "prompt": "x"}],
        greedy(), use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outputs] == [by_text.outputs[0].token_ids] * 3
    assert [o.prompt for o in outputs] == [None, PROMPTS[0], "x"]
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate(TextPrompt(prompt="hi", multi_modal_data={"image": object()}), use_tqdm=False)


# ---- generate() keywords ----------------------------------------------------------------------


def test_generate_keywords_that_ask_for_nothing(llm):
    base = texts(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    same = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=None, priority=[0] * 4,
                        prompt_adapter_request=None, tokenization_kwargs={"add_special_tokens": True})
    assert texts(same) == base
    assert texts(llm.generate(PROMPTS, greedy(), False, [None] * 4)) == base  # positional, as vLLM orders them


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lora_request=object()), "lora_request"),
        (dict(priority=[1, 0, 0, 0]), "priority"),
        (dict(priority=[0]), "priority"),
        (dict(prompt_adapter_request=object()), "prompt_adapter_request"),
        (dict(tokenization_kwargs={"truncation": True}), "truncation"),
    ],
)
def test_generate_keywords_asking_for_missing_features_are_refused(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS, greedy(), use_tqdm=False, **kwargs)
    assert llm.engine.is_finished() and not llm.engine.requests


def test_generate_unknown_keyword_is_type_error(llm):
    with pytest.raises(TypeError, match="use_tdqm"):
        llm.generate(PROMPTS, greedy(), use_tdqm=False)


def test_use_tqdm_accepts_a_factory(llm):
    made = []

    def factory(**kwargs):
        from tqdm import tqdm

        made.append(kwargs["total"])
        return tqdm(**kwargs)

    llm.generate(PROMPTS, greedy(2), use_tqdm=factory)
    assert made == [len(PROMPTS)]


# ---- tokenizer, prefix cache ------------------------------------------------------------------


def test_set_tokenizer(tiny_model, tmp_path):
    other_dir = build_tiny_qwen3(tmp_path / "other", tokenizer_vocab_size=600)
    llm = LLM(tiny_model, dtype="float32", max_model_len=128, block_size=8, max_num_seqs=4)
    other = AutoTokenizer.from_pretrained(other_dir)
    text = "The weather today is cloudy"
    assert other.encode(text) != llm.get_tokenizer().encode(text)
    llm.set_tokenizer(other)
    assert llm.get_tokenizer() is other
    out = llm.generate(text, greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == other.encode(text)


def test_reset_prefix_cache(llm):
    prompt = PROMPTS[1] * 4  # several full blocks
    llm.generate(prompt, greedy(2), use_tqdm=False)
    assert llm.generate(prompt, greedy(2), use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, greedy(2), use_tqdm=False)[0].num_cached_tokens == 0


# ---- engine arguments: the three groups -------------------------------------------------------


def test_supported_vllm_arguments_are_mapped(tiny_model, tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in os.listdir(tiny_model):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(tiny_model, name), tokenizer_dir)
    llm = LLM(
        model=tiny_model, tokenizer=str(tokenizer_dir), dtype="half", seed=7, max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=64, block_size=4, gpu_memory_utilization=0.5, enable_prefix_caching=False,
        enable_chunked_prefill=True, enforce_eager=True, tensor_parallel_size=1,
    )
    c = llm.config
    assert (c.tokenizer, c.dtype, c.seed, c.max_model_len, c.max_num_seqs) == (str(tokenizer_dir), "float16", 7, 128, 4)
    assert (c.max_num_batched_tokens, c.kvcache_block_size, c.gpu_memory_utilization) == (64, 4, 0.5)
    assert (c.enable_prefix_caching, c.enable_chunked_prefill, c.enforce_eager) == (False, True, True)
    assert llm.engine.model_runner.dtype == torch.float16
    assert llm.get_tokenizer().name_or_path == str(tokenizer_dir)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "dtype, expected",
    [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
     ("float32", "float32"), ("auto", "auto"), ("BFloat16", "bfloat16"), (torch.float16, "float16"),
     (torch.bfloat16, "bfloat16"), (torch.float32, "float32")],
)
def test_dtype_aliases(dtype, expected):
    assert canonical_dtype(dtype) == expected


@pytest.mark.parametrize("dtype", ["int8", "fp8", torch.int8, 16])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError, match="dtype"):
        canonical_dtype(dtype)


def test_vllm_none_means_engine_default():
    none_everywhere = dict(seed=None, max_num_seqs=None, max_num_batched_tokens=None, block_size=None,
                           enable_prefix_caching=None, enable_chunked_prefill=None, max_model_len=None)
    config_kwargs, ignored = resolve_engine_args(none_everywhere)
    assert config_kwargs == {"max_model_len": None} and ignored == []  # Config's own None default


def test_one_knob_under_both_names_is_refused(tiny_model):
    with pytest.raises(ValueError, match="kvcache_block_size"):
        LLM(tiny_model, block_size=8, kvcache_block_size=16)


def test_no_effect_arguments_are_accepted_and_logged_once(tiny_model, caplog):
    kwargs = dict(trust_remote_code=True, disable_log_stats=True, swap_space=4, tokenizer_mode="auto",
                  disable_custom_all_reduce=True)
    assert resolve_engine_args(kwargs) == ({}, list(kwargs))
    with caplog.at_level(logging.WARNING, logger="nanoserve.engine_args"):
        LLM(tiny_model, dtype="float32", max_model_len=64, max_num_seqs=2, **kwargs)
        LLM(tiny_model, dtype="float32", max_model_len=64, max_num_seqs=2, **kwargs)
    logged = [r.getMessage() for r in caplog.records if r.name == "nanoserve.engine_args"]
    for name in kwargs:
        assert sum(f"{name} is accepted" in m for m in logged) == 1, name


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(swap_space=-1), "swap_space"), (dict(tokenizer_mode="slow"), "tokenizer_mode"),
     (dict(trust_remote_code="yes"), "trust_remote_code")],
)
def test_no_effect_arguments_still_check_their_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_engine_args(kwargs)


def test_refused_arguments_pass_at_their_off_value():
    off = {name: off_values[0] for name, (off_values, _) in REFUSED.items()}
    assert resolve_engine_args(off) == ({}, [])


@pytest.mark.parametrize(
    "name, value",
    [("quantization", "awq"), ("enable_lora", True), ("speculative_config", {"num_speculative_tokens": 2}),
     ("pipeline_parallel_size", 2), ("revision", "main"), ("download_dir", "/tmp/models"), ("enable_lora", 0),
     ("kv_cache_dtype", "fp8")],
)
def test_refused_arguments(tiny_model, name, value):
    with pytest.raises(ValueError, match=rf"{name}=.*not supported \(.+\)"):
        LLM(tiny_model, **{name: value})


@pytest.mark.parametrize(
    "typo, suggestion",
    [("gpu_memory_utilisation", "gpu_memory_utilization"), ("max_num_seq", "max_num_seqs"),
     ("trust_remote_cod", "trust_remote_code"), ("quantisation", "quantization")],
)
def test_unknown_argument_suggests_the_closest(tiny_model, typo, suggestion):
    with pytest.raises(TypeError, match=f"{typo}.*did you mean '{suggestion}'"):
        LLM(tiny_model, **{typo: 1})


def test_groups_do_not_overlap():
    from nanoserve.engine_args import supported_names

    assert not (set(NO_EFFECT) & set(REFUSED)) and not (supported_names() & (set(NO_EFFECT) | set(REFUSED)))


# ---- SamplingParams and output niceties -------------------------------------------------------


def test_sampling_params_clone_is_deep():
    params = SamplingParams(temperature=0.5, stop=["a"], stop_token_ids=[3])
    copy = params.clone()
    copy.stop.append("b")
    copy.stop_token_ids.append(4)
    copy.temperature = 0.1
    assert (params.stop, params.stop_token_ids, params.temperature) == (["a"], [3], 0.5)
    assert copy == SamplingParams(temperature=0.1, stop=["a", "b"], stop_token_ids=[3, 4])


def test_sampling_params_repr_shows_what_matters():
    r = repr(SamplingParams(temperature=0.8, top_p=0.95, seed=3))
    assert r.startswith("SamplingParams(") and "temperature=0.8" in r and "top_p=0.95" in r and "seed=3" in r
    assert "max_tokens=16" in r and "skip_special_tokens" not in r  # defaults beyond the core stay out


def test_output_repr_is_short():
    completion = CompletionOutput(index=0, text="word " * 1000, token_ids=list(range(5000)), finish_reason="length")
    out = RequestOutput(request_id="0", prompt="p " * 1000, prompt_token_ids=list(range(3000)), outputs=[completion])
    r = repr([out])
    assert len(r) < 1200, r
    assert "(3000 ids)" in r and "(5000 ids)" in r and "(5000 chars)" in r and "finish_reason='length'" in r
    small = CompletionOutput(index=0, text="hi", token_ids=[1, 2])
    assert "text='hi'" in repr(small) and "token_ids=[1, 2]" in repr(small)


def test_sampling_params_normalised_as_vllm(llm, caplog):
    """Values vLLM takes and rewrites: seed -1 (no seed), logprobs / prompt_logprobs True (1), a
    temperature in (0, 0.01) raised to 0.01 with a warning."""
    params = SamplingParams(seed=-1, logprobs=True, prompt_logprobs=True)
    assert (params.seed, params.logprobs, params.prompt_logprobs) == (None, 1, 1)
    with caplog.at_level(logging.WARNING, logger="nanoserve.sampling_params"):
        assert SamplingParams(temperature=1e-3).temperature == 0.01
    assert "maxed it out to 0.01" in caplog.text
    assert SamplingParams(temperature=0).temperature == 0.0  # greedy stays greedy
    params = SamplingParams()
    params.temperature, params.seed = 1e-4, -1  # set after construction: normalised when the request is added
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert (params.temperature, params.seed) == (0.01, None)
    for bad, kind in ((dict(seed=-2), ValueError), (dict(logprobs=False), TypeError)):
        with pytest.raises(kind):
            SamplingParams(**bad)


def test_stop_strings_need_detokenize(llm):
    """vLLM refuses stop strings with detokenize=False (there is no text to match); they were ignored."""
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(stop="x", detokenize=False)
    params = SamplingParams(detokenize=False)
    params.stop = ["x"]
    with pytest.raises(ValueError, match="detokenize"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.is_finished() and not llm.engine.requests
    SamplingParams(stop_token_ids=[3], detokenize=False)  # token ids need no text


@pytest.mark.parametrize("detokenize", [True, False])
def test_sample_logprobs_decoded_token(llm, detokenize):
    """vLLM's Logprob.decoded_token for sample logprobs: each token decoded alone; None without text."""
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4, logprobs=2, detokenize=detokenize)
    sample = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    for step in sample.logprobs:
        assert len(step) >= 2
        for t, lp in step.items():
            assert lp.decoded_token == (tok.decode([t]) if detokenize else None)


def test_output_fields_vllm_scripts_read(llm):
    """Every RequestOutput / CompletionOutput attribute of vLLM's, those of absent features None."""
    params = SamplingParams(n=2, seed=0, max_tokens=3, logprobs=1, prompt_logprobs=1)
    (out,) = llm.generate({"prompt": PROMPTS[0]}, params, use_tqdm=False)
    assert (out.prompt, out.finished, out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids,
            out.kv_transfer_params) == (PROMPTS[0], True, None, None, None, None)
    assert out.prompt_token_ids == llm.get_tokenizer().encode(PROMPTS[0])
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.num_cached_tokens >= 0
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert [c.index for c in out.outputs] == [0, 1]
    for c in out.outputs:
        assert len(c.token_ids) == len(c.logprobs) == 3 and c.finished() and c.finish_reason == "length"
        assert c.cumulative_logprob == pytest.approx(sum(step[t].logprob for t, step in zip(c.token_ids, c.logprobs)))
        assert (c.stop_reason, c.lora_request, c.kv_transfer_params) == (None, None, None)
