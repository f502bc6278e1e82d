"""The accuracy gate of the int8 paths: each against the bf16 model on teacher-forced positions.

Teacher forcing: the bf16 model generates greedily from each prompt (or the teachers are given:
held-out text, for the trained checkpoint of bench/trained_checkpoint.py); every path is then asked
for the next token after prompt + teacher[:j] for each j, with top-k logprobs (prefix caching
makes each of those a one-block prefill). Per path: the mean |logprob difference| of the
teacher's tokens and the top-1 agreement with the bf16 model.

A random checkpoint is too kind to W8A8: its activations have no outlier channels, and
per-token quantization fails exactly on them. `realistic_checkpoint` writes a copy with the
statistics published for LLaMA/Qwen-class models: per-output-channel weight scales spread over
about an order of magnitude, and a few hidden channels whose activations are 20-100x the rest
(made the way trained models make them: large RMSNorm gains on those channels; the weights
that read them stay as they are, flat across input channels as SmoothQuant found them).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams

OUTLIER_CHANNELS = 4
OUTLIER_GAINS = (20.0, 100.0)  # the range of the outlier channels' RMSNorm gains
CHANNEL_SPREAD = 0.6  # std of log(per-output-channel weight scale): max/min over a layer ~ 10-20x
TOP_K = 20  # logprobs asked per position (vLLM's default max_logprobs)
OUTLIER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")  # before q/k/v and gate/up


def realistic_checkpoint(src: str, dst: str, seed: int = 0) -> str:
    """Copy the checkpoint at `src` to `dst` with outlier channels and per-channel weight spread."""
    g = torch.Generator().manual_seed(seed)
    with open(os.path.join(src, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    channels, gains = _outlier_channels(hidden, g)
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name.endswith(".safetensors"):
            tensors = load_file(path)
            save_file(_transform(tensors, channels, gains, g), os.path.join(dst, name), metadata={"format": "pt"})
        elif os.path.isfile(path):
            shutil.copy(path, os.path.join(dst, name))
    return dst


def with_outlier_statistics(tensors: dict[str, torch.Tensor], hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`tensors` (one state dict) with realistic_checkpoint's outlier channels and weight spread."""
    g = torch.Generator().manual_seed(seed)
    channels, gains = _outlier_channels(hidden, g)
    return _transform(tensors, channels, gains, g)


def _outlier_channels(hidden: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    channels = torch.randperm(hidden, generator=g)[:OUTLIER_CHANNELS]
    lo, hi = OUTLIER_GAINS
    return channels, lo * (hi / lo) ** torch.rand(OUTLIER_CHANNELS, generator=g)  # log-uniform in [lo, hi]


def _transform(tensors: dict[str, torch.Tensor], channels: torch.Tensor, gains: torch.Tensor,
               g: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sorted(tensors.items()):
        w = t.float().clone()
        if name.endswith(OUTLIER_NORMS):
            w[channels] *= gains
        if w.dim() == 2 and name.endswith("proj.weight"):  # per-output-channel spread, mean scale kept
            spread = torch.exp(torch.randn(w.shape[0], 1, generator=g) * CHANNEL_SPREAD - CHANNEL_SPREAD ** 2 / 2)
            w *= spread
        out[name] = w.to(t.dtype).contiguous()
    return out


@contextmanager
def int8_path(path: str | None) -> Iterator[None]:
    """NANOSERVE_CPU_INT8 set to `path` while an engine is built (None: leave it alone)."""
    old = os.environ.get("NANOSERVE_CPU_INT8")
    if path is not None:
        os.environ["NANOSERVE_CPU_INT8"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NANOSERVE_CPU_INT8", None)
        else:
            os.environ["NANOSERVE_CPU_INT8"] = old


@dataclass(frozen=True)
class PathAccuracy:
    path: str
    positions: int
    mean_abs_logprob_diff: float
    top1_agreement: float

    def line(self) -> str:
        return (f"{self.path:>14}: top-1 agreement {100 * self.top1_agreement:6.2f}%  mean |logprob diff| "
                f"{self.mean_abs_logprob_diff:.4f}  ({self.positions} positions)")


def _next_token_logprobs(llm: LLM, prompts: list[list[int]], teachers: list[list[int]]) -> list[dict]:
    """For each prompt and j: the top-k logprobs of the token after prompt + teacher[:j]."""
    requests = [{"prompt_token_ids": p + t[:j]} for p, t in zip(prompts, teachers) for j in range(len(t))]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP_K, ignore_eos=True, detokenize=False)
    outs = llm.generate(requests, params, use_tqdm=False)
    return [o.outputs[0].logprobs[0] for o in outs]


def _logprob_of(entry: dict, token: int) -> float:
    """The token's logprob; outside the top-k, the k-th's (a bound: the true one is lower)."""
    if token in entry:
        return entry[token].logprob
    return min(lp.logprob for lp in entry.values())


def _top1(entry: dict) -> int:
    return max(entry, key=lambda t: entry[t].logprob)


def measure_accuracy(model: str, prompts: list[list[int]], num_tokens: int, paths: dict[str, dict],
                     teachers: list[list[int]] | None = None, **llm_kwargs) -> tuple[list[PathAccuracy], list[list[int]]]:
    """paths: name -> {"quantization": ..., "int8": NANOSERVE_CPU_INT8 or None, "llm": other LLM kwargs, "model": another
    checkpoint (e.g. a quantized one's float twin) instead of `model`}; the first is the reference, which makes the
    teacher tokens (num_tokens greedy ones) unless `teachers` gives them (e.g. held-out text). Returns each path's
    figures and the teachers."""
    if teachers is not None and len(teachers) != len(prompts):
        raise ValueError(f"teachers: one list per prompt ({len(prompts)}), got {len(teachers)}")
    results, reference = [], None
    for name, spec in paths.items():
        with int8_path(spec.get("int8")):
            llm = LLM(spec.get("model", model), quantization=spec.get("quantization"), **{**llm_kwargs, **spec.get("llm", {})})
        if teachers is None:
            params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, detokenize=False)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            teachers = [o.outputs[0].token_ids for o in outs]
        entries = _next_token_logprobs(llm, prompts, teachers)
        llm.close()  # its weights and KV cache now, not at the next collection: one model at a time
        chosen = [t for teacher in teachers for t in teacher]
        if reference is None:
            reference = entries
        diffs = [abs(_logprob_of(e, t) - _logprob_of(r, t)) for e, r, t in zip(entries, reference, chosen)]
        agree = [_top1(e) == _top1(r) for e, r in zip(entries, reference)]
        results.append(PathAccuracy(name, len(chosen), math.fsum(diffs) / len(diffs), sum(agree) / len(agree)))
    return results, teachers


def int8_paths() -> dict[str, dict]:
    """The paths the accuracy gate compares: bf16 and each int8 path this CPU runs (the VNNI kernel only
    where the C kernels were built with AVX512-VNNI; asked for when a run needs them, not at import)."""
    paths = {
        "bf16": {},
        "int8 W8A16": {"quantization": "int8", "int8": "w8a16"},
        "int8 W8A8": {"quantization": "int8", "int8": "w8a8"},
    }
    from nanoserve.kernels import cpu_kernels

    lib = cpu_kernels.load()
    if lib is not None and lib.vnni_supported():  # the default int8 path on AVX512-VNNI CPUs
        paths["int8 W8A8 VNNI"] = {"quantization": "int8", "int8": "vnni"}
    return paths
