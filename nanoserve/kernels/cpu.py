"""What this CPU does fast: decides where low-precision math runs in float32 instead."""
from __future__ import annotations

import functools
import os

import torch


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
