"""The default dtype end to end: bf16 through every CPU GEMM path this machine has (and the pure-torch
backend, which runs everywhere), against HF transformers in bf16 and against nanoserve in float32.

bf16 rounds differently in each implementation, so greedy tokens may part ways where the
reference's top-2 logits nearly tie: a divergence is forgiven only where they differ by less
than 1e-2, and the rest of that sample is not compared. The test model's LM head is scaled down
(logits of magnitude ~1) so that bf16's relative rounding stays well under that absolute bound;
a real error (a wrong kernel, a misrounded weight) moves logits far more.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import assert_no_leak, make_llm, random_prompts
from nanoserve import SamplingParams
from nanoserve.backends.cpu import GEMM_PATHS, gemm_unavailable
from nanoserve.kernels import cpu_kernels
from nanoserve.utils.tiny_checkpoint import build_tiny_qwen3

NEAR_TIE = 1e-2
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> str:
    path = build_tiny_qwen3(tmp_path_factory.mktemp("bf16") / "m", seed=7, dtype="bfloat16", hidden_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                            tie_word_embeddings=False)
    weights = load_file(f"{path}/model.safetensors")
    weights["lm_head.weight"] = (weights["lm_head.weight"].float() * 0.15).bfloat16()
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


def first_divergence(got: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)


def _engine(path: str, gemm: str, monkeypatch):
    if gemm == "torch backend":
        return make_llm(path, dtype="bfloat16", attention_backend="torch")
    lib = cpu_kernels.load()
    reason = gemm_unavailable(gemm, torch.bfloat16, cpu_kernels.CPUKernels(lib) if lib is not None else None)
    if reason is not None:
        pytest.skip(f"{gemm}: {reason}")
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", gemm)
    llm = make_llm(path, dtype="bfloat16")
    assert llm.engine.model_runner.backend.describe()["gemm"] == gemm
    return llm


@pytest.mark.parametrize("gemm", [*GEMM_PATHS, "torch backend"])
def test_bf16_greedy_matches_hf_bf16_and_the_fp32_engine(bf16_model, hf, gemm, monkeypatch):
    prompts = random_prompts(5, 4, 60, seed=61)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    llm = _engine(bf16_model, gemm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm)
    monkeypatch.delenv("NANOSERVE_CPU_GEMM", raising=False)
    fp32 = make_llm(bf16_model, dtype="float32").generate(prompts, params, use_tqdm=False)
    compared = 0
    for prompt, out, ref32 in zip(prompts, outs, fp32, strict=True):
        got = out.outputs[0].token_ids
        hf_tokens, hf_gaps = hf.greedy_with_gaps(bf16_model, prompt, MAX_TOKENS, torch.bfloat16)
        step = first_divergence(got, hf_tokens)
        if step is not None:
            assert hf_gaps[step] < NEAR_TIE, f"prompt {prompt[:4]}..: left HF bf16 at step {step} (gap {hf_gaps[step]:.3g})"
        step = first_divergence(got, ref32.outputs[0].token_ids)
        if step is not None:
            top2 = sorted((lp.logprob for lp in ref32.outputs[0].logprobs[step].values() if lp.rank in (1, 2)),
                          reverse=True)
            assert top2[0] - top2[1] < NEAR_TIE, f"left the fp32 engine at step {step} (gap {top2[0] - top2[1]:.3g})"
        compared += step is None
    assert compared >= 3, "most samples should agree with the fp32 engine all the way"
