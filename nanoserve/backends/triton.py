"""CUDA backends on Triton kernels: K/V stored by a Triton kernel, attention by Triton or torch.

`TritonBackend` runs the Triton paged-attention kernels (varlen and split-K decode); it is the
CUDA default where flash-attn is missing or cannot run. `CUDATorchBackend` keeps the torch
reference attention on CUDA (for comparisons); it stores K/V with the Triton kernel because the
reference store's boolean mask needs a host sync, which CUDA-graph capture forbids.
"""
from __future__ import annotations

from functools import partial

from nanoserve.backends.base import Backend, MoEFn
from nanoserve.kernels import triton_paged_attention as tpa
from nanoserve.kernels.fused_moe_triton import fused_moe_triton
from nanoserve.kernels.store_kv import store_kv_triton


class CUDATorchBackend(Backend):
    name = "torch"
    # A captured decode would bake in gathers of [bucket, kv_heads, max_model_len, head_dim] per
    # layer (GBs at 256 sequences): this backend runs eagerly.
    supports_cuda_graphs = False

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)


class TritonBackend(Backend):
    name = "triton"

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "attention": "Triton paged attention"}

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)

    def prepare_moe(self, w13, w2) -> MoEFn:
        return partial(fused_moe_triton, w13=w13.contiguous(), w2=w2.contiguous())

    def decode(self, q, k_cache, v_cache, meta, scale):
        return tpa.paged_attention_decode_triton(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.decode_max_context_len, scale
        )

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        return tpa.paged_attention_varlen_triton(
            q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.prefill_block_tables,
            meta.prefill_max_seqlen_q, meta.prefill_max_context_len, scale,
        )
