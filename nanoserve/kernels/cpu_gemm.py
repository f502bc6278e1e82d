"""Linear layers on the CPU through a float32 GEMM: a weight prepared once, called every step.

`CPUWeight` holds a linear layer's weight as float32, prepacked in oneDNN's blocked layout when
oneDNN is there (F.linear's MKL call repacks the weight on every call: ~2x slower at 16 rows);
for bf16 weights it also keeps the bf16 tensor itself for the skinny GEMM of small batches, where
the weight bytes bound the step and bf16 has half of them. Which layers get one, and up to how
many rows the skinny GEMM runs, is the CPU backend's choice (nanoserve/backends/cpu.py).

The reference is F.linear: both accumulate in float32 and round to the activations' dtype, what a
native bf16 GEMM computes up to summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels.cpu_kernels import CPUKernels


class CPUWeight:
    """x -> x @ weight.T + bias in float32, for activations of any float dtype (widened exactly,
    result rounded back to their dtype)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernels: CPUKernels | None = None,  # None: no skinny GEMM
        skinny_max_rows: int = 0,
    ) -> None:
        lowp = weight.detach()
        # The skinny kernel reads the bf16 weight itself (shares its storage).
        self.lowp = lowp if kernels is not None and lowp.dtype == torch.bfloat16 and lowp.is_contiguous() else None
        self.kernels = kernels
        self.skinny_max_rows = skinny_max_rows
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
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()  # [rows, in]
        if self.lowp is not None and x2.shape[0] <= self.skinny_max_rows:
            y = self.kernels.skinny_gemm(x2, self.lowp, self.bias)
            if y is not None:
                return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x2, self.dense, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
