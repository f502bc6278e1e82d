"""The flash-attn 2 backend (CUDA, fp16/bf16, compute capability >= 8.0): flash-attn for attention,
Triton for the K/V store.

Per step (`prepare_metadata`) it derives the int32 cumulative lengths flash-attn takes, once for all
layers. A prefill step whose sequences have no cached context attends over the step's own
contiguous K/V, as nano-vllm does: with a block table flash-attn always takes its split-KV kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.backends.triton import TritonBackend
from nanoserve.kernels import flash_attn as fa


@dataclass
class FlashAttnMetadata(AttentionMetadata):
    decode_cu_seqlens_q: torch.Tensor | None = None  # [num_decodes + 1] int32: 0, 1, 2, ...
    decode_cu_seqlens_k: torch.Tensor | None = None  # [num_decodes + 1] int32
    prefill_cu_seqlens_k: torch.Tensor | None = None  # [num_prefills + 1] int32


class FlashAttnBackend(TritonBackend):
    name = "flash_attn"
    preferred_block_size = fa.FLASH_ATTN_PAGE_BLOCK_MULTIPLE  # flash-attn 2's paged-KV minimum

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "attention": "flash-attn 2 (varlen)"}

    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        nd = meta.num_decode_tokens
        return FlashAttnMetadata(
            **vars(meta),
            decode_cu_seqlens_q=torch.arange(nd + 1, dtype=torch.int32, device=meta.slot_mapping.device),
            decode_cu_seqlens_k=fa.cumulative(meta.decode_context_lens),
            prefill_cu_seqlens_k=fa.cumulative(meta.prefill_context_lens),
        )

    def decode(self, q, k_cache, v_cache, meta, scale):
        return fa.varlen_flash(
            q, k_cache, v_cache, meta.decode_cu_seqlens_q, meta.decode_cu_seqlens_k, 1,
            meta.decode_max_context_len, scale, block_table=meta.decode_block_tables,
        )

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        if not meta.prefills_have_context:  # every prefill starts at position 0: keys are this step's
            cu = meta.prefill_cu_seqlens_q
            return fa.varlen_flash(q, k, v, cu, cu, meta.prefill_max_seqlen_q, meta.prefill_max_seqlen_q, scale)
        return fa.varlen_flash(
            q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_cu_seqlens_k, meta.prefill_max_seqlen_q,
            meta.prefill_max_context_len, scale, block_table=meta.prefill_block_tables,
        )
