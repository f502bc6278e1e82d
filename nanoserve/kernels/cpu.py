"""CPU GEMMs for the linear layers: which dtype they run in and which kernel.

On a CPU without bf16/fp16 dot-product instructions (AVX2 and older: no AVX512-BF16/FP16, no
AMX) PyTorch's low-precision GEMM falls back to a slow kernel: ~20 GFLOP/s on 2 Zen 3 cores,
against ~120-140 for float32. There, and for float32 models, each linear layer gets a CPUWeight:

- a float32 copy of its weight prepacked in oneDNN's blocked layout, for prefill-sized batches
  (F.linear's MKL call repacks the weight on every call: ~2x slower at 16 rows);
- for bf16 weights and decode-sized batches, the skinny GEMM of cpu_kernels.c on the bf16 weight
  itself: there the weight bytes bound the step, and bf16 has half of them.

Both accumulate in float32 and round to the activations' dtype: what a native bf16 GEMM computes,
up to summation order. The float32 copies cost 4 bytes per weight on top of the model.
NANOSERVE_CPU_GEMM=native keeps plain F.linear in the model dtype.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from nanoserve.kernels import cpu_kernels


@functools.lru_cache(maxsize=None)
def _native_lowp_supported(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


def fp32_compute(dtype: torch.dtype, device: torch.device) -> bool:
    """Should bf16/fp16 GEMMs (and attention matmuls) on `device` run in float32?

    On a CPU without bf16/fp16 dot-product instructions (AVX2 and older: no AVX512-BF16/FP16,
    no AMX) PyTorch's low-precision GEMM falls back to a slow kernel, 5-10x below float32 MKL on
    the same cores. Products of bf16 values are exact in float32 and both accumulate in float32,
    so rounding the float32 result back to bf16 gives a bf16 GEMM's answer up to summation order.

    NANOSERVE_CPU_GEMM=auto (default) | fp32 | native overrides the choice.
    """
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    choice = os.environ.get("NANOSERVE_CPU_GEMM", "auto")
    if choice not in ("auto", "native", "fp32"):
        raise ValueError(f"NANOSERVE_CPU_GEMM must be auto, native or fp32, got {choice!r}")
    if choice != "auto":
        return choice == "fp32"
    return not _native_lowp_supported(dtype)


def use_cpu_gemm(dtype: torch.dtype, device: torch.device) -> bool:
    """Give linear layers a CPUWeight? (CPU, and float32 or a slow bf16/fp16 GEMM.)"""
    if device.type != "cpu" or os.environ.get("NANOSERVE_CPU_GEMM", "auto") == "native":
        return False
    return dtype == torch.float32 or fp32_compute(dtype, device)


# Up to this many rows (a decode batch) a bf16 weight goes through the skinny C GEMM. Measured on
# 2 AVX2 cores over all of Qwen3-0.6B's weights (28 layers + LM head) against the oneDNN copy:
# 56 vs 96 ms at 1 row, 131 vs 194 ms at 8, 220 vs 283 ms at 16.
SKINNY_MAX_ROWS = 16


class CPUWeight:
    """A linear layer's weight as float32, prepacked for oneDNN when it is there; bf16 weights
    also keep their own bf16 tensor for the skinny GEMM of small batches.

    Called on activations of any float dtype: they are widened to float32 (exact), multiplied
    with float32 accumulation, and the result is rounded back to their dtype, which is what a
    native bf16 GEMM computes (up to summation order).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        lowp = weight.detach()
        self.lowp = lowp if lowp.dtype == torch.bfloat16 and lowp.is_contiguous() else None  # shares storage
        dense = weight.detach().to(torch.float32).contiguous()
        self.bias = bias.detach().to(torch.float32).contiguous() if bias is not None else None
        self.packed = self.dense = None
        if torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, None)
            except (RuntimeError, AttributeError, NotImplementedError):
                self.packed = None
        if self.packed is None:
            self.dense = dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
        if self.lowp is not None and x2.shape[0] <= SKINNY_MAX_ROWS:
            y = cpu_kernels.skinny_gemm(x2, self.lowp, self.bias)
            if y is not None:
                return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x2, self.dense, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
