"""Bad input raises a clear ValueError/TypeError before any work starts."""
import json
import os
import shutil

import pytest
from helpers import make_llm

from nanoserve import LLM, SamplingParams
from nanoserve.models import SUPPORTED_ARCHITECTURES


@pytest.fixture(scope="module")
def llm(tiny_model):
    return make_llm(tiny_model, num_kvcache_blocks=64, max_model_len=128)


def test_missing_model_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_model_dir_without_config_or_weights(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    shutil.copy(os.path.join(tiny_model, "config.json"), tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_supported(tmp_path, tiny_model):
    shutil.copytree(tiny_model, tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*supported: .*Qwen3ForCausalLM") as info:
        LLM(str(tmp_path / "m"))
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_unknown_kwarg_is_type_error(tiny_model):
    with pytest.raises(TypeError, match="block_sise"):
        LLM(tiny_model, block_sise=16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(device="tpu"), "device"),
        (dict(dtype="int8"), "dtype"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(kvcache_block_size=0), "kvcache_block_size"),
        (dict(max_model_len=10**6), "max_position_embeddings"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=64), "max_num_batched_tokens"),
        (dict(attention_backend="flash_attn", device="cpu"), "attention_backend"),
        (dict(max_logprobs=-2), "max_logprobs must be >= 0 or -1"),
    ],
)
def test_bad_config_values(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model, **kwargs)


def test_kv_cache_too_small_for_one_sequence(tiny_model):
    with pytest.raises(ValueError, match=r"has 3 blocks of 8 tokens.*needs 16"):
        LLM(tiny_model, device="cpu", kvcache_block_size=8, num_kvcache_blocks=3, max_model_len=128)


def test_tensor_parallel_must_divide_kv_heads(tiny_model):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_model, tensor_parallel_size=3)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[]], "empty"),
        ("", "empty"),
        ([[1, 2, 10**7]], "token ids"),
        ([[1, -1]], "token ids"),
        ([[1] * 129], "max_model_len"),
        ([], "empty"),
    ],
)
def test_bad_prompts(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, use_tqdm=False)
    assert llm.engine.is_finished()


def test_bad_prompt_type(llm):
    with pytest.raises(TypeError):
        llm.generate(123, use_tqdm=False)


def test_params_length_mismatch(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_no_work_starts_when_one_prompt_is_bad(llm):
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], [1, 10**7]], use_tqdm=False)
    assert llm.engine.is_finished() and not llm.engine.requests
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "make_params, match",
    [
        # min_tokens > 0 masks the stop ids from the first step: once checked per step, this failed mid-run.
        (lambda vocab: SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[vocab]), "stop_token_ids"),
        (lambda vocab: SamplingParams(max_tokens=4, stop_token_ids=[1, vocab + 5]), "stop_token_ids"),
        (lambda vocab: SamplingParams(max_tokens=4, n=2, seed=2**63 - 1), "seed"),  # sample 1 would use 2**63
        (lambda vocab: SamplingParams(max_tokens=4, logprobs=21), "max_logprobs=20"),
    ],
)
def test_bad_request_for_this_model_fails_before_any_work(llm, make_params, match):
    good = SamplingParams(max_tokens=2, ignore_eos=True)
    queried = llm.prefix_cache_stats["queries"]
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2, 3], [4, 5, 6]], [good, make_params(llm.engine.vocab_size)], use_tqdm=False)
    assert llm.prefix_cache_stats["queries"] == queried, "a step was scheduled before the error"
    assert llm.engine.is_finished() and not llm.engine.requests
    out = llm.generate([[1, 2, 3]], good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(top_p=float("nan")), "top_p must be a finite number"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(n=0), "n"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-2), "logprobs must be >= 0, -1"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_sampling_params_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_tokens=1.5), dict(temperature="hot"), dict(n=True), dict(stop=3), dict(stop_token_ids=["a"]),
     dict(ignore_eos=1), dict(seed=1.0)],
)
def test_bad_sampling_params_type(kwargs):
    with pytest.raises(TypeError):
        SamplingParams(**kwargs)


def test_logprobs_cap_is_configurable(tiny_model):
    llm = make_llm(tiny_model, num_kvcache_blocks=16, max_model_len=64, max_logprobs=40)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=40, ignore_eos=True), use_tqdm=False)
    entries = out[0].outputs[0].logprobs
    assert len(entries) == 2 and all(len(entry) >= 40 for entry in entries)
    llm.close()


def test_generate_after_close_is_a_clear_error(tiny_model):
    llm = make_llm(tiny_model, num_kvcache_blocks=16, max_model_len=64)
    llm.close()
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
