"""The CPU backend: C kernels for attention and the small fused ops, and a GEMM choice per CPU class.

GEMMs. On a CPU without bf16/fp16 dot-product instructions (AVX2 and older: no AVX512-BF16/FP16,
no AMX) PyTorch's low-precision GEMM falls back to a slow kernel, 5-10x below float32 MKL on the
same cores (~20 against ~140 GFLOP/s on 2 Zen 3 cores). There, and for float32 models, every
linear layer runs through a float32 `CPUWeight` (oneDNN-prepacked float32 copy; the skinny C GEMM
on the bf16 weight for decode-sized batches). Products of bf16 values are exact in float32 and
both accumulate in float32, so rounding back to bf16 gives a bf16 GEMM's answer up to summation
order. The float32 copies cost 4 bytes per weight on top of the model. Elsewhere F.linear runs in
the model's dtype.

Attention runs the C kernels in float32 whatever the cache dtype; without them (no compiler, or
switched off) the torch reference runs, widened to float32 where bf16 matmuls are slow.

Switches, read once at startup (`CPUOptions.from_env`):
  NANOSERVE_CPU_GEMM=auto|fp32|native   float32 GEMMs where bf16 is slow (auto), always, never
  NANOSERVE_CPU_KERNELS=1|0             build and use the C kernels
  NANOSERVE_CPU_ATTENTION=auto|torch    the C attention kernels, or the torch reference
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nanoserve.backends.base import Backend, LinearFn
from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.kernels import cpu_attention, cpu_kernels
from nanoserve.kernels.cpu_gemm import CPUWeight
from nanoserve.kernels.paged_attention import paged_attention_decode_torch, paged_attention_varlen_torch

logger = logging.getLogger(__name__)

# Up to this many rows (a decode batch) a bf16 weight goes through the skinny C GEMM. Measured on
# 2 AVX2 cores over all of Qwen3-0.6B's weights (28 layers + LM head) against the oneDNN copy:
# 56 vs 96 ms at 1 row, 131 vs 194 ms at 8, 220 vs 283 ms at 16.
SKINNY_MAX_ROWS = 16


@dataclass(frozen=True)
class CPUOptions:
    gemm: str = "auto"
    kernels: bool = True
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.gemm not in ("auto", "fp32", "native"):
            raise ValueError(f"NANOSERVE_CPU_GEMM must be auto, fp32 or native, got {self.gemm!r}")
        if self.attention not in ("auto", "torch"):
            raise ValueError(f"NANOSERVE_CPU_ATTENTION must be auto or torch, got {self.attention!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "CPUOptions":
        kernels = environ.get("NANOSERVE_CPU_KERNELS", "1")
        if kernels not in ("0", "1"):
            raise ValueError(f"NANOSERVE_CPU_KERNELS must be 0 or 1, got {kernels!r}")
        return cls(environ.get("NANOSERVE_CPU_GEMM", "auto"), kernels == "1",
                   environ.get("NANOSERVE_CPU_ATTENTION", "auto"))


def native_lowp_gemm(dtype: torch.dtype) -> bool:
    """Does this CPU have dot-product instructions for `dtype` (AVX512-BF16/FP16, AMX)?"""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


class CPUBackend(Backend):
    name = "cpu"

    def __init__(self, device: torch.device, dtype: torch.dtype, options: CPUOptions | None = None) -> None:
        super().__init__(device, dtype)
        self.options = options or CPUOptions()
        lib = cpu_kernels.load() if self.options.kernels else None
        if self.options.kernels and lib is None:
            logger.info("the CPU kernels could not be built: PyTorch paths run instead")
        self.kernels = cpu_kernels.CPUKernels(lib) if lib is not None else None
        self.attention_lib = lib if self.options.attention == "auto" and dtype in cpu_attention.DTYPE_CODES else None
        lowp = dtype in (torch.bfloat16, torch.float16)
        if self.options.gemm == "native":
            self.fp32_gemm = False
        else:
            self.fp32_gemm = self.options.gemm == "fp32" or dtype == torch.float32 or not native_lowp_gemm(dtype)
        # Attention without the C kernels: widen where bf16/fp16 matmuls are slow.
        self.attention_dtype = torch.float32 if lowp and not native_lowp_gemm(dtype) else None

    def describe(self) -> dict[str, str]:
        if self.fp32_gemm:
            gemm = "oneDNN float32 (prepacked)"
            if self.kernels is not None and self.dtype == torch.bfloat16:
                gemm += f" + skinny bf16-weight C GEMM up to {SKINNY_MAX_ROWS} rows"
        else:
            gemm = f"F.linear {str(self.dtype).removeprefix('torch.')}"
        attention = "C paged attention" if self.attention_lib is not None else "torch SDPA"
        return {"backend": self.name, "gemm": gemm, "attention": attention,
                "fused ops": "C" if self.kernels is not None else "torch"}

    # ---- linear layers ------------------------------------------------------------------------

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn:
        if not self.fp32_gemm:
            return super().prepare_linear(weight, bias)
        return CPUWeight(weight, bias, self.kernels, SKINNY_MAX_ROWS)

    # ---- small ops ----------------------------------------------------------------------------

    def rms_norm(self, x, weight, eps, residual=None):
        if self.kernels is not None:
            fused = self.kernels.rms_norm(x, weight, eps, residual)
            if fused is not None:
                return fused
        return super().rms_norm(x, weight, eps, residual)

    def rotary(self, positions, q, k, cos_sin, head_dim, qk_norm=None):
        if self.kernels is not None and qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            fused = self.kernels.qk_norm_rope(q, k, q_weight, k_weight, eps, positions, cos_sin, head_dim)
            if fused is not None:
                return fused
        return super().rotary(positions, q, k, cos_sin, head_dim, qk_norm)

    # ---- attention ----------------------------------------------------------------------------

    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        if self.attention_lib is None or meta.num_prefills == 0 or meta.prefill_max_seqlen_q > cpu_attention.VARLEN_MAX_Q:
            return meta
        tiles = cpu_attention.varlen_tiles(meta.prefill_cu_seqlens_q, meta.prefill_context_lens)
        return CPUAttentionMetadata(**vars(meta), prefill_tiles=tiles)

    def decode(self, q, k_cache, v_cache, meta, scale):
        if self.attention_lib is None:
            return paged_attention_decode_torch(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                meta.decode_max_context_len, scale, self.attention_dtype,
            )
        return cpu_attention.paged_attention_decode_cpu(
            self.attention_lib, q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        if self.attention_lib is None:
            return paged_attention_varlen_torch(
                q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.prefill_block_tables,
                meta.prefill_max_seqlen_q, meta.prefill_max_context_len, scale, self.attention_dtype,
            )
        tiles = getattr(meta, "prefill_tiles", None)
        if tiles is None:  # long query runs: SDPA's blocked GEMMs beat the C kernel
            return cpu_attention.varlen_sdpa_per_sequence(
                q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.prefill_block_tables,
                scale,
            )
        return cpu_attention.paged_attention_varlen_cpu(
            self.attention_lib, q, k_cache, v_cache, meta.prefill_block_tables, tiles, scale
        )


@dataclass
class CPUAttentionMetadata(AttentionMetadata):
    prefill_tiles: cpu_attention.VarlenTiles | None = None  # the varlen C kernel's work items for this step
