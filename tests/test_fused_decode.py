"""The CPU backend's fused decode (every layer of a decode-only step in one C call,
nanoserve/kernels/cpu_decode_layers.py) against the module path it stands in for: it calls the same
kernels in the same order on the same bf16 rows, so tokens and logprobs must be equal bit for bit."""
from __future__ import annotations

import pytest

from helpers import FaultInjectingBackend, assert_no_leak, make_llm, random_prompts
from nanoserve import SamplingParams
from nanoserve.kernels import cpu_kernels
from nanoserve.kernels.cpu_decode_layers import DecodeLayers
from nanoserve.quantization.pack import write_quantized_checkpoint

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or not cpu_kernels.load().int8_gemm_supported(),
    reason="needs the C kernels built with AVX2/FMA")

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


def _generate(monkeypatch, path: str, fused: bool, int8_path: str = "w8a16", gemm: str = "panel", **kw):
    """(per prompt: tokens and (token, logprob) pairs; what the model's fused_decode ended up as)."""
    monkeypatch.setenv("NANOSERVE_CPU_FUSED_DECODE", "1" if fused else "0")
    # The loop runs the panel GEMM (every AVX2 CPU has it) or dpbf16 (AVX512-BF16), not oneDNN's.
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", gemm)
    if kw.get("quantization") == "int8":  # W8A16, or the VNNI kernel CPUs with AVX512-VNNI pick
        monkeypatch.setenv("NANOSERVE_CPU_INT8", int8_path)
    llm = make_llm(path, dtype="bfloat16", **kw)
    # lengths apart, so some steps mix a prefill with decodes (the modules) and others only decode
    outs = llm.generate(random_prompts(5, 3, 40, seed=7), PARAMS, use_tqdm=False)
    assert_no_leak(llm)
    result = [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in step.items())
                                        for step in o.outputs[0].logprobs]) for o in outs]
    return result, llm.engine.model_runner.model.model.fused_decode


@pytest.fixture(scope="module")
def int4_checkpoints(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("fused-int4")
    built = {}
    for name, kind, options in [("gptq", "gptq", {}), ("awq", "awq", {}), ("gptq-act-order", "gptq",
                                                                           dict(sym=False, act_order=True))]:
        write_quantized_checkpoint(model_dirs["untied-gqa4"], str(root / name), kind, **options)
        built[name] = str(root / name)
    return built


VNNI = cpu_kernels.load() is not None and bool(cpu_kernels.load().vnni_supported())
DPBF16 = cpu_kernels.load() is not None and bool(cpu_kernels.load().dpbf16_supported())


@pytest.mark.parametrize("model, quantization, int8_path, gemm", [
    ("tied-gqa2", None, None, "panel"), ("untied-gqa4", None, None, "panel"), ("untied-gqa4", "int8", "w8a16", "panel"),
    pytest.param("untied-gqa4", "int8", "vnni", "panel", marks=pytest.mark.skipif(not VNNI, reason="needs AVX512-VNNI")),
    pytest.param("tied-gqa2", None, None, "dpbf16", marks=pytest.mark.skipif(not DPBF16, reason="needs AVX512-BF16")),
    pytest.param("untied-gqa4", None, None, "dpbf16", marks=pytest.mark.skipif(not DPBF16, reason="needs AVX512-BF16"))])
def test_fused_decode_equals_the_modules(monkeypatch, model_dirs, model, quantization, int8_path, gemm):
    path = model_dirs[model]
    ref, unfused = _generate(monkeypatch, path, False, int8_path, gemm, quantization=quantization)
    got, fused = _generate(monkeypatch, path, True, int8_path, gemm, quantization=quantization)
    assert unfused is False and isinstance(fused, DecodeLayers) and fused.steps_run >= PARAMS.max_tokens - 1
    assert got == ref


@pytest.mark.parametrize("name", ["gptq", "awq"])
def test_fused_decode_runs_int4_checkpoints_exactly(monkeypatch, int4_checkpoints, name):
    ref, _ = _generate(monkeypatch, int4_checkpoints[name], False)
    got, fused = _generate(monkeypatch, int4_checkpoints[name], True)
    assert isinstance(fused, DecodeLayers) and fused.steps_run >= PARAMS.max_tokens - 1
    assert got == ref


def test_fused_decode_steps_aside_where_its_kernels_are_not_the_ones_running(monkeypatch, model_dirs,
                                                                           int4_checkpoints):
    # float32 activations, the torch attention reference, an act-order permutation of the inputs:
    # the module path runs (fused_decode is False) and gives its own results.
    monkeypatch.setenv("NANOSERVE_CPU_FUSED_DECODE", "1")
    llm = make_llm(model_dirs["tied-gqa2"])  # float32
    llm.generate(random_prompts(2, 3, 9), PARAMS, use_tqdm=False)
    assert llm.engine.model_runner.model.model.fused_decode is False
    _, fused = _generate(monkeypatch, int4_checkpoints["gptq-act-order"], True)
    assert fused is False
    monkeypatch.setenv("NANOSERVE_CPU_ATTENTION", "torch")
    _, fused = _generate(monkeypatch, model_dirs["tied-gqa2"], True)
    assert fused is False


def test_fused_decode_follows_a_reallocated_kv_cache(monkeypatch, model_dirs):
    # The runner reallocates the KV cache (its warm-up, resize_kv_cache); the fused layers must write
    # and read the cache the modules are bound to now, not the one they saw first.
    monkeypatch.setenv("NANOSERVE_CPU_FUSED_DECODE", "1")
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", "panel")
    llm = make_llm(model_dirs["tied-gqa2"], dtype="bfloat16", enable_prefix_caching=False)
    prompts = random_prompts(3, 4, 12, seed=3)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    runner = llm.engine.model_runner
    fused = runner.model.model.fused_decode
    before = list(fused.cache_ptrs)
    keep_old_alive = runner.kv_cache  # so the new cache cannot land at the old address
    runner.resize_kv_cache(runner.kv_spec.num_blocks)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert again == first
    attn = runner.model.model.layers[0].self_attn.attn
    assert fused.cache_ptrs[0] == (attn.k_cache.data_ptr(), attn.v_cache.data_ptr()) != before[0]
    del keep_old_alive


def test_fused_decode_leaves_a_backend_subclass_its_own_ops(monkeypatch, model_dirs):
    # A subclass replacing an op the loop would run in C (here attention, counting its calls) keeps
    # every call: the module path runs, one attention call per layer per step.
    monkeypatch.setenv("NANOSERVE_CPU_FUSED_DECODE", "1")
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", "panel")
    llm = make_llm(model_dirs["tied-gqa2"], dtype="bfloat16", attention_backend=FaultInjectingBackend)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    model = llm.engine.model_runner.model.model
    assert model.fused_decode is False
    assert llm.engine.model_runner.backend.calls == 4 * len(model.layers)
