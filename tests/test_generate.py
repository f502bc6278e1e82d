"""LLM.generate end to end on CPU in float32: exact greedy tokens against HF transformers."""
import pytest

from helpers import assert_matches_hf, assert_no_leak, make_llm, random_prompts
from nanoserve import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("config", ["tied-gqa2", "untied-gqa4"])
def test_greedy_matches_hf(model_dirs, hf, config):
    path = model_dirs[config]
    prompts = random_prompts(8, 3, 40, seed=hash(config) % 100)
    llm = make_llm(path)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf, path, prompts, outputs, 32)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert len({t for o in outputs for t in o.outputs[0].token_ids}) > 16, "outputs are degenerate"
    assert_no_leak(llm)


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
def test_any_block_size_matches_hf(model_dirs, hf, block_size):
    path = model_dirs["untied-gqa4"]
    prompts = random_prompts(4, 10, 70, seed=block_size)
    llm = make_llm(path, kvcache_block_size=block_size, num_kvcache_blocks=4096 // block_size)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert_matches_hf(hf, path, prompts, outputs, 12)
    assert_no_leak(llm)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_shared_prefix_same_tokens_with_and_without_caching(tiny_model, hf, enable_prefix_caching):
    system = random_prompts(1, 30, 30, seed=7)[0]  # spans several 8-token blocks
    prompts = [system + tail for tail in random_prompts(6, 2, 12, seed=8)]
    llm = make_llm(tiny_model, enable_prefix_caching=enable_prefix_caching)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    outputs = first + rest
    assert_matches_hf(hf, tiny_model, prompts, outputs, 32)
    if enable_prefix_caching:
        assert all(o.num_cached_tokens >= 24 for o in rest)
        assert llm.prefix_cache_hit_rate > 0
    else:
        assert all(o.num_cached_tokens == 0 for o in outputs)
    assert_no_leak(llm)


def test_preemption_keeps_tokens_exact(tiny_model, hf):
    prompts = random_prompts(8, 10, 30, seed=3)
    # 12 blocks of 8 tokens: 96 slots for 8 sequences growing to ~60 tokens each.
    llm = make_llm(tiny_model, num_kvcache_blocks=12, max_model_len=96)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test did not force preemption"
    assert_matches_hf(hf, tiny_model, prompts, outputs, 32)
    assert_no_leak(llm)


@pytest.mark.parametrize("chunked", [True, False])
def test_long_prompt_chunked_prefill_matches_hf(tiny_model, hf, chunked):
    budget = 40 if chunked else 512
    prompt = random_prompts(1, 120, 120, seed=11)[0]  # three times the chunked budget
    short = random_prompts(3, 4, 9, seed=12)
    llm = make_llm(tiny_model, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    outputs = llm.generate(short + [prompt], GREEDY, use_tqdm=False)
    assert_matches_hf(hf, tiny_model, short + [prompt], outputs, 32)
    assert_no_leak(llm)


def test_mixed_and_prefill_first_scheduling_agree(tiny_model):
    prompts = random_prompts(10, 5, 90, seed=21)
    results = []
    for chunked, budget, blocks in ((True, 32, 30), (False, 512, 30), (True, 64, 256)):
        llm = make_llm(tiny_model, enable_chunked_prefill=chunked, max_num_batched_tokens=budget,
                       num_kvcache_blocks=blocks, max_model_len=200)
        out = llm.generate(prompts, GREEDY, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in out])
        assert_no_leak(llm)
    assert results[0] == results[1] == results[2]


def test_generation_stops_at_max_model_len(tiny_model):
    llm = make_llm(tiny_model, max_model_len=40)
    prompt = random_prompts(1, 30, 30)[0]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 10
    assert out.outputs[0].finish_reason == "length"


def test_prompt_forms_and_order(tiny_model):
    llm = make_llm(tiny_model)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    text_out = llm.generate("The cat sat on", params, use_tqdm=False)
    assert len(text_out) == 1 and text_out[0].prompt == "The cat sat on"
    ids = llm.tokenizer.encode("The cat sat on")
    assert llm.generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids == text_out[0].outputs[0].token_ids
    many = llm.generate(["a", "b b b b b", "c"], [params, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), params],
                        use_tqdm=False)
    assert [o.prompt for o in many] == ["a", "b b b b b", "c"]
    assert [len(o.outputs[0].token_ids) for o in many] == [4, 2, 4]
    assert all(o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
               for o in many)


def test_pure_pytorch_path_matches_hf(model_dirs, hf):
    """The pure-PyTorch reference backend: PyTorch attention and PyTorch small ops."""
    path = model_dirs["untied-gqa4"]
    prompts = random_prompts(4, 3, 40, seed=77)
    llm = make_llm(path, attention_backend="torch")
    assert llm.engine.model_runner.backend.name == "torch"
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf, path, prompts, outputs, 32)
    assert_no_leak(llm)


def test_cpu_backend_without_c_kernels_matches_hf(model_dirs, hf, monkeypatch):
    """Where no C compiler exists (or NANOSERVE_CPU_KERNELS=0): the CPU backend's PyTorch paths."""
    monkeypatch.setenv("NANOSERVE_CPU_KERNELS", "0")
    path = model_dirs["untied-gqa4"]
    prompts = random_prompts(4, 3, 40, seed=78)
    llm = make_llm(path, device="cpu")
    backend = llm.engine.model_runner.backend
    assert backend.name == "cpu" and backend.describe()["attention"] == "torch SDPA"
    assert backend.describe()["fused ops"] == "torch"
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf, path, prompts, outputs, 32)
    assert_no_leak(llm)


def test_bad_cpu_switch_is_a_clear_error(tiny_model, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", "fast")
    with pytest.raises(ValueError, match="NANOSERVE_CPU_GEMM must be one of auto, panel, dpbf16, onednn-bf16"):
        make_llm(tiny_model, device="cpu")
