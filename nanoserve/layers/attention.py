"""Paged attention: store this step's K/V at their slots, then attend through block tables.

The batch is ordered decodes first (one query token each), then prefills/chunks, so each part
goes to the kernel made for it. Backends share one signature (see nanoserve/kernels/).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from nanoserve.kernels.paged_attention import paged_attention_decode_torch, paged_attention_varlen_torch
from nanoserve.kernels.store_kv import store_kv_torch

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence reads. Built once a step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    num_decode_tokens: int  # the first num_decode_tokens tokens are one-token sequences
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, cache length including the new token
    decode_max_context_len: int
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32, offsets into the prefill tokens
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_context_lens: torch.Tensor  # [num_prefills] int32
    prefill_max_seqlen_q: int
    prefill_max_context_len: int

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Callable
    varlen: Callable  # (q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, max_q, max_ctx, scale)
    decode: Callable  # (q, k_cache, v_cache, block_tables, context_lens, max_ctx, scale)


TORCH_BACKEND = AttentionBackend("torch", store_kv_torch, paged_attention_varlen_torch, paged_attention_decode_torch)


def select_attention_backend(
    device: torch.device, requested: str, block_size: int, dtype: torch.dtype
) -> AttentionBackend:
    """Pick the backend once at startup: the C kernel (else torch) on CPU; flash-attn, else Triton, on CUDA."""
    if device.type != "cuda":
        if requested not in ("auto", "torch"):
            raise ValueError(f"attention_backend={requested!r} needs CUDA; on CPU only 'torch' runs")
        backend = _select_cpu_backend(requested, dtype)
    else:
        backend = _select_cuda_backend(requested, block_size, dtype)
    logger.info("attention backend: %s", backend.name)
    return backend


def _select_cpu_backend(requested: str, dtype: torch.dtype) -> AttentionBackend:
    """auto: the C kernel (kernels/cpu_attention.c, built on first use) where it builds; else torch."""
    from nanoserve.kernels import cpu_attention as ca

    if requested == "auto" and ca.supports(dtype) and ca.available():
        return AttentionBackend("cpu", store_kv_torch, ca.paged_attention_varlen_cpu, ca.paged_attention_decode_cpu)
    return TORCH_BACKEND


def _select_cuda_backend(requested: str, block_size: int, dtype: torch.dtype) -> AttentionBackend:
    from nanoserve.kernels import flash_attn as fa
    from nanoserve.kernels import triton_paged_attention as tpa
    from nanoserve.kernels.store_kv import store_kv_triton

    half = dtype in (torch.float16, torch.bfloat16)
    flash_ok = fa.flash_attn_available() and fa.flash_attn_supports_block_size(block_size) and half
    if requested == "flash_attn" and not flash_ok:
        raise ValueError(
            "attention_backend='flash_attn' needs the flash-attn package (pip install nanoserve[cuda]), "
            f"a kvcache_block_size that is a multiple of 256 (got {block_size}) and a float16/bfloat16 "
            f"dtype (got {dtype})"
        )
    if requested == "torch":
        return AttentionBackend("torch", store_kv_triton, paged_attention_varlen_torch, paged_attention_decode_torch)
    if requested == "flash_attn" or (requested == "auto" and flash_ok):
        return AttentionBackend(
            "flash_attn", store_kv_triton, fa.paged_attention_varlen_flash, fa.paged_attention_decode_flash
        )
    return AttentionBackend(
        "triton", store_kv_triton, tpa.paged_attention_varlen_triton, tpa.paged_attention_decode_triton
    )


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.backend = TORCH_BACKEND
        # Views into the engine's single 6-D KV tensor, bound by the ModelRunner.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if meta.num_prefills == 0:
            return self._decode(q, meta)
        if nd == 0:
            return self._prefill(q, meta)
        return torch.cat([self._decode(q[:nd], meta), self._prefill(q[nd:], meta)])

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.decode(
            q, self.k_cache, self.v_cache, meta.decode_block_tables, meta.decode_context_lens,
            meta.decode_max_context_len, self.scale,
        )

    def _prefill(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.varlen(
            q, self.k_cache, self.v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
            meta.prefill_block_tables, meta.prefill_max_seqlen_q, meta.prefill_max_context_len, self.scale,
        )
