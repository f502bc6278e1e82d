"""CUDA backends on Triton kernels: K/V stored by a Triton kernel, attention by Triton or torch.

`TritonBackend` runs the Triton paged-attention kernels (varlen and split-K decode); it is the
CUDA default where flash-attn is missing or cannot run. `CUDATorchBackend` keeps the torch
reference attention on CUDA (for comparisons); it stores K/V with the Triton kernel because the
reference store's boolean mask needs a host sync, which CUDA-graph capture forbids.

Speed work whose old path stays selectable, so a GPU run can compare both (read once at startup):
  NANOSERVE_TRITON_FUSED_OPS=1|0        RMSNorm+residual, q/k-norm+RoPE, SiLU-and-mul as one Triton
                                        kernel each (kernels/triton_fused_ops.py), or the torch ops
  NANOSERVE_TRITON_PREFILL=block|key    Triton prefill tiled by KV block, or looked up per key
  NANOSERVE_TRITON_MOE_TILES=table|fixed  fused-MoE tile by tokens per expert, or one 16x64x64 tile
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nanoserve.backends.base import Backend, MoEFn
from nanoserve.kernels import triton_fused_ops as fused
from nanoserve.kernels import triton_paged_attention as tpa
from nanoserve.kernels.fused_moe_triton import fused_moe_triton
from nanoserve.kernels.store_kv import store_kv_triton

_CHOICES = {"NANOSERVE_TRITON_FUSED_OPS": ("1", "0"), "NANOSERVE_TRITON_PREFILL": ("block", "key"),
            "NANOSERVE_TRITON_MOE_TILES": ("table", "fixed")}


@dataclass(frozen=True)
class TritonOptions:
    fused_ops: bool = True
    prefill_by_block: bool = True
    moe_tile_table: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "TritonOptions":
        values = []
        for name, choices in _CHOICES.items():
            value = environ.get(name, choices[0])
            if value not in choices:
                raise ValueError(f"{name} must be {' or '.join(choices)}, got {value!r}")
            values.append(value == choices[0])
        return cls(*values)


class CUDATorchBackend(Backend):
    name = "torch"
    # A captured decode would bake in gathers of [bucket, kv_heads, max_model_len, head_dim] per
    # layer (GBs at 256 sequences): this backend runs eagerly.
    supports_cuda_graphs = False

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)


class TritonBackend(Backend):
    name = "triton"

    def __init__(self, device: torch.device, dtype: torch.dtype, options: TritonOptions | None = None) -> None:
        super().__init__(device, dtype)
        self.options = options or TritonOptions.from_env()
        self.fused_ops = self.options.fused_ops and device.type == "cuda"  # CPU tensors: the torch ops

    def describe(self) -> dict[str, str]:
        prefill = "by KV block" if self.options.prefill_by_block else "per key"
        return {**super().describe(), "attention": f"Triton paged attention (prefill tiles {prefill})",
                "fused ops": "Triton" if self.fused_ops else "torch",
                "MoE tiles": "by tokens per expert" if self.options.moe_tile_table else "fixed"}

    def rms_norm(self, x, weight, eps, residual=None):
        if self.fused_ops:
            return fused.rms_norm_triton(x, weight, eps, residual)
        return super().rms_norm(x, weight, eps, residual)

    def qk_norm_rope(self, positions, q, k, cos_sin, q_weight, k_weight, eps):
        if self.fused_ops:
            return fused.qk_norm_rope_triton(positions, q, k, cos_sin, q_weight, k_weight, eps)
        return super().qk_norm_rope(positions, q, k, cos_sin, q_weight, k_weight, eps)

    def silu_and_mul(self, x):
        if self.fused_ops:
            return fused.silu_and_mul_triton(x)
        return super().silu_and_mul(x)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)

    def prepare_moe(self, w13, w2, quantize: bool = True) -> MoEFn:
        w13, w2, tile_table = w13.contiguous(), w2.contiguous(), self.options.moe_tile_table

        def experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
            return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, tile_table=tile_table)

        return experts

    def decode(self, q, k_cache, v_cache, meta, scale):
        return tpa.paged_attention_decode_triton(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.decode_max_context_len, scale
        )

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        return tpa.paged_attention_varlen_triton(
            q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.prefill_block_tables,
            meta.prefill_max_seqlen_q, meta.prefill_max_context_len, scale, self.options.prefill_by_block,
        )
