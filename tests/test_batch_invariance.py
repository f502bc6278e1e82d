"""Batch invariance: a request's prompt logprobs, tokens and logprobs are bit-identical whatever
else shares its steps (batch size, other requests' lengths, order, chunking, max_num_seqs) and
whether its prefix came from the cache, with LLM(batch_invariant=True). Measured, not assumed:
  - the GEMMs (oneDNN float32, the bf16 panel kernel) give each row the same bits whatever the
    row count, and the C attention kernels (decode, varlen prefill) compute each query row alone;
  - by default a prefill step whose longest prompt chunk has > 32 query tokens runs SDPA instead
    of the C varlen kernel, so a request's numbers depend on what else is prefilled with it and on
    how its own prompt is chunked (float32 below shows it). batch_invariant=True keeps the C kernel.
"""
from __future__ import annotations

import pytest

from helpers import make_llm, needs_batch_invariance, random_prompts
from nanoserve import SamplingParams

pytestmark = needs_batch_invariance  # the CPU backend's kernels are the invariant ones

TARGET = random_prompts(1, 45, 45, seed=21)[0]
OTHERS = random_prompts(10, 3, 70, seed=22)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=3, logprobs=2)

# (engine kwargs, the prompts run with TARGET): each changes what shares TARGET's steps or how it is chunked
COMPOSITIONS = [
    (dict(), [TARGET] + OTHERS),
    (dict(), OTHERS[:4] + [TARGET] + OTHERS[4:]),
    (dict(max_num_batched_tokens=64), OTHERS + [TARGET]),  # TARGET's prompt is split around others
    (dict(max_num_batched_tokens=16), [TARGET]),  # its own prompt in chunks of 16
    (dict(max_num_seqs=3), OTHERS + [TARGET]),
]


def target_numbers(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    (out,) = [o for o in outs if o.prompt_token_ids == TARGET]
    sample = out.outputs[0]
    return (
        [None if d is None else {t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in out.prompt_logprobs],
        sample.token_ids,
        [{t: lp.logprob for t, lp in d.items()} for d in sample.logprobs],
    )


def cpu_path(llm) -> str:
    return llm.engine.model_runner.backend.describe()["gemm"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_results_are_bit_identical(tiny_model, dtype):
    kw = {"batch_invariant": True}
    alone = make_llm(tiny_model, dtype=dtype, enable_prefix_caching=False, **kw)
    if dtype == "bfloat16" and cpu_path(alone) != "panel":
        pytest.skip(f"bf16 runs the {cpu_path(alone)} GEMM here; the panel GEMM is the one proven invariant")
    ref = target_numbers(alone, [TARGET])
    for engine_kw, prompts in COMPOSITIONS:
        got = target_numbers(make_llm(tiny_model, dtype=dtype, enable_prefix_caching=False, **kw, **engine_kw), prompts)
        assert got == ref, f"{dtype} {engine_kw}: results changed with the batch"
    # a prefix-cache hit (a continuation scored after the cached context) changes nothing either
    llm = make_llm(tiny_model, dtype=dtype, **kw)
    llm.generate([{"prompt_token_ids": TARGET[:40]}], SamplingParams(max_tokens=1), use_tqdm=False)  # cache 40
    hit = target_numbers(llm, [TARGET])
    assert llm.engine.block_manager.num_hit_tokens == 0  # full prompt logprobs: nothing may come from the cache
    assert hit == ref
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3, prompt_logprobs_start=41)
    cold = make_llm(tiny_model, dtype=dtype, enable_prefix_caching=False, **kw)
    (want,) = cold.generate([{"prompt_token_ids": TARGET}], scored, use_tqdm=False)
    (got,) = llm.generate([{"prompt_token_ids": TARGET}], scored, use_tqdm=False)
    assert got.num_cached_tokens == 40
    assert got.prompt_logprobs == want.prompt_logprobs


def test_default_prefill_path_depends_on_the_chunking(tiny_model):
    """Why batch_invariant is an option: by default SDPA takes long prefills, the C kernel short
    chunks, and their float32 sums differ. If this ever fails, the default became invariant:
    update the README's Scoring section."""
    ref = target_numbers(make_llm(tiny_model, enable_prefix_caching=False), [TARGET])
    chunked = target_numbers(make_llm(tiny_model, enable_prefix_caching=False, max_num_batched_tokens=16), [TARGET])
    assert chunked[0] != ref[0]


def test_vllm_env_turns_it_on(monkeypatch):
    from nanoserve.backends.cpu import CPUOptions

    assert CPUOptions.from_env({"VLLM_BATCH_INVARIANT": "1"}).batch_invariant
    assert not CPUOptions.from_env({}).batch_invariant


def test_batch_invariant_bf16_picks_the_panel_gemm():
    import torch

    from nanoserve.backends.cpu import choose_gemm, gemm_unavailable
    from nanoserve.kernels import cpu_kernels

    lib = cpu_kernels.load()
    kernels = cpu_kernels.CPUKernels(lib) if lib is not None else None
    if gemm_unavailable("panel", torch.bfloat16, kernels) is not None:
        pytest.skip("no panel GEMM here")
    # dpbf16 (the default on AVX512-BF16) splits a row's sums by tile height: not invariant
    assert choose_gemm("auto", torch.bfloat16, kernels, batch_invariant=True) == "panel"
