"""The one form every pre-quantized linear weight is decoded into, whatever its file format.

    w[n, perm[j]] = qweight[n, j] * scales[n, j // group_size]

qweight holds small signed integers as int8: GPTQ/AWQ/compressed-tensors int4 with zero points
store w = (q - z) * s per group, and q - z lies in [-16, 15], an exact int8 value under the same
group scale; int8 formats are int8 already. So the int8 kernels (nanoserve/kernels/cpu_int8.c)
run every integer format exactly, with group_size = the format's group.

perm is None unless the checkpoint is act-order GPTQ (g_idx not in k order): its input columns
are then stored here sorted by group, so that groups are contiguous, and the GEMM multiplies
x[:, perm] (the activations gathered the same way) by them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    qweight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, ceil(K / group_size)] float32
    group_size: int  # K when there is one scale per output channel
    perm: torch.Tensor | None = None  # [K] int64: kernel column j multiplies x[:, perm[j]]

    def __post_init__(self) -> None:
        n, k = self.qweight.shape
        assert self.qweight.dtype == torch.int8, f"qweight must be int8, got {self.qweight.dtype}"
        assert self.scales.dtype == torch.float32, f"scales must be float32, got {self.scales.dtype}"
        assert tuple(self.scales.shape) == (n, -(-k // self.group_size)), (
            f"scales {list(self.scales.shape)} do not match qweight {[n, k]} in groups of {self.group_size}")
        assert self.perm is None or tuple(self.perm.shape) == (k,), "perm must have one entry per input column"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this stands for, in the checkpoint's column order."""
        k = self.qweight.shape[1]
        w = self.qweight.float() * self.scales.repeat_interleave(self.group_size, dim=1)[:, :k]
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out
